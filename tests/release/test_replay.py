"""Replay through the real Scheduler and KV registry: fixture figures and fingerprints, hand-checked cases,
and the fingerprint's invariance (JSON key order, hash seed, cost model) and sensitivity (one decision).

The ``*.expected.json`` files were written from ``ominix-runtime replay`` output; the small case is also
derived by hand below, and the others are checked for the behaviour they exist to show.
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ominix_runtime.contract import DecodeStep, NewRequestData, SamplingParams
from ominix_runtime.engine.scheduler import Scheduler
from ominix_runtime.release.commands import main
from ominix_runtime.release.fingerprint import fingerprint
from ominix_runtime.release.inputs import ReleaseInputError
from ominix_runtime.release.replay import replay
from ominix_runtime.release.replay_report import replay_report
from ominix_runtime.release.simulated_worker import SimulatedWorker, WorkerContractViolation
from ominix_runtime.release.workload import workload_from_json

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]


def _doc(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"replay_{name}.json").read_text())


def _report(doc: dict[str, Any]) -> dict[str, Any]:
    return replay_report(replay(workload_from_json(doc)))


@pytest.mark.parametrize("name", ["small", "pressure", "priorities"])
def test_fixture_matches_expected_figures_and_fingerprint(name: str) -> None:
    expected = json.loads((FIXTURES / f"replay_{name}.expected.json").read_text())
    report = _report(_doc(name))
    assert report["trace_fingerprint"] == expected["trace_fingerprint"]
    for section in ("kv", "queue", "utilisation", "totals"):
        assert report[section] == expected[section], section
    assert sorted(report["rejected"]) == expected["rejected"]
    got = {c["id"]: {k: c[k] for k in expected["completions"][c["id"]]} for c in report["completions"]}
    assert got == expected["completions"]
    assert report["kv"]["all_blocks_returned"] is True


def test_small_trace_by_hand() -> None:
    """Budget 64, blocks of 16: a (40) and b (24 of 40) share step 1; b's prefill ends in step 2."""
    report = _report(_doc("small"))
    rows = [(t["scheduled"], t["decoded"], t["completed"], t["kv_blocks_used"]) for t in report["trace"]]
    assert rows == [
        ([["a", 40], ["b", 24]], ["a"], [], 3 + 2),  # a: 40 tokens = 3 blocks, b: 24 = 2
        ([["a", 1], ["b", 16]], ["a", "b"], [], 3 + 3),
        ([["a", 1], ["b", 1]], ["a", "b"], ["a", "b"], 6),  # a reaches max_tokens 3, b 2
        ([], [], [], 0),  # the step that only tells the worker to drop both
    ]
    assert report["totals"]["simulated_ms"] == pytest.approx(20 + 20 + (5 + 1 / 3) + 5, abs=1e-6)
    assert report["utilisation"]["token_budget"] == pytest.approx((64 + 17 + 2) / (3 * 64), abs=1e-6)
    assert report["kv"]["peak_pressure_pct"] == pytest.approx(100 * 6 / 64)


def test_pressure_preempts_rejects_and_returns_every_block() -> None:
    report = _report(_doc("pressure"))
    assert report["kv"]["peak_pressure_pct"] == 100.0
    assert report["totals"]["preemptions"] > 0
    assert report["queue"]["queue_pressure_ticks"] > 0
    assert list(report["rejected"]) == ["too-big"]
    assert report["rejected"]["too-big"].startswith("KV_CAPACITY_EXCEEDED")
    finished = [c for c in report["completions"] if c["finish"] == "LENGTH"]
    assert {c["id"] for c in finished} == {"p0", "p1", "p2", "p3", "p4"}
    assert all(c["output_tokens"] == 48 for c in finished if c["id"] != "p4")
    # Recomputation after preemption: more prefill computed than prompts admitted.
    assert report["totals"]["prefill_tokens_computed"] > report["totals"]["prompt_tokens"]
    assert report["kv"] | {"peak_blocks": 0, "peak_pressure_pct": 0} == {
        "peak_blocks": 0,
        "peak_pressure_pct": 0,
        "all_blocks_returned": True,
        "leases_left": 0,
        "leased_blocks_left": 0,
        "reusable_blocks": 16,
        "worker_requests_left": 0,
        "problem": "",
    }


def test_priorities_realtime_displaces_batch_and_prefix_is_shared() -> None:
    report = _report(_doc("priorities"))
    by_id = {c["id"]: c for c in report["completions"]}
    # All three slots are busy with batch work when the realtime request arrives: it is admitted at once.
    assert by_id["alarm"]["first_admitted_tick"] == by_id["alarm"]["arrival_tick"] == 6
    assert by_id["alarm"]["finish_tick"] < min(by_id[f"batch-{i}"]["finish_tick"] for i in range(3))
    assert sum(by_id[f"batch-{i}"]["preemptions"] for i in range(3)) >= 1
    assert by_id["chat-1"]["cached_tokens"] == 32  # the "system" prefix left behind by chat-0
    assert report["queue"]["active_capacity_ticks"] > 0


def _shuffle_keys(value: Any, rng: random.Random) -> Any:
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: _shuffle_keys(v, rng) for k, v in items}
    if isinstance(value, list):
        return [_shuffle_keys(v, rng) for v in value]
    return value


def test_fingerprint_ignores_json_key_order() -> None:
    doc = _doc("priorities")
    reference = _report(doc)["trace_fingerprint"]
    for seed in range(3):
        shuffled = _shuffle_keys(copy.deepcopy(doc), random.Random(seed))
        assert list(shuffled) != list(doc) or seed > 0
        assert _report(shuffled)["trace_fingerprint"] == reference


def test_fingerprint_ignores_the_cost_model() -> None:
    doc = _doc("small")
    reference = _report(doc)
    doc["cost"] = {"kind": "capability", "memory_bandwidth_gb_s": 50, "step_overhead_ms": 3}
    other = _report(doc)
    assert other["trace_fingerprint"] == reference["trace_fingerprint"]
    assert other["totals"]["simulated_ms"] != reference["totals"]["simulated_ms"]


def test_fingerprint_is_the_same_in_another_process_with_another_hash_seed(tmp_path: Path) -> None:
    """String hashing is randomised per process; the fingerprint must not depend on it."""
    fingerprints = set()
    for seed in ("0", "4242"):
        out = tmp_path / f"report-{seed}.json"
        code = (
            "import sys; from ominix_runtime.release.commands import main; "
            f"sys.exit(main('replay', ['--input', {str(FIXTURES / 'replay_pressure.json')!r}, "
            f"'--output', {str(out)!r}]))"
        )
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True, timeout=120)
        fingerprints.add(json.loads(out.read_text())["trace_fingerprint"])
    expected = json.loads((FIXTURES / "replay_pressure.expected.json").read_text())["trace_fingerprint"]
    assert fingerprints == {expected}


def test_fingerprint_changes_when_one_decision_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = _doc("pressure")
    run = replay(workload_from_json(doc))
    reference = run.trace_fingerprint
    # One decision in the trace: one request granted one token fewer in one step.
    tick = next(t for t in run.ticks if len(t.scheduled) > 1)
    rid, n = tick.scheduled[0]
    tick.scheduled[0] = (rid, n - 1)
    assert run.trace_fingerprint != reference

    # One changed policy decision in the scheduler: pick the earliest victim instead of the latest.
    original = Scheduler._pick_victim

    def earliest_victim(self: Scheduler, order: list[Any], start: int, step_id: int) -> Any:
        for cand in order[start:]:
            if cand.request_id in self.running:
                return cand
        return original(self, order, start, step_id)

    monkeypatch.setattr(Scheduler, "_pick_victim", earliest_victim)
    changed = replay(workload_from_json(doc))
    assert changed.trace_fingerprint != reference
    assert replay_report(changed)["kv"]["all_blocks_returned"] is True


def test_fingerprint_changes_with_arrival_order_within_a_tick() -> None:
    doc = _doc("small")
    reference = _report(doc)["trace_fingerprint"]
    doc["requests"].reverse()  # b is admitted first now: FCFS within the tick is list order
    assert _report(doc)["trace_fingerprint"] != reference


def test_fingerprint_helper_is_canonical() -> None:
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"requests": []}, "workload.requests is empty"),
        ({"requests": [{"id": "x", "max_tokens": 4}]}, "workload.requests[0].prompt_len is missing"),
        ({"requests": [{"id": "x", "prompt_len": 4, "max_tokens": 0}]}, "max_tokens must be >= 1"),
        ({"backend": {"profile": "tpu"}}, "workload.backend.profile must be one of"),
        ({"cost": {"kind": "guess"}}, "workload.cost.kind must be"),
        ({"requests": [{"id": "x", "prompt_len": 4, "max_tokens": 2, "priority": "urgent"}]}, "priority"),
    ],
)
def test_bad_workload_is_a_clear_error(patch: dict[str, Any], message: str) -> None:
    doc = _doc("small") | patch
    with pytest.raises(ReleaseInputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        workload_from_json(doc)


def test_command_writes_the_report_and_reports_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    assert main("replay", ["--input", str(FIXTURES / "replay_small.json"), "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["trace_fingerprint"] in capsys.readouterr().out
    assert len(report["trace"]) == report["totals"]["ticks"]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main("replay", ["--input", str(bad), "--output", str(out)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main("replay", ["--input", str(tmp_path / "missing.json"), "--output", str(out)]) == 2


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_end_every_request_and_return_every_block(seed: int) -> None:
    rng = random.Random(seed)
    requests = [
        {
            "id": f"r{i}",
            "prompt_len": rng.randint(1, 120),
            "max_tokens": rng.randint(1, 40),
            "priority": rng.choice(["realtime", "interactive", "batch"]),
            "arrival_tick": rng.randint(0, 60),
            **(
                {"prefix": {"group": rng.choice("xy"), "len": rng.randint(16, 48)}}
                if rng.random() < 0.4
                else {}
            ),
        }
        for i in range(rng.randint(5, 30))
    ]
    doc = {
        "backend": {
            "kv_block_size": rng.choice([4, 16]),
            "kv_num_blocks": rng.randint(12, 80),
            "max_batch_tokens": rng.choice([32, 64, 256]),
            "max_running_requests": rng.randint(1, 8),
            "model": {"vocab_size": 500, "max_model_len": 256},
        },
        "max_inflight_steps": rng.choice([1, 2]),
        "requests": requests,
    }
    report = _report(doc)
    assert report["kv"]["all_blocks_returned"], report["kv"]
    finished = {c["id"] for c in report["completions"] if c["finish"] == "LENGTH"}
    assert finished | set(report["rejected"]) == {r["id"] for r in requests}
    by_id = {c["id"]: c for c in report["completions"]}
    assert all(by_id[r["id"]]["output_tokens"] == r["max_tokens"] for r in requests if r["id"] in finished)
    assert report["kv"]["peak_blocks"] <= doc["backend"]["kv_num_blocks"]
    assert _report(doc)["trace_fingerprint"] == report["trace_fingerprint"]  # deterministic


@pytest.mark.parametrize(
    "field",
    [
        "prefill_tokens_beside_decodes",
        "prefill_backlog_tokens",
        "max_batch_tokens_with_decodes",
        "burst_backlog_tokens",
        "max_batch_tokens_in_burst",
        "backlog_admission_slots",
        "backlog_admission_max_wait_steps",
    ],
)
def test_the_scheduler_limits_beside_decodes_are_read_and_checked(field: str) -> None:
    doc = _doc("small") | {"scheduler": {field: 16}}
    assert getattr(workload_from_json(doc).scheduler, field) == 16
    with pytest.raises(ReleaseInputError, match=field):
        workload_from_json(_doc("small") | {"scheduler": {field: -1}})


def test_the_report_names_the_limits_beside_decodes_and_rates_use_against_each_step_s_budget() -> None:
    doc = _doc("small") | {
        "scheduler": {"max_batch_tokens_with_decodes": 24, "prefill_tokens_beside_decodes": 0}
    }
    run = replay(workload_from_json(doc))
    report = replay_report(run)
    backend = report["backend"]
    assert isinstance(backend, dict)
    assert backend["max_batch_tokens_with_decodes"] == 24 and backend["prefill_tokens_beside_decodes"] == 0
    assert backend["prefill_backlog_tokens"] == 0
    busy = [t for t in run.ticks if t.scheduled]
    assert any(t.token_budget == 24 for t in busy)
    assert all(t.prefill_tokens + t.decode_tokens <= t.token_budget for t in busy)
    used = sum(t.prefill_tokens + t.decode_tokens for t in busy)
    utilisation = report["utilisation"]
    assert isinstance(utilisation, dict)
    assert utilisation["token_budget"] == round(used / sum(t.token_budget for t in busy), 6)
    # The report gives the scheduler's budget, not the setting: 0 means the whole budget.
    whole = replay_report(
        replay(workload_from_json(_doc("small") | {"scheduler": {"max_batch_tokens_with_decodes": 0}}))
    )
    whole_backend = whole["backend"]
    assert isinstance(whole_backend, dict)
    assert whole_backend["max_batch_tokens_with_decodes"] == whole_backend["max_batch_tokens"] > 24


def test_the_report_gives_the_scheduler_s_burst_budget_and_the_threshold_as_set() -> None:
    def backend_of(scheduler: dict[str, int]) -> dict[str, object]:
        backend = replay_report(replay(workload_from_json(_doc("small") | {"scheduler": scheduler})))[
            "backend"
        ]
        assert isinstance(backend, dict)
        return backend

    # A burst budget between the one with decodes and the whole budget stays as set.
    between = backend_of({"max_batch_tokens_with_decodes": 24, "max_batch_tokens_in_burst": 40})
    assert between["max_batch_tokens_in_burst"] == 40 and between["burst_backlog_tokens"] == 16384
    # Off (threshold 0): the budget with decodes; above the whole budget: the whole budget.
    off = backend_of({"max_batch_tokens_with_decodes": 24, "burst_backlog_tokens": 0})
    assert off["max_batch_tokens_in_burst"] == 24 and off["burst_backlog_tokens"] == 0
    big = backend_of({"max_batch_tokens_with_decodes": 24, "max_batch_tokens_in_burst": 10**6})
    assert big["max_batch_tokens_in_burst"] == big["max_batch_tokens"] > 40


@pytest.mark.parametrize("takes", [True, False])
def test_simulated_worker_takes_a_whole_prompt_hit_only_as_its_capability_says(takes: bool) -> None:
    """A prompt found whole (32 tokens in two blocks, the last computed again) runs on a simulated worker whose
    capability states whole-prompt hits and is a contract violation on one that does not."""
    worker = SimulatedWorker(8, 16, 100, frozenset(), takes_whole_prompt_hits=takes)
    hit = NewRequestData(
        "r", list(range(3, 35)), SamplingParams(max_tokens=2), [0, 1], 31, 1, 7, num_cached_kv_tokens=32
    )
    step = DecodeStep(1, new_requests=[hit])
    if takes:
        (out,) = worker.execute(step).outputs
        assert out.request_id == "r" and out.sampled_token_id is not None
    else:
        with pytest.raises(WorkerContractViolation, match="not a whole-prompt hit this worker takes"):
            worker.execute(step)
