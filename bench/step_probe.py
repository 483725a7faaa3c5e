"""Worker entry point with a step probe: where a worker's step time goes, and how busy the GPU is.

Starts ``ominix_worker.server`` with the same flags, after wrapping ``ModelRunner.execute_step`` (and its phases)
with host timers. Every step is logged (enter/exit time, batch, tokens, phase times, the run label below, and with
``OMINIX_PROFILE_ALLOCATOR=1`` on CUDA the allocators' running call counts: a cudaMalloc, a pinned host
allocation or an allocation retried after freeing the cache can hold the device thread).

GPU busy, the definition (bench/RESULTS.md repeats it): for each batch size in ``OMINIX_PROFILE_BATCHES``
(e.g. ``256,1``), once ``_SKIP_WARM`` pure-decode steps of that size have run, ``torch.profiler`` (device
activity only: host tracing would slow the host work being measured) runs a schedule of
``OMINIX_PROFILE_WARMUP`` (4) warm-up steps, traced and discarded so that starting the profiler stays out
of the window, then ``OMINIX_PROFILE_STEPS`` (32) recorded steps. The window runs from the first device
activity recorded to the last; GPU busy = the union of every kernel, memcpy and memset interval in it
divided by its length; idle per step = (window − busy) / recorded steps. A step of another shape inside the
window ends it early (reported as ``complete: false``).

Runs: with ``OMINIX_PROFILE_GATE`` set, windows open only while that file exists (opening and closing the
profiler stalls the worker for a moment, which must stay out of timed runs); its content is a run label, and
each new label arms one window per batch size again, so one service measures several runs back to back
(``STAGES=overhead bash bench/gpu_service.sh``: three). Windows are keyed ``LABEL/decode_batch_N``.
``OMINIX_PROFILE_OUT`` names the JSON written (rewritten every ``OMINIX_PROFILE_WRITE_EVERY`` steps outside a
window, 64 unless set, 0 never; after each window and at exit).

The probe's own garbage stays out of the windows. ``torch.profiler`` keeps itself and every event it read alive
in reference cycles after a window; a later full collection freed them in the middle of the next window (95 –
100 ms pauses with the GIL held, a GPU-busy reading of 93.5% on an H200). So closing a window collects at once,
in the run that the window belongs to, and no JSON is written while a window is open. Every collector pause
of at least 1 ms is logged (``gc_pauses``: generation, start, ms) and each window lists those that began while
its steps ran (``gc_pauses_ms``), so a stall in a window can be told apart from the engine's or the device's.

Prefill: with ``OMINIX_PROFILE_PREFILL_TOKENS=N`` a step that is not pure decode and schedules at least N tokens
(prompt chunks, decode rows riding along: ``is_prefill``) is of the shape ``prefill_N+``; one window per run records
``OMINIX_PROFILE_PREFILL_STEPS`` (4) such steps after one traced warm-up step, keyed ``LABEL/prefill_N+``: where a
cold run's prefill time goes. The run needs prompts the prefix cache does not hold.

    OMINIX_PROFILE_BATCHES=256,1 OMINIX_PROFILE_OUT=probe.json python3 bench/step_probe.py --device cuda:0 ...

Nothing here changes what a step computes.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

_SKIP_WARM = 4  # pure-decode steps of a size seen (in the current run) before its profile window opens
_PREFILL_WARMUP = 1  # traced, discarded prefill steps before a prefill window records
_GC_PAUSE_LOGGED_S = 0.001  # collector pauses at least this long are logged


def is_prefill(decode: bool, tokens: int, min_tokens: int) -> bool:
    """A step counted as prefill: not pure decode, at least ``min_tokens`` tokens (0: none is)."""
    return min_tokens > 0 and not decode and tokens >= min_tokens


class StepProbe:
    def __init__(
        self,
        out: str,
        batches: list[int],
        num_steps: int,
        warmup: int = 4,
        prefill_tokens: int = 0,
        prefill_steps: int = 4,
        write_every: int = 64,
    ) -> None:
        self.out = out
        self.steps: list[dict[str, Any]] = []
        self.num_steps = num_steps
        self.warmup = warmup
        self.prefill_tokens = prefill_tokens
        self.prefill_steps = prefill_steps
        # The shapes profiled: ``decode_batch_N`` per batch size, and ``prefill_N+`` when asked.
        self.shapes = [f"decode_batch_{b}" for b in batches]
        if prefill_tokens > 0:
            self.shapes.append(self._prefill_shape())
        self.pending = dict.fromkeys(self.shapes, 1)  # windows still to open per shape, this run
        self.seen: dict[str, int] = {}
        self.windows: dict[str, Any] = {}
        # The open window: its shape, profiler, steps taken since it opened, key, warm-up and recorded steps.
        self.active: tuple[str, Any, list[int], str, int, int] | None = None
        self.phase: dict[str, float] = {}
        self.marks: list[tuple[str, int, float, float]] = []
        # Profile only once this file exists (the timed runs stay free of profiler stalls); None: always.
        self.gate = os.environ.get("OMINIX_PROFILE_GATE") or None
        # The allocators' counts cost a dict of ~150 entries per step on the device thread: off unless asked.
        self.log_allocators = os.environ.get("OMINIX_PROFILE_ALLOCATOR", "0") == "1"
        self.label = ""  # the gate file's content: the run being measured
        self._gate_stamp: float | None = None
        self.gc_pauses: list[tuple[int, float, float]] = []  # (generation, start, ms) of each long collection
        self._gc_started = 0.0
        # perf_counter bounds of the open window's steps: when it opened, when its latest step left
        self._window_span = (0.0, 0.0)
        # The JSON is rewritten every this many steps outside a window (0: only after windows and at exit). Each
        # write holds the device thread for the whole growing log: tens of ms after 2,000 steps.
        self.write_every = write_every

    def _read_gate(self) -> bool:
        """Whether windows may open; a new label in the gate file re-arms one window per shape."""
        if self.gate is None:
            return True
        try:
            stamp = os.stat(self.gate).st_mtime
        except OSError:
            return False
        if stamp != self._gate_stamp:
            self._gate_stamp = stamp
            try:
                label = Path(self.gate).read_text().strip()
            except OSError:
                label = ""
            if label != self.label:
                self.label = label
                self.pending = dict.fromkeys(self.shapes, 1)
                self.seen = {}
        return True

    # ---- wrapping ----------------------------------------------------------------------------------

    def install(self) -> None:
        from ominix_worker import runner as runner_module

        cls = runner_module.ModelRunner
        for name in ("_prepare_inputs", "_sample", "_update_states"):
            if hasattr(cls, name):
                setattr(cls, name, self._timed(name, getattr(cls, name)))
        if hasattr(cls, "_post_early_if_done"):
            # Early results leave between the layers of an eager launch: their own phase, kept out of
            # ``forward`` (the launch). It holds every layer's poll too, posted or not (one timer per layer).
            cls._post_early_if_done = self._timed("_post_early", cls._post_early_if_done)  # type: ignore[method-assign]  # the probe times it in place
        cls._forward = self._timed("_forward", cls._forward, exclude="_post_early")  # type: ignore[method-assign]  # the probe times it in place
        try:
            from ominix_worker import cuda_graph

            cuda_graph.DecodeGraphs.run = self._timed("graph_run", cuda_graph.DecodeGraphs.run)  # type: ignore[method-assign]  # the probe times it in place
        except ImportError:
            pass
        gc.callbacks.append(self._on_gc)
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

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._gc_started = now
        elif now - self._gc_started >= _GC_PAUSE_LOGGED_S:
            self.gc_pauses.append((info["generation"], self._gc_started, (now - self._gc_started) * 1000))

    def _timed(self, name: str, fn: Any, exclude: str | None = None) -> Any:
        """``fn`` timed into the step's phase ``name``, less the time the phase ``exclude`` took inside it."""
        probe = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            inner = probe.phase.get(exclude, 0.0) if exclude else 0.0
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - started
                if exclude:
                    took -= probe.phase.get(exclude, 0.0) - inner
                probe.phase[name] = probe.phase.get(name, 0.0) + took

        return wrapper

    def _prefill_shape(self) -> str:
        return f"prefill_{self.prefill_tokens}+"

    def shape_of(self, batch: int, tokens: int, decode: bool) -> str | None:
        """The profiled shape a step belongs to, or None."""
        if decode:
            return f"decode_batch_{batch}"
        return self._prefill_shape() if is_prefill(decode, tokens, self.prefill_tokens) else None

    def run_step(self, runner: Any, step: Any, execute: Any) -> Any:
        batch = len(step.new_requests) + len(step.running_requests)
        tokens = step.num_scheduled_tokens
        decode = batch > 0 and tokens == batch and not step.new_requests
        shape = self.shape_of(batch, tokens, decode)
        gate = self._read_gate()
        if shape is not None:
            self.seen[shape] = self.seen.get(shape, 0) + 1
        if self.active is not None and shape != self.active[0]:
            self._close()  # another shape: the window ends early
        skip = _SKIP_WARM if decode else 0
        if (
            gate
            and self.active is None
            and shape is not None
            and self.pending.get(shape, 0) > 0
            and self.seen[shape] > skip
        ):
            key = f"{self.label}/{shape}" if self.label else shape
            windows = (self.warmup, self.num_steps) if decode else (_PREFILL_WARMUP, self.prefill_steps)
            try:
                self._open(shape, key, *windows)
            except Exception as exc:  # noqa: BLE001 - a probe failure must not stop the worker
                self.pending[shape] = 0
                self.windows[key] = {"error": repr(exc)}
        self.phase = {}
        entered = time.perf_counter()
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
                "run": self.label,
                "profiled": self.active is not None,
            }
            | (_allocator_counts() if self.log_allocators else {})
            | {k.strip("_"): v for k, v in self.phase.items()}
        )
        if self.active is not None:
            self._window_span = (self._window_span[0], left)  # before prof.step(), which may summarize
            taken, warmup, recorded = self.active[2], self.active[4], self.active[5]
            taken[0] += 1
            self.active[1].step()  # no local name for the profiler: closing frees it
            if taken[0] >= warmup + recorded:
                self._close()
        if self.write_every and len(self.steps) % self.write_every == 0 and self.active is None:
            self.write()
        return result

    # ---- profiler windows --------------------------------------------------------------------------

    def _open(self, shape: str, key: str, warmup: int, num_steps: int) -> None:
        import torch

        # Device activity only on CUDA: host-side tracing would slow the very host work being measured.
        if torch.cuda.is_available():
            activities = [torch.profiler.ProfilerActivity.CUDA]
        else:
            activities = [torch.profiler.ProfilerActivity.CPU]
        taken = [0]

        def ready(prof: Any) -> None:  # noqa: ANN401
            recorded = max(0, taken[0] - warmup)
            try:
                summary = summarize(prof, recorded)
            except Exception as exc:  # noqa: BLE001 - a probe failure must not stop the worker
                summary = {"error": repr(exc)}
            summary["complete"] = recorded >= num_steps
            summary["warmup_steps"] = warmup
            self.windows[key] = summary

        prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=warmup, active=num_steps, repeat=1),
            on_trace_ready=ready,
        )
        prof.__enter__()
        self.active = (shape, prof, taken, key, warmup, num_steps)
        now = time.perf_counter()
        self._window_span = (now, now)

    def _close(self) -> None:
        import torch

        assert self.active is not None
        shape, prof, taken, key, warmup, _ = self.active
        self.active = None
        self.pending[shape] = 0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        try:
            prof.__exit__(None, None, None)  # a window cut short is summarized here
        except Exception as exc:  # noqa: BLE001 - a probe failure must not stop the worker
            self.windows[key] = {"error": repr(exc)}
        if key not in self.windows:
            self.windows[key] = {"error": f"no recorded step ({taken[0]} steps, {warmup} warm-up)"}
        # Pauses while the window's steps ran; those of the summary itself come after its last step.
        opened, last_exit = self._window_span
        self.windows[key]["gc_pauses_ms"] = [
            round(ms, 2) for _, start, ms in self.gc_pauses if opened <= start <= last_exit
        ]
        del prof
        gc.collect()  # the profiler's cycles and events, now rather than inside a later window
        self.write()

    def write(self) -> None:
        if not self.out:
            return
        payload = {
            "windows": self.windows,
            "steps": self.steps,
            "marks": self.marks,
            "gc_pauses": self.gc_pauses,
            "prefill_tokens": self.prefill_tokens,
        }
        # Whole or not at all: a worker stopped in the middle of a write leaves the last complete log.
        partial = Path(f"{self.out}.partial")
        partial.write_text(json.dumps(payload))
        partial.replace(self.out)


def union_length(intervals: list[tuple[float, float]], low: float, high: float) -> float:
    """The length of the union of ``intervals`` inside [low, high]: overlapping activity counted once."""
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


def _allocator_counts() -> dict[str, int]:
    """Running counts of the CUDA allocators' calls that may hold the host thread: ``alloc_retries``, device
    allocations that failed and succeeded only after the cache was freed (the free waits for the device);
    ``device_allocs`` / ``device_frees``, the caching allocator's own cudaMalloc / cudaFree calls; and
    ``host_allocs``, the pinned host allocator's (where this torch reports them). Empty off CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    stats = torch.cuda.memory_stats()
    counts = {
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "device_allocs": int(stats.get("num_device_alloc", 0)),
        "device_frees": int(stats.get("num_device_free", 0)),
    }
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    if host_stats is not None:
        counts["host_allocs"] = int(host_stats().get("num_host_alloc", 0))
    return counts


def idle_gaps(intervals: list[tuple[float, float, str]], num_steps: int, top: int = 6) -> list[list[Any]]:
    """Where the device idles: each gap in the union of ``intervals`` (start, end, name) is charged to the
    activity that ended last before it and the one that starts it. The ``top`` boundaries by idle time, as
    [before, after, idle per step, gaps per step]."""
    totals: dict[tuple[str, str], list[float]] = {}
    covered_until: float | None = None
    last_name = ""
    for start, end, name in sorted(intervals):
        if covered_until is not None and start > covered_until:
            entry = totals.setdefault((last_name[:60], name[:60]), [0.0, 0.0])
            entry[0] += start - covered_until
            entry[1] += 1
        if covered_until is None or end >= covered_until:
            covered_until, last_name = end, name
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    n = max(num_steps, 1)
    return [[before, after, idle / n, count / n] for (before, after), (idle, count) in ranked]


def summarize(prof: Any, num_steps: int) -> dict[str, Any]:  # noqa: ANN401
    """GPU busy share of the window spanned by the recorded steps' device activity, and the top kernels.

    The window runs from the first device activity (kernel, memcpy, memset) recorded to the last; busy is the
    union of those intervals inside it. On a machine without CUDA there is no device activity: the host
    operators stand in, so the arithmetic can be checked on a CPU.
    """
    device: list[tuple[float, float, str]] = []
    host: list[tuple[float, float, str]] = []
    for event in prof.events():
        interval = (event.time_range.start, event.time_range.end, event.name)
        if event.device_type.name == "CUDA":
            device.append(interval)
        else:
            host.append(interval)
    device = device or host
    if not device or num_steps <= 0:
        return {"error": "no events", "num_steps": num_steps}
    low, high = min(s for s, _, _ in device), max(e for _, e, _ in device)
    n = num_steps
    wall = high - low
    busy = union_length([(s, e) for s, e, _ in device], low, high)
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
        "num_device_events_per_step": len(device) / n,
        "top_kernels_us_per_step": [(name[:90], t / n) for name, t in top],
        "idle_gaps_us_per_step": idle_gaps(device, n),
    }


def main(argv: list[str] | None = None) -> int:
    batches = [int(b) for b in os.environ.get("OMINIX_PROFILE_BATCHES", "").split(",") if b.strip()]
    probe = StepProbe(
        os.environ.get("OMINIX_PROFILE_OUT", ""),
        batches,
        int(os.environ.get("OMINIX_PROFILE_STEPS", "32")),
        int(os.environ.get("OMINIX_PROFILE_WARMUP", "4")),
        prefill_tokens=int(os.environ.get("OMINIX_PROFILE_PREFILL_TOKENS", "0")),
        prefill_steps=int(os.environ.get("OMINIX_PROFILE_PREFILL_STEPS", "4")),
        write_every=int(os.environ.get("OMINIX_PROFILE_WRITE_EVERY", "64")),
    )
    probe.install()
    from ominix_worker.server import main as worker_main

    return int(worker_main(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())
