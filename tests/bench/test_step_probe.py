"""bench/step_probe.py's profiler windows on a CPU: which steps open a window of which shape, how many are
recorded, and that a step of another shape cuts the open window short (host operators stand in for kernels);
and bench/service_summary.py's prefill rate over a step log."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # bench/ as a namespace package: its modules must not shadow installed ones

from bench.step_probe import _PREFILL_WARMUP, _SKIP_WARM, StepProbe  # noqa: E402


def step(step_id: int, new: int, running: int, tokens: int) -> SimpleNamespace:
    return SimpleNamespace(
        step_id=step_id, new_requests=[object()] * new, running_requests=[object()] * running,
        num_scheduled_tokens=tokens,
    )  # fmt: skip


def work(_runner: Any, s: SimpleNamespace) -> int:
    torch.ones(s.num_scheduled_tokens, 8).sum()  # a host operator for the window to record
    return int(s.step_id)


def run(probe: StepProbe, steps: list[SimpleNamespace]) -> list[int]:
    return [probe.run_step(None, s, work) for s in steps]


def test_prefill_and_decode_windows(tmp_path: Path) -> None:
    probe = StepProbe(
        str(tmp_path / "probe.json"), [4], num_steps=3, warmup=1, prefill_tokens=64, prefill_steps=2
    )
    prefill = [step(i, 2, 1, 100) for i in range(_PREFILL_WARMUP + 2)]  # not pure decode, >= 64 tokens
    small = [step(10, 1, 0, 10)]  # a prompt below the threshold: no shape
    decode = [step(20 + i, 0, 4, 4) for i in range(_SKIP_WARM + 1 + 3)]
    assert run(probe, prefill + small + decode) == [s.step_id for s in prefill + small + decode]
    windows = probe.windows
    assert set(windows) == {"prefill_64+", "decode_batch_4"}
    assert windows["prefill_64+"]["num_steps"] == 2 and windows["prefill_64+"]["complete"]
    assert windows["prefill_64+"]["warmup_steps"] == _PREFILL_WARMUP
    assert windows["decode_batch_4"]["num_steps"] == 3 and windows["decode_batch_4"]["complete"]
    assert windows["decode_batch_4"]["top_kernels_us_per_step"]
    assert "idle_gaps_us_per_step" in windows["decode_batch_4"]
    # One window per shape per run: more prefill steps open nothing new.
    run(probe, [step(40 + i, 2, 0, 100) for i in range(4)])
    assert set(windows) == {"prefill_64+", "decode_batch_4"}
    probe.write()
    assert json.loads((tmp_path / "probe.json").read_text())["prefill_tokens"] == 64  # for service_summary
    logged = probe.steps
    assert sum(s["profiled"] for s in logged) == (_PREFILL_WARMUP + 2) + (1 + 3)


def test_idle_gaps_are_charged_to_the_activity_on_either_side() -> None:
    from bench.step_probe import idle_gaps

    # b runs inside a (no idle); then a -> c idles 10 us, c -> a 30 us, a -> c 30 us, over two steps.
    intervals = [
        (0.0, 10.0, "a"), (2.0, 5.0, "b"), (20.0, 25.0, "c"),
        (55.0, 65.0, "a"), (95.0, 100.0, "c"),
    ]  # fmt: skip
    gaps = idle_gaps(intervals, num_steps=2)
    assert gaps[0] == ["a", "c", (10.0 + 30.0) / 2, 1.0]
    assert gaps[1] == ["c", "a", 30.0 / 2, 0.5]
    assert len(gaps) == 2  # the overlap of a and b is not idle
    assert idle_gaps(intervals, num_steps=2, top=1) == gaps[:1]
    assert idle_gaps([], num_steps=3) == []


def test_another_shape_cuts_a_window_short(tmp_path: Path) -> None:
    probe = StepProbe(
        str(tmp_path / "probe.json"), [], num_steps=3, warmup=1, prefill_tokens=64, prefill_steps=4
    )
    run(probe, [step(i, 2, 0, 100) for i in range(_PREFILL_WARMUP + 2)] + [step(9, 0, 2, 2)])
    window = probe.windows["prefill_64+"]
    assert window["complete"] is False and window["num_steps"] == 2


def test_no_prefill_shape_unless_asked(tmp_path: Path) -> None:
    probe = StepProbe(str(tmp_path / "probe.json"), [2], num_steps=2, warmup=1)
    assert probe.shape_of(batch=3, tokens=5000, decode=False) is None
    assert probe.shape_of(batch=2, tokens=2, decode=True) == "decode_batch_2"
    run(probe, [step(i, 2, 0, 5000) for i in range(4)])
    assert probe.windows == {}


def test_early_results_posted_inside_a_launch_are_kept_out_of_its_forward_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bench.step_probe as step_probe

    now = [0.0]
    monkeypatch.setattr(step_probe, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    probe = StepProbe(str(tmp_path / "probe.json"), [], num_steps=1)

    class Runner:
        def _post_early_if_done(self) -> None:
            now[0] += 0.004  # finishing and posting the step before

        def _forward(self) -> None:
            for _ in range(3):  # three layers, an early-posting check after each
                now[0] += 0.010
                self._post_early_if_done()

    Runner._post_early_if_done = probe._timed("_post_early", Runner._post_early_if_done)  # type: ignore[method-assign]
    Runner._forward = probe._timed("_forward", Runner._forward, exclude="_post_early")  # type: ignore[method-assign]
    probe.phase = {}
    Runner()._forward()
    assert probe.phase["_post_early"] == pytest.approx(0.012)
    assert probe.phase["_forward"] == pytest.approx(0.030)


def test_prefill_rate_of_a_step_log() -> None:
    from bench.service_summary import prefill_rate

    def logged(enter: float, seconds: float, tokens: int, decode: bool) -> dict[str, Any]:
        return {"enter": enter, "exit": enter + seconds, "tokens": tokens, "decode": decode, "batch": 4}

    steps = [
        logged(0.0, 0.2, 8192, False),
        logged(0.3, 0.3, 8192, False),
        logged(0.7, 0.1, 1000, False),  # below the threshold
        logged(0.9, 0.01, 4, True),  # decode
    ]
    rate = prefill_rate(steps, 4096)
    assert rate is not None
    assert rate["steps"] == 2
    assert abs(rate["median_ms"] - 250.0) < 1e-6
    assert abs(rate["tokens_per_s"] - 16384 / 0.5) < 1e-6
    assert prefill_rate(steps[2:], 4096) is None
    assert prefill_rate(steps, 0) is None  # no threshold: the probe had no prefill window


def test_closing_a_window_frees_the_profiler_and_reports_gc_pauses(tmp_path: Path) -> None:
    """The profiler of a closed window is gone before the next step (it lives in reference cycles, which a
    full collection inside a later window would free), and each window lists the collector pauses in it."""
    import gc
    import weakref

    from bench.service_summary import gc_text

    probe = StepProbe(str(tmp_path / "probe.json"), [2], num_steps=2, warmup=1)
    callbacks = list(gc.callbacks)
    try:
        gc.callbacks.append(probe._on_gc)
        decode = [step(i, 0, 2, 2) for i in range(_SKIP_WARM + 1)]
        run(probe, decode)
        assert probe.active is not None
        profiler = weakref.ref(probe.active[1])
        gc.collect()  # a pause inside the open window; gen 2, so it is logged when it reaches 1 ms
        run(probe, [step(10 + i, 0, 2, 2) for i in range(2)])
        assert probe.active is None
        assert profiler() is None
    finally:
        gc.callbacks[:] = callbacks
    window = probe.windows["decode_batch_2"]
    assert window["complete"]
    pauses = window["gc_pauses_ms"]
    assert all(ms >= 1.0 for ms in pauses)
    logged_inside = [ms for _, start, ms in probe.gc_pauses if start >= probe.steps[_SKIP_WARM]["enter"]]
    assert len(pauses) <= len(logged_inside)
    assert gc_text({"gc_pauses_ms": []}) == ", no GC pause >= 1 ms"
    assert gc_text({"gc_pauses_ms": [2.0, 5.5]}) == ", GC pauses 2 (7.5 ms, largest 5.5)"
    assert gc_text({}) == ""
    assert json.loads((tmp_path / "probe.json").read_text())["gc_pauses"] == [
        list(p) for p in probe.gc_pauses
    ]


def test_prefix_hops_split_a_warm_ttft_by_the_worker_log() -> None:
    """Each warm request's TTFT is cut at its step's protobuf marks and the step's enter / exit; a request
    whose window holds no single-request prefill step (or two) is left out."""
    from bench.service_summary import prefix_hops

    def logged(
        step_id: int, enter: float, exit_: float, batch: int = 1, decode: bool = False
    ) -> dict[str, Any]:
        return {"id": step_id, "enter": enter, "exit": exit_, "batch": batch, "tokens": 64, "decode": decode}

    probe = {
        "steps": [
            logged(1, 10.003, 10.009),  # request 1's suffix step
            logged(2, 10.0095, 10.013, decode=True),  # its next token: not counted
            logged(3, 20.002, 20.008),  # request 2's
            logged(4, 30.002, 30.004),  # request 3: two prefill steps in its window
            logged(5, 30.005, 30.007),
        ],
        "marks": [
            ["step_from_pb", 1, 10.0025, 10.0026],
            ["result_to_pb", 1, 10.0092, 10.0093],
            ["step_from_pb", 3, 20.0015, 20.0016],
            ["result_to_pb", 3, 20.0082, 20.0083],
        ],
    }
    offline = {
        "runs": {"shared_prefix": {"warm_timeline_s": [[10.0, 10.010], [20.0, 20.009], [30.0, 30.01]]}}
    }
    hops = prefix_hops(probe, offline)
    assert hops is not None and hops["requests"] == 2
    assert abs(hops["ttft"] - 9.5) < 1e-6  # medians of 10 and 9 ms
    assert abs(hops["to_worker"] - 2.0) < 1e-6  # 2.5 and 1.5
    assert abs(hops["step"] - 6.0) < 1e-6
    assert abs(hops["handed_to_step"] - 0.5) < 1e-6
    parts = sum(hops[k] for k in ("to_worker", "handed_to_step", "step", "handed_back", "back_to_client"))
    assert abs(parts - hops["ttft"]) < 1e-6
    assert prefix_hops(probe, {"runs": {}}) is None


def test_run_timeline_splits_a_run_by_the_worker_log() -> None:
    """A run's wall time: to the first step's protobuf, each step's share from result to result (pure decode
    apart from the rest), after the last result; a step outside the run's span is left out, and the engine's
    lateness sums the next protobuf's conversion past the worker's return."""
    from bench.service_summary import run_timeline

    def logged(step_id: int, enter: float, exit_: float, batch: int, decode: bool) -> dict[str, Any]:
        return {"id": step_id, "enter": enter, "exit": exit_, "batch": batch, "tokens": 4, "decode": decode}

    probe = {
        "steps": [
            logged(9, 4.0, 4.1, 4, True),  # an earlier run's step: outside the span
            logged(1, 10.010, 10.020, 4, False),  # the prompts
            logged(2, 10.031, 10.040, 4, True),
            logged(3, 10.050, 10.060, 4, True),
            logged(4, 10.062, 10.066, 4, True),  # its result left after the run's last token: not the run's
        ],
        "marks": [
            ["step_from_pb", 9, 3.9, 3.95],
            ["result_to_pb", 9, 4.1, 4.11],
            ["step_from_pb", 1, 10.008, 10.009],
            ["result_to_pb", 1, 10.021, 10.022],
            ["step_from_pb", 2, 10.029, 10.030],  # 10 ms after step 1 returned: the engine late
            ["result_to_pb", 2, 10.041, 10.042],
            ["step_from_pb", 3, 10.038, 10.039],  # ready before step 2 returned
            ["result_to_pb", 3, 10.061, 10.062],
            ["step_from_pb", 4, 10.060, 10.061],
            ["result_to_pb", 4, 10.069, 10.071],
        ],
    }
    run = {"clock_s": {"origin": 10.0, "last_send": 10.001, "last_end": 10.070, "end": 10.071}}
    t = run_timeline(probe, run)
    assert t is not None
    assert t["steps"] == 3 and t["decode_steps"] == 2 and t["full_batch"] == 4
    assert abs(t["full_batch_from_ms"] - 8.0) < 1e-6  # the first step already held all four
    assert abs(t["to_first_step_ms"] - 8.0) < 1e-6
    assert abs(t["other_steps_ms"] - 14.0) < 1e-6  # 10.008 → 10.022
    assert abs(t["decode_steps_ms"] - 40.0) < 1e-6  # 10.022 → 10.042 → 10.062
    assert abs(t["full_batch_step_median_ms"] - 20.0) < 1e-6
    assert abs(t["after_last_result_ms"] - 8.0) < 1e-6
    assert abs(t["worker_waited_ms"] - 10.0) < 1e-6  # step 2 only
    parts = t["to_first_step_ms"] + t["decode_steps_ms"] + t["other_steps_ms"] + t["after_last_result_ms"]
    assert abs(parts - t["wall_ms"]) < 1e-6
    assert run_timeline(probe, {"clock_s": {"origin": 10.0}}) is None


def test_slowest_steps_name_the_allocator_calls_each_made() -> None:
    """The longest steps first, each with the cudaMalloc / pinned / retry calls made during it (its running
    counts less the step before's); a log without the counts prints none."""
    from bench.service_summary import slowest_steps

    def logged(step_id: int, took: float, **counts: int) -> dict[str, Any]:
        return {"id": step_id, "enter": 0.0, "exit": took, "batch": 2, "tokens": 8, "decode": False, **counts}

    steps = [
        logged(1, 0.010, device_allocs=3, host_allocs=1, alloc_retries=0),
        logged(2, 0.300, device_allocs=5, host_allocs=1, alloc_retries=0),
        logged(3, 0.020, device_allocs=5, host_allocs=2, alloc_retries=0),
    ]
    assert (
        slowest_steps(steps, 2)
        == "300 ms (8 tokens, batch 2, 2 cudaMalloc); 20 ms (8 tokens, batch 2, 1 pinned)"
    )
    bare = [logged(1, 0.010), logged(2, 0.300)]
    assert slowest_steps(bare, 1) == "300 ms (8 tokens, batch 2)"
