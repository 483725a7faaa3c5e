"""bench/step_gaps.py on a synthetic step log and client run: each client gap is matched with the step whose
result had just left, results that left close together are flagged, the tail is split by kind, and a run
without per-request lists is refused; and the step probe writes its log only as often as asked (a write holds
the device thread), whole or not at all."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # bench/ as a namespace package: its modules must not shadow installed ones

from bench.step_gaps import client_gaps, load_steps, main, report  # noqa: E402
from bench.step_probe import StepProbe  # noqa: E402

START = 1_000.0  # the client's perf_counter at its start


def synthetic(
    prefill_every: int = 10, steps: int = 40, held: int = 0
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Decode steps of 6 ms; every ``prefill_every``-th step carries a 1,024-token prompt and takes 25 ms.
    One client stream receives every step's token 1 ms after its result left the worker. ``held``: that step's
    result leaves only 1 ms before the next one's (as a result held behind the next step's launch)."""
    probe: dict[str, Any] = {"steps": [], "marks": []}
    t = START
    posts = []
    for i in range(1, steps + 1):
        prefill = i % prefill_every == 0
        tokens, batch = (1032, 9) if prefill else (8, 8)
        probe["marks"].append(("step_from_pb", i, t, t + 0.0002))
        probe["steps"].append(
            {"id": i, "enter": t + 0.0005, "exit": t + (0.015 if prefill else 0.001), "batch": batch,
             "tokens": tokens, "decode": not prefill}
        )  # fmt: skip
        t += 0.025 if prefill else 0.006
        posts.append(t)
    if held:
        posts[held - 1] = posts[held] - 0.001
    probe["marks"] += [("result_to_pb", i, p, p + 0.0001) for i, p in enumerate(posts, start=1)]
    arrivals = [p + 0.001 for p in posts]
    run = {
        "request_rate": 8.0,
        "p99_itl_ms": 25.0,
        "started_perf": START,
        "start_times": [0.0],
        "ttfts": [arrivals[0] - START],
        "itls": [[b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]],
    }
    return probe, run


def test_each_gap_is_matched_with_the_step_whose_result_had_just_left() -> None:
    probe, run = synthetic()
    steps = load_steps(probe)
    gaps = client_gaps(run, steps)
    assert len(gaps) == 39
    long = [g for g in gaps if g.seconds > 0.02]
    assert len(long) == 4 and all(g.step.prefill for g in long)
    assert {g.step.step_id for g in long} == {10, 20, 30, 40}
    assert all(g.previous is not None and g.previous.step_id == g.step.step_id - 1 for g in long)
    assert not any(g.close for g in gaps)  # results 6 ms or more apart
    first = long[0].step
    assert first.exited - first.entered == pytest.approx(0.0145)  # its launch
    assert first.entered - first.arrived == pytest.approx(0.0003)  # queued


def test_results_that_left_close_together_are_flagged() -> None:
    # Step 9's result leaves 1 ms before step 10's: its chunk reaches the client as 10's leaves, so the
    # match cannot tell them apart (both chunks go to step 10), and both gaps are flagged.
    probe, run = synthetic(held=9)
    gaps = client_gaps(run, load_steps(probe))
    assert [g.close for g in gaps].count(True) == 2
    held, prefill = (g for g in gaps if g.close)
    assert held.step.step_id == prefill.step.step_id == 10
    assert held.seconds == pytest.approx(0.030) and prefill.seconds == pytest.approx(0.001)


def test_the_tail_is_split_by_kind() -> None:
    probe, run = synthetic()
    lines = report(client_gaps(run, load_steps(probe)), 95.0)
    assert lines[0].startswith("39 gaps; p50 6.00 ms, p95 25.00 ms; 4 at or above p95 (0 close)")
    assert any(
        line.startswith("  prefill step: 4 gaps, 4 steps; gap 25.00 (25.00–25.00) ms") for line in lines
    )
    assert not any("decode after" in line for line in lines)  # the gaps after a prefill step are short


def test_a_run_without_per_request_lists_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    probe, run = synthetic()
    del run["itls"]
    (tmp_path / "probe.json").write_text(json.dumps(probe))
    (tmp_path / "online.json").write_text(json.dumps([run]))
    assert main([str(tmp_path / "probe.json"), str(tmp_path / "online.json")]) == 2
    assert "lacks itls: run bench/online.py with --save-detailed" in capsys.readouterr().err


@pytest.mark.parametrize(("every", "writes"), [(64, 2), (0, 0)])
def test_the_probe_writes_its_log_only_as_often_as_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, every: int, writes: int
) -> None:
    probe = StepProbe(str(tmp_path / "probe.json"), [], num_steps=1, write_every=every)
    written: list[int] = []
    monkeypatch.setattr(probe, "write", lambda: written.append(len(probe.steps)))
    for i in range(1, 130):
        step = SimpleNamespace(
            step_id=i, new_requests=[], running_requests=[object()], num_scheduled_tokens=1
        )
        probe.run_step(None, step, lambda _runner, s: s.step_id)
    assert len(written) == writes


def test_the_probe_replaces_its_log_whole(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    out.write_text("{}")
    probe = StepProbe(str(out), [], num_steps=1)
    probe.steps.append({"id": 1})
    probe.write()
    assert json.loads(out.read_text())["steps"] == [{"id": 1}]
    assert not (tmp_path / "probe.json.partial").exists()
