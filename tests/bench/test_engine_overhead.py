"""bench/engine_overhead.py end to end on a small batch: three real processes over loopback gRPC.

What is checked is that the bench measures what it says: every client stream ends with one Done and exactly
the asked tokens, the steady steps are found and split into phases, and the stand-in device's view is
computed. Performance is never asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("step_ms", [0.0, 5.0])
def test_engine_overhead_bench_reports_every_phase(tmp_path: Path, step_ms: float) -> None:
    out = tmp_path / "overhead.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "engine_overhead.py"), "--concurrency", "8", "--prompt-len", "8",
         "--output-len", "24", "--step-ms", str(step_ms), "--work-dir", str(tmp_path), "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    clients, engine = result["clients"], result["engine"]
    assert clients["requests"] == 8 and clients["all_done_once"] and clients["tokens_per_request"] == [24]
    assert result["max_inflight_steps"] == 3
    assert engine["steady_steps"] >= 10  # 24 tokens a request, all 8 decoding together after their prefill
    for phase in ("schedule", "to_pb", "send", "from_pb", "update", "deliver", "turnaround"):
        assert engine[f"{phase}_p50_ms"] >= 0.0, phase
    assert engine["cpu_per_step_ms"] > 0.0 and engine["wall_per_step_ms"] > 0.0
    assert "steady decode steps at batch 8" in done.stdout
    if step_ms:
        worker = result["worker"]
        assert worker["steps"] >= 5 and 0.0 < worker["busy_share"] <= 1.0 + 1e-9
        assert "next_ready p50" in done.stdout
