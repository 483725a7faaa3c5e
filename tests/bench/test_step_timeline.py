"""bench/step_timeline.py on a synthetic step log: runs are cut at idle stretches, short runs are left out, and
each run's wall time is split into prompt-side, pure-decode and empty steps (pipelined or synchronous), with the
batch's ramp, the median decode step at the largest batch and the time between step calls; a file that is not a
step log is refused with a message."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # bench/ as a namespace package: its modules must not shadow installed ones

from bench.step_timeline import main, run_timeline, split_runs  # noqa: E402


def _run(start: float, batches: list[int], tokens: list[int], every_s: float) -> list[dict[str, Any]]:
    """One step every ``every_s`` seconds, each call returning 1 ms after its entry."""
    return [
        {"id": i, "enter": start + i * every_s, "exit": start + i * every_s + 0.001, "batch": b, "tokens": t,
         "decode": b == t}
        for i, (b, t) in enumerate(zip(batches, tokens, strict=True))
    ]  # fmt: skip


# A burst: two prompt-side steps while the batch fills (64 then 256 requests), then 10 decode steps at 256.
BURST = _run(10.0, [64, 256] + [256] * 10, [4096, 3000] + [256] * 10, 0.010)
WARM_UP = _run(1.0, [1, 1], [5, 1], 0.010)  # a short run: left out by --min-steps
# The step after the last decode: it only finishes the requests (no request in it).
FINISH = [{"id": 12, "enter": 10.12, "exit": 10.121, "batch": 0, "tokens": 0, "decode": False}]


def test_runs_are_cut_at_idle_stretches() -> None:
    runs = split_runs(WARM_UP + BURST[::-1], gap_s=0.5)  # any order in the log
    assert [len(r) for r in runs] == [2, 12]
    assert [s["id"] for s in runs[1]] == list(range(12))


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "synchronous"])
def test_a_runs_wall_time_by_step_kind(pipelined: bool) -> None:
    """Pipelined, step k ran from call k's exit to call k+1's (the first also gets its own call); synchronous,
    from its entry to the next entry. Either way the steps' times add up to the wall time."""
    t = run_timeline(BURST + FINISH, pipelined)
    assert t.steps == 13
    assert t.wall_ms == pytest.approx(121.0)  # 12 intervals of 10 ms, then the last call's 1 ms
    assert (t.prompt_steps, t.prompt_tokens) == (2, [4096, 3000])
    assert (t.empty_steps, t.decode_steps) == (1, 10)
    assert t.prompt_ms + t.decode_ms + t.empty_ms == pytest.approx(t.wall_ms)
    if pipelined:  # 11 + 10 ms; the ten decode steps 10 ms each; the empty step's call ends the run
        assert (t.prompt_ms, t.decode_ms, t.empty_ms) == pytest.approx((21.0, 100.0, 0.0))
    else:  # 10 + 10 ms; 10 ms each; the empty step's 1 ms call
        assert (t.prompt_ms, t.decode_ms, t.empty_ms) == pytest.approx((20.0, 100.0, 1.0))
    assert t.max_batch == 256 and t.decode_median_ms_at_max_batch == pytest.approx(10.0)
    assert t.ramp_steps == 1 and t.ramp_ms == pytest.approx(11.0 if pipelined else 10.0)
    assert t.between_calls_ms == pytest.approx(12 * 9.0)


def test_main_reports_the_long_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"steps": WARM_UP + BURST + FINISH}))
    out = tmp_path / "timeline.json"
    assert main([str(probe), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (
        printed.startswith("run 0: 13 steps in 121.0 ms")
        and "batch 256 first in the step after 1 steps" in printed
    )
    assert [r["steps"] for r in json.loads(out.read_text())] == [13]


def test_a_file_that_is_not_a_step_log_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "offline.json"
    bad.write_text(json.dumps({"results": []}))
    assert main([str(bad)]) == 1
    assert "not a step probe's log" in capsys.readouterr().err
