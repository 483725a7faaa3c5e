"""The release gate: one fixture per decision, numeric tolerance scopes, segments, triage, and mirror-gate
conversion of vLLM- and SGLang-style observations."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from ominix_runtime.release.commands import main
from ominix_runtime.release.gate import gate_from_json
from ominix_runtime.release.inputs import Fields, ReleaseInputError
from ominix_runtime.release.mirror import mirror_gate, read_side, text_fingerprint

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _doc(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _signals(decision: dict[str, Any]) -> set[str]:
    return {t["signal"] for t in decision["triage"] if t["segment"] == "all"}


def test_safe_candidate_is_promoted() -> None:
    decision = gate_from_json(_doc("gate_safe"))
    assert decision["decision"] == "promote"
    assert decision["reasons"] == [] and decision["triage"] == []
    assert decision["summary"]["outputs"]["exact_matches"] == 24
    assert decision["traffic"]["matched"] == 24


def test_output_mismatch_and_errors_roll_back() -> None:
    decision = gate_from_json(_doc("gate_mismatch_errors"))
    assert decision["decision"] == "rollback"
    assert _signals(decision) == {"output_mismatch", "error_rate"}
    summary = decision["summary"]
    assert summary["outputs"]["mismatches"] == 2
    assert summary["errors"]["candidate"] == 3 and summary["errors"]["rate_increase"] == pytest.approx(3 / 24)
    mismatch = next(t for t in decision["triage"] if t["signal"] == "output_mismatch")
    assert sorted(mismatch["example_request_ids"]) == ["req-11", "req-3"]
    assert mismatch["response"] == "rollback" and mismatch["owner_hint"] and mismatch["next_step"]


def test_errors_alone_roll_back_above_policy_only() -> None:
    doc = _doc("gate_mismatch_errors")
    for o in doc["candidate"]["observations"]:  # keep the errors, fix the outputs
        if o["request_id"] in ("req-3", "req-11"):
            o["output_token_ids"] = next(
                b["output_token_ids"]
                for b in doc["baseline"]["observations"]
                if b["request_id"] == o["request_id"]
            )
    assert _signals(gate_from_json(doc)) == {"error_rate"}
    doc["policy"]["max_error_rate_increase"] = 0.2  # 12.5% more errors is within this policy
    assert gate_from_json(doc)["decision"] == "promote"


def test_values_within_the_scoped_numeric_tolerance_promote() -> None:
    decision = gate_from_json(_doc("gate_numeric_tolerance"))
    assert decision["decision"] == "promote"
    outputs = decision["summary"]["outputs"]
    assert outputs["within_tolerance"] == 24 and outputs["numeric_drifts"] == 0
    assert outputs["max_abs_delta"] == pytest.approx(0.0004)


def test_the_same_values_outside_the_scope_are_drift() -> None:
    doc = _doc("gate_numeric_tolerance")
    for o in doc["candidate"]["observations"]:
        o["accelerator"] = "H200"  # only the zero-tolerance cuda-wide scope covers this segment
    decision = gate_from_json(doc)
    assert decision["decision"] == "rollback"
    assert _signals(decision) == {"numeric_drift"}
    assert decision["summary"]["outputs"]["numeric_drifts"] == 24


def test_latency_regression_holds() -> None:
    decision = gate_from_json(_doc("gate_latency_regression"))
    assert decision["decision"] == "hold"
    assert _signals(decision) == {"latency_p95", "ttft_p95", "decode_p95"}
    assert decision["summary"]["latency_ms"]["regression_pct"] == pytest.approx(25.0)
    latency = next(t for t in decision["triage"] if t["signal"] == "latency_p95")
    assert latency["example_request_ids"][0] == "req-23"  # the slowest request lost the most time


def test_kv_pressure_increase_holds() -> None:
    doc = _doc("gate_safe")
    for o in doc["candidate"]["observations"]:
        o["kv_pressure_pct"] += 8.0
    decision = gate_from_json(doc)
    assert decision["decision"] == "hold" and _signals(decision) == {"kv_pressure"}
    assert decision["summary"]["kv_pressure_pct"]["increase_points"] == pytest.approx(8.0)


def test_missing_evidence_holds() -> None:
    decision = gate_from_json(_doc("gate_missing_evidence"))
    assert decision["decision"] == "hold"
    assert _signals(decision) == {"missing_evidence"}
    assert decision["summary"]["evidence"] == {
        "route": 0.0,
        "scheduler": 0.5,
        "streaming": 1.0,
        "outputs": 1.0,
    }


def test_too_little_matched_traffic_holds() -> None:
    doc = _doc("gate_safe")
    doc["candidate"]["observations"] = doc["candidate"]["observations"][:10]
    decision = gate_from_json(doc)
    assert decision["decision"] == "hold" and _signals(decision) == {"too_little_traffic"}
    assert decision["traffic"]["matched"] == 10 and decision["traffic"]["baseline_only"]


def test_segments_are_judged_apart() -> None:
    doc = _doc("gate_safe")
    for o in doc["candidate"]["observations"]:
        if int(o["request_id"].split("-")[1]) % 2:
            o["accelerator"] = "H200"
            o["latency_ms"] *= 1.5
    decision = gate_from_json(doc)
    segments = {s["accelerator"]: s for s in decision["segments"]}
    assert segments["H100"]["decision"] == "promote"
    assert segments["H200"]["decision"] == "hold"
    assert segments["H100"]["matched"] == segments["H200"]["matched"] == 12
    h200 = next(t for t in decision["triage"] if t["segment"] == "cuda/H200/llama-8b@r1")
    assert h200["signal"] == "latency_p95"
    assert all(int(rid.split("-")[1]) % 2 for rid in h200["example_request_ids"])


def test_mirrored_vllm_to_sglang_promotes_and_converts_timings() -> None:
    gate_input, decision = mirror_gate(_doc("mirror_vllm_to_sglang"))
    assert decision["decision"] == "promote", decision["reasons"]
    assert decision["summary"]["outputs"]["exact_matches"] == 24
    base = {o["request_id"]: o for o in gate_input["baseline"]["observations"]}
    cand = {o["request_id"]: o for o in gate_input["candidate"]["observations"]}
    # Epoch timestamps carry about a microsecond of float error.
    assert base["req-2"]["ttft_ms"] == pytest.approx(42.0, abs=1e-3)  # first stream event - arrival
    assert base["req-2"]["decode_gaps_ms"] == pytest.approx([6.0, 6.0, 6.0], abs=1e-3)
    assert base["req-2"]["kv_pressure_pct"] == pytest.approx(32.0) and base["req-2"]["queue_depth"] == 2
    assert cand["req-2"]["ttft_ms"] == pytest.approx(40.0, abs=1e-3)
    assert cand["req-2"]["latency_ms"] == pytest.approx(40.0 + 3 * 5.8 + 1.0, abs=1e-3)
    assert cand["req-2"]["replica"] == "0" and cand["req-2"]["route"] == "mirror-b"
    assert base["req-2"]["output_fingerprint"] == cand["req-2"]["output_fingerprint"]
    # The gate input round-trips through the gate itself.
    assert gate_from_json(gate_input)["decision"] == "promote"


def test_mirrored_candidate_with_other_tokens_rolls_back() -> None:
    doc = _doc("mirror_vllm_to_sglang")
    doc["candidate"]["records"][4]["output_ids"] = [1, 2, 3, 4]
    _, decision = mirror_gate(doc)
    assert decision["decision"] == "rollback" and _signals(decision) == {"output_mismatch"}


def test_text_and_token_fingerprints_are_not_compared() -> None:
    doc = _doc("mirror_vllm_to_sglang")
    for r in doc["candidate"]["records"]:
        r["text"] = "hello"
        del r["output_ids"]
    _, decision = mirror_gate(doc)
    assert decision["summary"]["outputs"]["unchecked"] == 24
    assert decision["decision"] == "hold"  # no comparable output evidence


def test_bench_serve_result_format() -> None:
    side = {
        "format": "bench-serve",
        "build": "vllm-0.26.0",
        "backend": "vllm",
        "route": "vllm-serve",
        "result": {
            "ttfts": [0.05, 0.0],
            "itls": [[0.01, 0.02], []],
            "generated_texts": ["abc", ""],
            "errors": ["", "timeout"],
        },
    }
    build = read_side(Fields(side, "baseline"))
    ok, failed = build.observations
    assert ok.request_id == "req-0" and ok.ttft_ms == pytest.approx(50.0)
    assert ok.latency_ms == pytest.approx(80.0) and ok.decode_gaps_ms == pytest.approx((10.0, 20.0))
    assert ok.output_fingerprint == text_fingerprint("abc")
    assert not failed.ok and failed.error == "timeout"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("candidate"), "gate.candidate is missing"),
        (lambda d: d["baseline"]["observations"].append(d["baseline"]["observations"][0]), "observed twice"),
        (lambda d: d["baseline"]["observations"][0].update(latency_ms="slow"), "latency_ms must be a finite"),
        (lambda d: d["policy"].update(required_evidence=["vibes"]), "required_evidence"),
    ],
)
def test_bad_gate_input_is_a_clear_error(mutate: Any, message: str) -> None:
    doc = copy.deepcopy(_doc("gate_safe"))
    mutate(doc)
    with pytest.raises(ReleaseInputError, match=message):
        gate_from_json(doc)


def test_commands_exit_with_the_decision(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "decision.json"
    cases = {"gate_safe": 0, "gate_latency_regression": 3, "gate_mismatch_errors": 4}
    for name, code in cases.items():
        assert main("gate", ["--input", str(FIXTURES / f"{name}.json"), "--output", str(out)]) == code
        assert json.loads(out.read_text())["decision"] in capsys.readouterr().out
    safe = _doc("gate_safe")
    (tmp_path / "b.json").write_text(json.dumps(safe["baseline"]))
    (tmp_path / "c.json").write_text(json.dumps(safe["candidate"]))
    args = [
        "--baseline",
        str(tmp_path / "b.json"),
        "--candidate",
        str(tmp_path / "c.json"),
        "--output",
        str(out),
    ]
    assert main("gate", args) == 0
    assert main("gate", ["--baseline", str(tmp_path / "b.json"), "--output", str(out)]) == 2
    assert "both --baseline and --candidate" in capsys.readouterr().err
    gate_input = tmp_path / "gate.json"
    mirror_args = ["--input", str(FIXTURES / "mirror_vllm_to_sglang.json"), "--output", str(out)]
    assert main("mirror-gate", [*mirror_args, "--gate-input", str(gate_input)]) == 0
    assert main("gate", ["--input", str(gate_input), "--output", str(out)]) == 0
