"""bench/serve.py writes per-request observations the release gate reads: two real runs against the daemon
are gated against each other, and the queue/KV evidence is attributed to requests as documented."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.observations import observation  # noqa: E402
from bench.serve import LoadSample, RequestResult  # noqa: E402
from ominix_runtime.release.commands import main as release_main  # noqa: E402
from ominix_runtime.release.fingerprint import token_fingerprint  # noqa: E402
from ominix_runtime.release.inputs import Fields  # noqa: E402
from ominix_runtime.release.observations import build_from_json  # noqa: E402


def test_one_observation_takes_queue_depth_at_send_and_peak_kv_while_running() -> None:
    r = RequestResult(index=3, request_id="bench-x-3", send_time=1.0, end_time=2.0, first_token_time=1.2)
    r.chunk_times = [1.2, 1.5, 2.0]
    r.chunk_tokens = [1, 1, 1]
    r.output_token_ids = [5, 6, 7]
    r.output_tokens = 3
    r.success = True
    samples = [
        LoadSample(0.5, queued_requests=4, running_requests=1, kv_pressure_pct=10.0),
        LoadSample(0.9, queued_requests=2, running_requests=3, kv_pressure_pct=20.0),
        LoadSample(1.4, queued_requests=0, running_requests=4, kv_pressure_pct=55.5),
        LoadSample(1.8, queued_requests=0, running_requests=4, kv_pressure_pct=40.0),
        LoadSample(2.5, queued_requests=0, running_requests=0, kv_pressure_pct=99.0),
    ]
    obs = observation(
        r, samples, backend="cuda", accelerator="H100", model_version="m", route="127.0.0.1:1", replica="w0"
    )
    assert obs["request_id"] == "req-3"
    assert obs["queue_depth"] == 2  # the last sample before it was sent
    assert obs["kv_pressure_pct"] == 55.5  # the peak while it ran, not after
    assert obs["ttft_ms"] == pytest.approx(200.0) and obs["latency_ms"] == pytest.approx(1000.0)
    assert obs["decode_gaps_ms"] == pytest.approx([300.0, 500.0])
    parsed = build_from_json(Fields({"build": "b", "observations": [obs]}, "side")).observations[0]
    assert parsed.output_fingerprint == token_fingerprint([5, 6, 7])


def test_two_real_runs_of_one_build_are_promoted(tmp_path: Path) -> None:
    """bench/serve.py --observations twice against `ominix-runtime launch` (tiny model, CPU), then the gate."""
    pytest.importorskip("torch")
    from bench.common import launch_service
    from bench.serve import main as serve_main
    from ominix_worker.testing import write_tiny_hf_model

    model_dir = write_tiny_hf_model(tmp_path / "tiny-llama", vocab_size=320)
    launch_args = ["--model", str(model_dir), "--devices", "cpu", "--kv-cache-memory", "16MiB"]
    bench_args = ["--num-requests", "6", "--input-len", "24", "--output-len", "6", "--no-progress"]
    sides = []
    with launch_service(launch_args, ready_timeout_s=120.0, show_progress=False) as service:
        for build in ("base", "cand"):
            path = tmp_path / f"{build}.json"
            argv = ["--address", service.address, *bench_args, "--observations", str(path), "--build", build]
            assert serve_main(argv) == 0
            sides.append(path)
    side = json.loads(sides[0].read_text())
    assert side["build"] == "base" and len(side["observations"]) == 6
    first = side["observations"][0]
    assert first["backend"] == "cpu" and first["accelerator"] == "cpu" and first["route"] == service.address
    assert len(first["output_token_ids"]) == 6 and first["queue_depth"] is not None
    # CPU timings on a shared box say nothing about a regression: this gate judges outputs and evidence.
    policy = tmp_path / "policy.json"
    policy.write_text(
        json.dumps(
            {
                "min_matched_requests": 6,
                "max_latency_p95_regression_pct": 1e6,
                "max_ttft_p95_regression_pct": 1e6,
                "max_decode_p95_regression_pct": 1e6,
                "max_kv_pressure_p95_increase_pct": 100,
            }
        )
    )
    out = tmp_path / "decision.json"
    args = [
        "--baseline",
        str(sides[0]),
        "--candidate",
        str(sides[1]),
        "--policy",
        str(policy),
        "--output",
        str(out),
    ]
    assert release_main("gate", args) == 0
    decision = json.loads(out.read_text())
    assert decision["decision"] == "promote", decision["reasons"]
    assert decision["summary"]["outputs"]["exact_matches"] == 6  # greedy: the same tokens both times
    assert decision["summary"]["evidence"] == {
        "route": 1.0,
        "scheduler": 1.0,
        "streaming": 1.0,
        "outputs": 1.0,
    }
