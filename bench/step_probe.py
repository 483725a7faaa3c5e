"""Worker entry point with a step probe: where a worker's step time goes, and how busy the GPU is.

Starts ``ominix_worker.server`` with the same flags, after wrapping ``ModelRunner.execute_step`` (and its phases)
with host timers. Every step is logged (enter/exit time, batch, tokens, phase times); for each batch size in
``OMINIX_PROFILE_BATCHES`` (e.g. ``256,1``) the first ``OMINIX_PROFILE_STEPS`` pure-decode steps of that size
after a few warm ones run under ``torch.profiler``: GPU busy = union of kernel and copy intervals over the
window of those steps as the host saw them, the gap between steps, and the top kernels.
``OMINIX_PROFILE_OUT`` names the JSON written (rewritten every 64 steps and at exit); with
``OMINIX_PROFILE_GATE`` set, windows open only once that file exists (opening and closing the profiler stalls
the worker for seconds, which must stay out of timed runs).

    OMINIX_PROFILE_BATCHES=256,1 OMINIX_PROFILE_OUT=probe.json python3 bench/step_probe.py --device cuda:0 ...

Nothing here changes what a step computes.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

_SKIP_WARM = 4  # pure-decode steps of a size seen before its profile window opens


class StepProbe:
    def __init__(self, out: str, batches: list[int], num_steps: int) -> None:
        self.out = out
        self.steps: list[dict[str, Any]] = []
        self.pending = {b: num_steps for b in batches}
        self.seen: dict[int, int] = {}
        self.windows: dict[str, Any] = {}
        self.active: tuple[int, Any, list[tuple[float, float]]] | None = None
        self.phase: dict[str, float] = {}
        self.marks: list[tuple[str, int, float, float]] = []
        # Profile only once this file exists (the timed runs stay free of profiler stalls); None: always.
        self.gate = os.environ.get("OMINIX_PROFILE_GATE") or None

    # ---- wrapping ----------------------------------------------------------------------------------

    def install(self) -> None:
        from ominix_worker import runner as runner_module

        cls = runner_module.ModelRunner
        for name in ("_prepare_inputs", "_forward", "_sample", "_update_states"):
            if hasattr(cls, name):
                setattr(cls, name, self._timed(name, getattr(cls, name)))
        try:
            from ominix_worker import cuda_graph

            cuda_graph.DecodeGraphs.run = self._timed("graph_run", cuda_graph.DecodeGraphs.run)  # type: ignore[method-assign]  # the probe times it in place
        except ImportError:
            pass
        if hasattr(cls, "_sample_logits"):
            cls._sample_logits = self._timed("sample_logits", cls._sample_logits)  # type: ignore[method-assign]  # the probe times it in place
        self._wrap_wire()
        execute = cls.execute_step
        probe = self

        def execute_step(runner: Any, step: Any) -> Any:
            return probe.run_step(runner, step, execute)

        cls.execute_step = execute_step  # type: ignore[method-assign]  # the probe times it in place
        atexit.register(self.write)

    def _wrap_wire(self) -> None:
        """Timestamps of the worker's protobuf conversions: when a step's message was taken up and when a
        result left, which splits the gap between two steps into its parts."""
        from ominix_runtime import wire

        probe = self
        step_from_pb = wire.step_from_pb
        result_to_pb = wire.step_result_to_pb

        def timed_step_from_pb(message: Any) -> Any:
            started = time.perf_counter()
            out = step_from_pb(message)
            probe.marks.append(("step_from_pb", message.step_id, started, time.perf_counter()))
            return out

        def timed_result_to_pb(result: Any) -> Any:
            started = time.perf_counter()
            out = result_to_pb(result)
            probe.marks.append(("result_to_pb", result.step_id, started, time.perf_counter()))
            return out

        wire.step_from_pb = timed_step_from_pb  # type: ignore[assignment]  # the probe times it in place
        wire.step_result_to_pb = timed_result_to_pb  # type: ignore[assignment]  # the probe times it in place

    def _timed(self, name: str, fn: Any) -> Any:
        probe = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                probe.phase[name] = probe.phase.get(name, 0.0) + time.perf_counter() - started

        return wrapper

    def run_step(self, runner: Any, step: Any, execute: Any) -> Any:
        batch = len(step.new_requests) + len(step.running_requests)
        tokens = step.num_scheduled_tokens
        decode = batch > 0 and tokens == batch and not step.new_requests
        if decode:
            self.seen[batch] = self.seen.get(batch, 0) + 1
        gate = self.gate is None or os.path.exists(self.gate)
        if (
            gate
            and self.active is None
            and decode
            and self.pending.get(batch, 0) > 0
            and self.seen[batch] > _SKIP_WARM
        ):
            try:
                self._open(batch)
            except Exception as exc:  # noqa: BLE001 - a probe failure must not stop the worker
                self.pending[batch] = 0
                self.windows[f"decode_batch_{batch}"] = {"error": repr(exc)}
        self.phase = {}
        entered = time.perf_counter()
        if self.active is not None:
            import torch

            with torch.profiler.record_function("ominix_step"):
                result = execute(runner, step)
        else:
            result = execute(runner, step)
        left = time.perf_counter()
        self.steps.append(
            {
                "id": step.step_id,
                "enter": entered,
                "exit": left,
                "batch": batch,
                "tokens": tokens,
                "decode": decode,
            }
            | {k.strip("_"): v for k, v in self.phase.items()}
        )
        if self.active is not None:
            size = self.active[0]
            self.pending[size] -= 1
            if self.pending[size] <= 0 or not (decode and batch == size):
                self._close()
        if len(self.steps) % 64 == 0:
            self.write()
        return result

    # ---- profiler windows --------------------------------------------------------------------------

    def _open(self, batch: int) -> None:
        import torch

        # Device activity only on CUDA: host-side tracing would slow the very host work being measured.
        if torch.cuda.is_available():
            activities = [torch.profiler.ProfilerActivity.CUDA]
        else:
            activities = [torch.profiler.ProfilerActivity.CPU]
        prof = torch.profiler.profile(activities=activities)
        prof.__enter__()
        self.active = (batch, prof, [])

    def _close(self) -> None:
        import torch

        assert self.active is not None
        batch, prof, _ = self.active
        self.active = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        self.pending[batch] = 0
        try:
            self.windows[f"decode_batch_{batch}"] = summarize(prof)
        except Exception as exc:  # noqa: BLE001 - a probe failure must not stop the worker
            self.windows[f"decode_batch_{batch}"] = {"error": repr(exc)}
        self.write()

    def write(self) -> None:
        if not self.out:
            return
        payload = {"windows": self.windows, "steps": self.steps, "marks": self.marks}
        Path(self.out).write_text(json.dumps(payload))


def _union(intervals: list[tuple[float, float]], low: float, high: float) -> float:
    total = 0.0
    cur_start = cur_end = None
    for start, end in sorted(intervals):
        start, end = max(start, low), min(end, high)
        if end <= start:
            continue
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total


def summarize(prof: Any) -> dict[str, Any]:
    """GPU busy share of the window spanned by the profiled steps, gaps between them, top kernels."""
    steps: list[tuple[float, float]] = []
    device: list[tuple[float, float, str]] = []
    for event in prof.events():
        start = event.time_range.start
        end = event.time_range.end
        if event.name == "ominix_step" and event.device_type.name == "CPU":
            steps.append((start, end))
        elif event.device_type.name == "CUDA":
            device.append((start, end, event.name))
    steps.sort()
    if steps:
        low, high = steps[0][0], steps[-1][1]
        n = len(steps)
        gaps = [steps[i + 1][0] - steps[i][1] for i in range(len(steps) - 1)]
    elif device:
        # Device-only trace: the window runs from the first kernel of the profiled steps to the last.
        low, high = min(s for s, _, _ in device), max(e for _, e, _ in device)
        n = int(os.environ.get("OMINIX_PROFILE_STEPS", "8"))
        steps = [(low, high)]
        gaps = []
    else:
        return {"error": "no events"}
    wall = high - low
    busy = _union([(s, e) for s, e, _ in device], low, high)
    totals: dict[str, float] = {}
    for s, e, name in device:
        totals[name] = totals.get(name, 0.0) + (e - s)
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:15]
    return {
        "num_steps": n,
        "window_us": wall,
        "gpu_busy_us": busy,
        "gpu_busy_share": busy / wall if wall > 0 else None,
        "step_us_mean": wall / n,
        "idle_us_per_step": (wall - busy) / n,
        "gap_between_steps_us_mean": sum(gaps) / len(gaps) if gaps else None,
        "num_device_events_per_step": len(device) / n,
        "top_kernels_us_per_step": [(name[:90], t / n) for name, t in top],
    }


def main(argv: list[str] | None = None) -> int:
    batches = [int(b) for b in os.environ.get("OMINIX_PROFILE_BATCHES", "").split(",") if b.strip()]
    probe = StepProbe(
        os.environ.get("OMINIX_PROFILE_OUT", ""), batches, int(os.environ.get("OMINIX_PROFILE_STEPS", "8"))
    )
    probe.install()
    from ominix_worker.server import main as worker_main

    return int(worker_main(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())
