"""The engine's own cost per decode step, on the CPU: real engine, real gRPC, a fake worker that computes nothing.

Three processes on loopback: a fake step-level worker (``--role worker``: answers each DecodeStep at once, or
after ``--step-ms`` as a stand-in for the GPU, keeping every request's length so it samples exactly where a
model would), the engine (this process: ``EngineDaemon`` with the same ``--worker`` setup as ``ominix-runtime
serve``, wrapped with host timers) and a client process (``--role clients``: ``--concurrency`` streaming
Generate calls with token-id prompts, greedy, ``ignore_eos``). Only pure decode steps at half the per-group
concurrency or more count, in the steady window: it opens once every stream's request has started, and a step
that is not one of those ends it.

Per step the engine's driver is timed phase by phase: ``schedule`` (Scheduler.schedule), ``to_pb`` (DecodeStep →
protobuf), ``send`` (the stream write, protobuf → bytes included), ``from_pb`` (the result's protobuf → StepResult),
``update`` (Scheduler.update) and ``deliver`` (events into the 256 request queues); ``turnaround`` is the
critical path, from a result's arrival on the engine to the next step's send; ``cpu`` is the whole engine
process's CPU time per step (every thread), so ``cpu`` − driver phases is what streaming the tokens to the
clients, gRPC and the event loop cost. With ``--step-ms`` the fake worker also reports what the GPU would see:
``next_ready`` (when step N+1 arrived relative to the end of step N; ≤ 0 means it was waiting) and busy share.

With ``--groups N`` there are N fake workers (TP=1 groups, as ``serve --worker A --worker B``), each with
``--concurrency`` streams (the engine's routing may split them unevenly), and the steady window is while every
group decodes its streams. The clients are
bench/offline.py's W1 client by default (``--client w1``: bench/serve.py's run_benchmark, plain asyncio, four
channels) in ``--client-procs`` processes. Besides the per-step phases it reports, between 10% and 90% of all
tokens received: the tokens/s the clients saw and each process's CPU per token (engine, clients, workers,
from /proc), which tells an engine-bound run from a client-bound one.

    python bench/engine_overhead.py                          # 256 streams, instant worker
    python bench/engine_overhead.py --groups 2               # two groups of 256 streams: engine or client?
    python bench/engine_overhead.py --groups 2 --client-procs 2
    python bench/engine_overhead.py --step-ms 14             # a 14 ms "GPU" step: next_ready, busy
    python bench/engine_overhead.py --profile engine.prof    # cProfile of the engine process (steady window)
    python bench/engine_overhead.py --client w1 --batch-submit --again --prompt-len 512 --output-len 256 \
        --step-ms 13 --profile-intake intake.prof            # ... of a cached burst's intake, to its last step

Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import math
import os
import pstats
import statistics
import subprocess
import sys
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import grpc
import grpc.aio

from bench.common import free_ports, percentile
from ominix_runtime import wire
from ominix_runtime.contract.events import is_terminal
from ominix_runtime.engine.config import LIGHT_LOAD_INFLIGHT_STEPS
from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc, worker_pb2, worker_pb2_grpc

MODEL = "dummy:bench/configs/llama8b-config.json"
VOCAB = 128256
EOS = 128001
HOLD_S = 1.5
CPU_SAMPLE_S = 0.02
WINDOW = (0.1, 0.9)  # tokens/s and CPU per token between these shares of all tokens received


# ---------------------------------------------------------------- the fake worker


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """Answers steps from their protobuf alone: a row samples once it has computed every token it knows."""

    def __init__(
        self,
        model_name: str,
        step_s: float,
        batch: int,
        stats_path: str,
        worker_id: str,
        hold_s: float = HOLD_S,
    ) -> None:
        from ominix_runtime.contract import Granularity
        from ominix_runtime.testing.fake_backend import FakeConfig, fake_capability

        cap = fake_capability(
            FakeConfig(
                worker_id=worker_id,
                model_name=model_name,
                vocab_size=VOCAB,
                eos_token_ids=(EOS,),
                max_model_len=8192,
                kv_num_blocks=32768,
                kv_block_size=16,
                max_batch_tokens=8192,
                max_running_requests=batch,
            ),
            Granularity.STEP,
        )
        self.capability = wire.capability_to_pb(cap)
        self.step_s = step_s
        self.batch = batch
        self.stats_path = stats_path
        # request id -> [tokens known, tokens computed]
        self.lengths: dict[str, list[int]] = {}
        # arrival, start, end, steady decode, new requests in the step, their tokens already computed (a prefix
        # cache hit)
        self.steps: list[tuple[float, float, float, bool, int, int]] = []
        # The first result is held for hold_s (HOLD_S by default), so that every client's request is in the
        # engine's queue by then and decode runs at the full batch, as it does behind a long prefill on a GPU.
        # 0 holds nothing: the steps see the requests as the engine takes them in (``intake_view``).
        self.hold_s = hold_s
        self.seen: set[str] = set()

    async def Describe(self, request: Any, context: Any) -> Any:  # noqa: ANN401
        return self.capability

    async def Health(self, request: Any, context: Any) -> Any:  # noqa: ANN401
        return worker_pb2.HealthResponse(ready=True)

    def _answer(self, step: worker_pb2.DecodeStep) -> worker_pb2.WorkerMessage:
        lengths = self.lengths
        for rid in step.finished_request_ids:
            lengths.pop(rid, None)
        out = worker_pb2.StepResult(step_id=step.step_id)
        outputs = out.outputs
        tokens = 0
        for new in step.new_requests:
            self.seen.add(new.request_id)
            known = len(new.prompt_token_ids) + len(new.output_token_ids)
            lengths[new.request_id] = [known, new.num_computed_tokens]
        rows = [(r.request_id, r.num_scheduled_tokens) for r in step.new_requests]
        rows += [(r.request_id, r.num_scheduled_tokens) for r in step.running_requests]
        for rid, n in rows:
            state = lengths.get(rid)
            if state is None:
                continue
            tokens += n
            state[1] += n
            if state[1] >= state[0]:
                state[0] += 1
                outputs.add(request_id=rid, sampled_token_id=1000 + state[0] % 1000)
            else:
                outputs.add(request_id=rid)
        out.num_tokens = tokens
        return worker_pb2.WorkerMessage(step_result=out)

    async def Run(self, request_iterator: Any, context: Any) -> AsyncIterator[worker_pb2.WorkerMessage]:  # noqa: ANN401
        loop = asyncio.get_running_loop()
        outbox: asyncio.Queue[tuple[float, worker_pb2.WorkerMessage] | None] = asyncio.Queue()
        gpu_free = 0.0

        async def read() -> None:
            nonlocal gpu_free
            try:
                async for step in request_iterator:
                    arrival = time.perf_counter()
                    steady = (
                        not step.new_requests
                        and len(step.running_requests) == self.batch
                        and all(r.num_scheduled_tokens == 1 for r in step.running_requests)
                    )
                    start = max(arrival, gpu_free)
                    # A step that only carries finished ids (the engine sends one when a request ends) runs
                    # no forward on a GPU worker: it costs no device time.
                    if step.new_requests or step.running_requests:
                        gpu_free = start + self.step_s
                    else:
                        gpu_free = start
                    cached = sum(new.num_computed_tokens for new in step.new_requests)
                    self.steps.append((arrival, start, gpu_free, steady, len(step.new_requests), cached))
                    outbox.put_nowait((gpu_free, self._answer(step)))
            finally:
                outbox.put_nowait(None)

        reader = asyncio.create_task(read())
        yield worker_pb2.WorkerMessage(heartbeat=worker_pb2.Heartbeat(worker_time=time.monotonic()))
        try:
            while True:  # heartbeats until the first step, as a real worker sends them while idle
                try:
                    first = await asyncio.wait_for(outbox.get(), 0.5)
                    break
                except asyncio.TimeoutError:
                    yield worker_pb2.WorkerMessage(
                        heartbeat=worker_pb2.Heartbeat(worker_time=time.monotonic())
                    )
            held_until = loop.time() + self.hold_s
            while len(self.seen) < self.batch and loop.time() < held_until:
                await asyncio.sleep(0.1)
                yield worker_pb2.WorkerMessage(heartbeat=worker_pb2.Heartbeat(worker_time=time.monotonic()))
            gpu_free = time.perf_counter()  # the held steps do not count as device time
            if first is None:
                return
            yield first[1]
            while True:
                item = await outbox.get()
                if item is None:
                    break
                due, message = item
                wait = due - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                yield message
        finally:
            reader.cancel()
            self.write_stats()

    def write_stats(self) -> None:
        if self.stats_path:
            Path(self.stats_path).write_text(json.dumps({"step_s": self.step_s, "steps": self.steps}))


async def serve_fake_worker(args: argparse.Namespace) -> None:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(
        FakeWorker(
            args.model_name, args.step_ms / 1e3, args.concurrency, args.stats, args.worker_id, args.hold_s
        ),
        server,
    )
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    await server.wait_for_termination()


def worker_view(stats: dict[str, Any], since: float = 0.0) -> dict[str, float]:
    """What a GPU would have seen over the steady decode steps (all but the first two) that arrived at or after
    ``since`` (perf_counter: the timed burst's start, so that an untimed one before it stays out)."""
    steps = [tuple(s) for s in stats["steps"] if s[0] >= since]
    pairs = [(p, c) for p, c in zip(steps, steps[1:], strict=False) if p[3] and c[3]][2:]
    if not pairs:
        return {}
    # As the pipelined GPU worker logs it: step N+1's arrival relative to when step N was launched (which is
    # when N-1 ended on the device); above one step time, the device waited.
    next_ready = [c[0] - p[1] for p, c in pairs]
    window = pairs[-1][1][2] - pairs[0][1][1]
    busy = len(pairs) * stats["step_s"]
    return {
        "steps": float(len(pairs)),
        "next_ready_p50_ms": statistics.median(next_ready) * 1e3,
        "next_ready_p90_ms": percentile(next_ready, 90) * 1e3,
        "busy_share": busy / window if window > 0 else float("nan"),
    }


def intake_view(stats: dict[str, Any], clients_started: float, total: int) -> dict[str, Any]:
    """How the engine took in a burst, as the worker saw it: from the clients' start (the earliest client
    process's, on the machine's one perf_counter clock) to the first step that brought a new request, and to the
    step that brought the last of ``total``; the steps that took, the new requests in each, and how many of
    their prompt tokens a prefix-cache hit spared."""
    steps = [tuple(s) for s in stats["steps"] if s[0] >= clients_started]  # an untimed burst's are earlier
    first = next((k for k, s in enumerate(steps) if s[4] > 0), None)
    if first is None:
        return {"incomplete": 0}
    steps = steps[first:]
    seen = 0
    for k, step in enumerate(steps):
        seen += int(step[4])
        if seen >= total:
            return {
                "first_step_ms": (steps[0][0] - clients_started) * 1e3,
                "all_in_ms": (step[0] - clients_started) * 1e3,
                "steps": k + 1,
                "new_per_step": [int(s[4]) for s in steps[: k + 1]],
                "cached_tokens": sum(int(s[5]) for s in steps[: k + 1]),
            }
    return {"first_step_ms": (steps[0][0] - clients_started) * 1e3, "incomplete": seen}


def ending_view(stats: dict[str, Any], clients_started: float, clients_ended: float) -> dict[str, Any]:
    """How long the burst's last results took to reach the clients: from when the worker's last step that ran
    tokens was due (its answer went out then) to the last client process's end, on the machine's one
    perf_counter clock. Every request of W1 ends in its last few steps, so this is the engine finishing them
    (freeing their KV, their terminal events) and the clients reading them."""
    ran = [tuple(s) for s in stats["steps"] if s[0] >= clients_started and s[2] > s[1]]
    if not ran:
        return {}
    return {"after_last_result_ms": (clients_ended - ran[-1][2]) * 1e3}


# ---------------------------------------------------------------- the clients


def prompt_of(i: int, prompt_len: int) -> list[int]:
    """Request i's prompt: it starts with its own token id, so no two share a cache block."""
    return [10 + i] + [(7 * i + k) % 30000 + 100 for k in range(prompt_len - 1)]


def client_report(
    counts: list[int], chunks: list[int], terminals: list[str], times: list[float], sizes: list[int],
    tpots: list[float], wall: float, started: float,
) -> dict[str, Any]:  # fmt: skip
    """What one client process hands back: per request counts, and every token chunk's arrival (perf_counter,
    which is the same clock in every process of the machine) so that several processes can be merged."""
    return {
        "wall_s": wall,
        "started_perf": started,
        "requests": len(counts),
        "all_done_once": all(t == "done" for t in terminals),
        "tokens_per_request": sorted(set(counts)),
        "tokens": sum(counts),
        "token_messages": sum(chunks),
        "chunk_times": times,
        "chunk_tokens": sizes,
        "tpot_s": tpots,
    }


async def run_lean_clients(args: argparse.Namespace) -> dict[str, Any]:
    """The leanest stream consumer: one channel, per event only what is needed to check the run."""
    channel = grpc.aio.insecure_channel(args.address)
    stub = engine_pb2_grpc.EngineStub(channel)
    counts: list[int] = []
    messages: list[int] = []  # token messages per request (below the token count when tokens were coalesced)
    terminals: list[str] = []
    times: list[float] = []
    sizes: list[int] = []
    tpots: list[float] = []
    clock = time.perf_counter

    async def one(i: int) -> None:
        request = engine_pb2.GenerateRequest(
            request_id=f"r{i}",
            sampling=common_pb2.SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True),
            stream=not args.no_stream,
        )
        request.input_ids.ids.extend(prompt_of(i, args.prompt_len))
        tokens = chunks = 0
        first = last = 0.0
        ends: list[str] = []
        async for event in stub.Generate(request):
            kind = event.WhichOneof("event")
            if kind == "token":
                n = len(event.token.token_ids)
                last = clock()
                first = first or last
                times.append(last)
                sizes.append(n)
                tokens += n
                chunks += 1
            elif kind in ("done", "error"):
                ends.append(kind)
        counts.append(tokens)
        messages.append(chunks)
        terminals.append(",".join(ends))
        if tokens > 1:
            tpots.append((last - first) / (tokens - 1))

    started = clock()
    await asyncio.gather(*(one(args.first_request + i) for i in range(args.concurrency)))
    wall = clock() - started
    await channel.close()
    return client_report(counts, messages, terminals, times, sizes, tpots, wall, started)


async def run_w1_clients(args: argparse.Namespace) -> dict[str, Any]:
    """bench/offline.py's W1 client (bench/serve.py's run_benchmark, its channels and per-event work)."""
    from bench.serve import BenchConfig, RequestSpec, run_benchmark

    config = BenchConfig(
        num_requests=args.concurrency,
        input_len=args.prompt_len,
        output_len=args.output_len,
        num_channels=args.num_channels,
        progress=False,
        batch_submit=args.batch_submit,
    )
    specs = [
        RequestSpec(max_tokens=args.output_len, prompt_ids=prompt_of(args.first_request + i, args.prompt_len))
        for i in range(args.concurrency)
    ]
    result = await run_benchmark(args.address, config, specs)
    origin = result.started_perf
    times = [origin + t for r in result.requests for t in r.chunk_times]
    sizes = [n for r in result.requests for n in r.chunk_tokens]
    tpots = [t for r in result.requests if (t := r.tpot_s) is not None]
    return client_report(
        [sum(r.chunk_tokens) for r in result.requests],
        [len(r.chunk_tokens) for r in result.requests],
        ["done" if r.success else r.error for r in result.requests],
        times, sizes, tpots, result.metrics.duration_s, origin,
    )  # fmt: skip


# ---------------------------------------------------------------- the engine, timed


@dataclass(slots=True)
class DriverState:
    """One worker group's driver task: the phases booked since its last send, and whether it is steady."""

    current: dict[str, float] = field(default_factory=dict)
    last_arrival: float = 0.0  # when the result the driver took last had arrived
    steady: bool = False


class EngineTimers:
    """Host timers around the engine's driver phases; only full-batch pure-decode steps count, and with several
    worker groups only while every group decodes at its full batch (the window)."""

    PHASES = ("schedule", "to_pb", "send", "from_pb", "update", "deliver", "turnaround")

    def __init__(self, batch: int, groups: int = 1) -> None:
        self.batch = batch
        self.groups = groups
        self.samples: dict[str, list[float]] = {p: [] for p in self.PHASES}
        # Phases are booked to the group of the task that ran them: its driver task, or the task reading its
        # results. Keyed by id() of the group's step stream.
        self.drivers: dict[int, DriverState] = {}
        self.task_stream: weakref.WeakKeyDictionary[asyncio.Task[Any], int] = weakref.WeakKeyDictionary()
        self.unbound = DriverState()
        self.arrivals: dict[int, list[float]] = {}  # id(stream) -> its results not yet taken by the driver
        self.window_open = False
        self.window_closed = False
        # Requests the engine has started, every group together: the window opens only once all of them run,
        # so a late arrival's prefill step cannot close it after a few steps (a step with a new request ends it).
        self.admitted = 0
        self.steady_steps = 0  # steps sent inside the window, every group together
        self.cpu_window: list[float] = []  # process CPU, wall at the window's start and at its last step
        self.profile: cProfile.Profile | None = None
        self.profile_path = ""
        # Profiles the timed burst's intake: from the clients' release until every request is in a sent step.
        self.intake_profile: cProfile.Profile | None = None
        # Profiles the timed burst's ending: from the update that finishes its first request until the clients
        # are done (W1's requests all end in one step).
        self.ending_profile: cProfile.Profile | None = None
        self.ending_armed = False  # set by restart(): the untimed burst's ending is not profiled

    def restart(self) -> None:
        """Forget every step so far (an untimed burst's): the window may open again, for the timed one."""
        self.samples = {p: [] for p in self.PHASES}
        self.window_open = self.window_closed = False
        self.admitted = self.steady_steps = 0
        self.cpu_window = []
        self.ending_armed = True
        self.gc_pauses.clear()
        for state in self.drivers.values():
            state.steady = False
            state.current = {}
            state.last_arrival = 0.0

    def driver(self) -> DriverState:
        """The state of the group whose driver (or result reader) task is running; a throwaway one for a task
        that has not sent or read on a stream yet."""
        stream = self.task_stream.get(asyncio.current_task())  # type: ignore[arg-type]
        return self.drivers.get(stream, self.unbound) if stream is not None else self.unbound

    def bind(self, stream: Any) -> DriverState:  # noqa: ANN401
        """The running task works for this stream's group (its driver sends, a task of its own reads)."""
        task = asyncio.current_task()
        assert task is not None
        self.task_stream[task] = id(stream)
        state = self.drivers.get(id(stream))
        if state is None:
            state = self.drivers[id(stream)] = DriverState()
        return state

    def is_steady(self, step: Any) -> bool:  # noqa: ANN401
        # A pure decode step (one token per running request, no new one) at half the per-group concurrency
        # or more: with several groups the engine's routing need not split the streams evenly (9 and 7 of 16).
        running = len(step.running_requests)
        return not step.new_requests and running * 2 >= self.batch and step.num_scheduled_tokens == running

    def add(self, phase: str, seconds: float) -> None:
        current = self.driver().current
        current[phase] = current.get(phase, 0.0) + seconds

    def step_sent(self, state: DriverState, step: Any, started: float, ended: float) -> None:  # noqa: ANN401
        self.admitted += len(step.new_requests)
        if self.intake_profile is not None and self.admitted >= self.batch * self.groups:
            self.intake_profile.disable()
        steady = self.is_steady(step)
        if steady and state.steady and self.window_open:
            # The phases booked since this driver's previous send belong to this step (schedule, its build and
            # send, and the result/update/deliver that released it).
            for phase, value in state.current.items():
                self.samples[phase].append(value)
            if state.last_arrival:
                self.samples["turnaround"].append(started - state.last_arrival)
            self.steady_steps += 1
            self.cpu_window[2:] = [time.process_time(), ended]
            if self.profile is not None and self.steady_steps == 3 * self.groups:
                self.profile.enable()
        state.steady = steady
        state.current = {}
        drivers = self.drivers.values()
        every = (
            len(drivers) == self.groups
            and all(d.steady for d in drivers)
            and self.admitted >= self.batch * self.groups
        )
        if every and not self.window_open and not self.window_closed:
            self.window_open = True
            self.cpu_window = [time.process_time(), ended]
        elif not every and self.window_open:
            self.window_open = False
            self.window_closed = True
            if self.profile is not None:
                self.profile.disable()

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self.window_open:
            self.gc_pauses.append((info["generation"], time.perf_counter() - self._gc_started))

    def install(self) -> None:
        import gc

        from ominix_runtime.backends import grpc_worker

        self.gc_pauses: list[tuple[int, float]] = []
        self._gc_started = 0.0
        gc.callbacks.append(self._on_gc)
        from ominix_runtime.engine import core, scheduler

        timers = self

        def timed(phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
                started = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    timers.add(phase, time.perf_counter() - started)

            return wrapper

        scheduler.Scheduler.schedule = timed("schedule", scheduler.Scheduler.schedule)  # type: ignore[method-assign]
        update = timed("update", scheduler.Scheduler.update)

        def update_then_profile(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            events = update(*args, **kwargs)
            if timers.ending_profile is not None and timers.ending_armed and any(map(is_terminal, events)):
                timers.ending_armed = False
                timers.ending_profile.enable()
            return events

        scheduler.Scheduler.update = update_then_profile  # type: ignore[method-assign]
        core.EngineCore._deliver = timed("deliver", core.EngineCore._deliver)  # type: ignore[method-assign]
        wire.step_to_pb = timed("to_pb", wire.step_to_pb)  # type: ignore[assignment]
        from_pb = timed("from_pb", wire.step_result_from_pb)

        def taken_from_pb(message: Any) -> Any:  # noqa: ANN401
            state = timers.driver()
            arrivals = timers.arrivals.get(timers.task_stream.get(asyncio.current_task(), 0))  # type: ignore[arg-type]
            if arrivals:
                state.last_arrival = arrivals.pop(0)
            return from_pb(message)

        wire.step_result_from_pb = taken_from_pb  # type: ignore[assignment]

        send = grpc_worker.GrpcStepStream.send

        async def timed_send(stream: Any, step: Any) -> None:  # noqa: ANN401
            state = timers.bind(stream)
            started = time.perf_counter()
            try:
                await send(stream, step)
            finally:
                ended = time.perf_counter()
                timers.add("send", ended - started)
                timers.step_sent(state, step, started, ended)

        grpc_worker.GrpcStepStream.send = timed_send  # type: ignore[method-assign,assignment]

        recv = grpc_worker.GrpcStepStream.recv

        async def bound_recv(stream: Any) -> Any:  # noqa: ANN401
            timers.bind(stream)
            return await recv(stream)

        grpc_worker.GrpcStepStream.recv = bound_recv  # type: ignore[method-assign,assignment]

        read_loop = grpc_worker.GrpcStepStream._read_loop

        async def stamped_read_loop(stream: Any) -> None:  # noqa: ANN401
            inbox = stream._inbox
            put = inbox.put_nowait
            arrivals = timers.arrivals.setdefault(id(stream), [])

            def put_stamped(item: Any) -> None:  # noqa: ANN401
                arrivals.append(time.perf_counter())
                put(item)

            inbox.put_nowait = put_stamped
            await read_loop(stream)

        grpc_worker.GrpcStepStream._read_loop = stamped_read_loop  # type: ignore[method-assign,assignment]

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"steady_steps": self.steady_steps}
        for phase, values in self.samples.items():
            if values:
                out[f"{phase}_p50_ms"] = statistics.median(values) * 1e3
                out[f"{phase}_mean_ms"] = statistics.fmean(values) * 1e3
        pauses = self.gc_pauses
        if pauses:
            out["gc_pauses_per_step"] = len(pauses) / max(1, self.steady_steps)
            out["gc_ms_per_step"] = sum(p for _, p in pauses) / max(1, self.steady_steps) * 1e3
            out["gc_max_ms"] = max(p for _, p in pauses) * 1e3
            out["gc_by_generation"] = {g: sum(1 for q, _ in pauses if q == g) for g in (0, 1, 2)}
        if len(self.cpu_window) == 4 and self.steady_steps:
            cpu0, wall0, cpu1, wall1 = self.cpu_window
            out["cpu_per_step_ms"] = (cpu1 - cpu0) / self.steady_steps * 1e3
            out["wall_per_step_ms"] = (wall1 - wall0) / self.steady_steps * 1e3
        return out


# ---------------------------------------------------------------- CPU of every process, tokens/s


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) from /proc; clock-tick resolution."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name: field 3 (state) onwards
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def sample_cpu(pids: dict[str, list[int]], out: list[tuple[float, dict[str, float]]]) -> None:
    """Every CPU_SAMPLE_S: (perf_counter, CPU seconds so far per role); runs until cancelled."""
    last: dict[int, float] = {}
    while True:
        row = {"engine": time.process_time()}
        for role, group in pids.items():
            total = 0.0
            for pid in group:
                with contextlib.suppress(OSError, ValueError, IndexError):  # exited: its last reading stands
                    last[pid] = proc_cpu_s(pid)
                total += last.get(pid, 0.0)
            row[role] = total
        out.append((time.perf_counter(), row))
        await asyncio.sleep(CPU_SAMPLE_S)


def _at(samples: list[tuple[float, dict[str, float]]], role: str, t: float) -> float:
    """A role's CPU seconds at time t, linear between the samples around it."""
    before = [s for s in samples if s[0] <= t]
    after = [s for s in samples if s[0] >= t]
    if not before or not after:
        return math.nan
    (t0, r0), (t1, r1) = before[-1], after[0]
    if t1 == t0:
        return r0[role]
    return r0[role] + (r1[role] - r0[role]) * (t - t0) / (t1 - t0)


def throughput_window(
    reports: list[dict[str, Any]], samples: list[tuple[float, dict[str, float]]]
) -> dict[str, float]:
    """Tokens/s at the clients between WINDOW[0] and WINDOW[1] of all tokens received (start and tail left
    out: the held first step, prefill, the last requests draining), and each role's CPU in that window."""
    chunks = sorted((t, n) for r in reports for t, n in zip(r["chunk_times"], r["chunk_tokens"], strict=True))
    total = sum(n for _, n in chunks)
    if not chunks or total == 0:
        return {}
    edges: list[tuple[float, int]] = []
    seen = 0
    for t, n in chunks:
        seen += n
        if len(edges) < len(WINDOW) and seen >= WINDOW[len(edges)] * total:
            edges.append((t, seen))
    (t0, n0), (t1, n1) = edges
    tokens, wall = n1 - n0, t1 - t0
    out = {
        "window_s": wall,
        "window_tokens": float(tokens),
        "out_tok_s": tokens / wall if wall > 0 else math.nan,
    }
    for role in samples[0][1] if samples else ():
        cpu = _at(samples, role, t1) - _at(samples, role, t0)
        out[f"{role}_cpu_us_per_token"] = cpu / tokens * 1e6
        out[f"{role}_cores"] = cpu / wall if wall > 0 else math.nan
    tpots = sorted(t for r in reports for t in r["tpot_s"])
    if tpots:
        out["tpot_p50_ms"] = statistics.median(tpots) * 1e3
    return out


def merge_clients(reports: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(r["tokens"] for r in reports)
    return {
        "processes": len(reports),
        "wall_s": max(r["wall_s"] for r in reports),
        "started_perf": min(r["started_perf"] for r in reports),
        "ended_perf": max(r["started_perf"] + r["wall_s"] for r in reports),
        "requests": sum(r["requests"] for r in reports),
        "all_done_once": all(r["all_done_once"] for r in reports),
        "tokens_per_request": sorted({n for r in reports for n in r["tokens_per_request"]}),
        "token_messages_per_token": sum(r["token_messages"] for r in reports) / max(1, tokens),
    }


# ---------------------------------------------------------------- the engine, run


def spawn_clients(
    args: argparse.Namespace, address: str, env: dict[str, str]
) -> list[subprocess.Popen[bytes]]:
    """``--client-procs`` client processes, the requests split evenly. Started before the engine's gRPC runs
    (forking a process with gRPC threads can fail); each, once imported, waits for a go on stdin (``go``), so
    that all start together (a late one would miss the held first step)."""
    here = Path(__file__).resolve().parent
    total = args.concurrency * args.groups
    procs = []
    first = 0
    for k in range(args.client_procs):
        count = total // args.client_procs + (1 if k < total % args.client_procs else 0)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(here / "engine_overhead.py"),
                    "--role",
                    "clients",
                    "--client",
                    args.client,
                    "--address",
                    address,
                    "--concurrency",
                    str(count),
                    "--first-request",
                    str(first),
                    "--prompt-len",
                    str(args.prompt_len),
                    "--output-len",
                    str(args.output_len),
                    "--num-channels",
                    str(args.num_channels),
                    *(["--no-stream"] if args.no_stream else []),
                    *(["--batch-submit"] if args.batch_submit else []),
                    *(["--again"] if args.again else []),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )  # fmt: skip
        )
        first += count
    return procs


def wait_for_line(procs: list[subprocess.Popen[bytes]], signal: bytes) -> None:
    """Wait for every client process's ``signal`` line."""
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != signal:
            raise RuntimeError(f"a client process did not start (exit {proc.poll()}): {line!r}")


def go(procs: list[subprocess.Popen[bytes]]) -> None:
    """Once every client process is ready, start them all together."""
    wait_for_line(procs, b"ready")
    release(procs)


def release(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.flush()


def collect(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"clients failed (exit {proc.returncode})")
    report: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return report


async def run_engine(args: argparse.Namespace, timers: EngineTimers) -> dict[str, Any]:
    from ominix_runtime import memory
    from ominix_runtime.config import (
        BackendsConfig,
        FrontConfig,
        LogConfig,
        ModelConfig,
        RuntimeConfig,
        ServerConfig,
    )
    from ominix_runtime.engine.config import EngineCoreConfig
    from ominix_runtime.server.app import EngineDaemon

    here = Path(__file__).resolve().parent
    *wports, eport = free_ports(args.groups + 1)
    stats_paths = [Path(args.work_dir) / f"fake_worker{g}.json" for g in range(args.groups)]
    for path in stats_paths:
        path.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")]))
    model_name = (
        args.model.split("/")[-1].removesuffix(".json") if args.model.startswith("dummy:") else args.model
    )
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                str(here / "engine_overhead.py"),
                "--role",
                "worker",
                "--port",
                str(wport),
                "--step-ms",
                str(args.step_ms),
                "--concurrency",
                str(args.concurrency),
                "--stats",
                str(path),
                "--model-name",
                model_name,
                "--worker-id",
                f"fake-{g}",
                "--hold-s",
                str(args.hold_s),
            ],
            env=env,
        )  # fmt: skip
        for g, (wport, path) in enumerate(zip(wports, stats_paths, strict=True))
    ]
    engine_overrides: dict[str, int] = {}  # the engine's defaults unless given
    if args.max_inflight_steps:
        engine_overrides["max_inflight_steps"] = args.max_inflight_steps
    if args.light_load_below_running >= 0:
        engine_overrides["light_load_below_running"] = args.light_load_below_running
    config = RuntimeConfig(
        model=ModelConfig(path=args.model),
        engine=EngineCoreConfig(**engine_overrides),
        backends=BackendsConfig(workers=tuple(f"127.0.0.1:{p}" for p in wports), ready_timeout=30.0),
        server=ServerConfig(port=eport, metrics_port=0, stats_interval=0, drain_timeout=5.0),
        front=FrontConfig(procs=args.front_procs),
        log=LogConfig(level="warning"),
    )
    clients = spawn_clients(args, f"127.0.0.1:{eport}", env)
    daemon = EngineDaemon(config)
    samples: list[tuple[float, dict[str, float]]] = []
    sampler: asyncio.Task[None] | None = None
    try:
        await daemon.start()
        if not args.no_gc_freeze:
            memory.freeze_startup_heap()  # as `ominix-runtime serve` does once started
        await asyncio.to_thread(go, clients)
        if args.again:  # the timed burst finds its prompts cached; the untimed one's steps are forgotten
            await asyncio.to_thread(wait_for_line, clients, b"warm")
            timers.restart()
            if timers.intake_profile is not None:
                timers.intake_profile.enable()
            release(clients)
        pids = {"clients": [c.pid for c in clients], "workers": [w.pid for w in workers]}
        if args.front_procs:
            pids["fronts"] = daemon.front_pids()
        sampler = asyncio.create_task(sample_cpu(pids, samples))
        reports = await asyncio.gather(*(asyncio.to_thread(collect, c) for c in clients))
        if timers.ending_profile is not None:
            timers.ending_profile.disable()
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        await daemon.shutdown()
        for worker in workers:
            worker.terminate()
        for worker in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.wait(10)
            worker.kill()
    result: dict[str, Any] = {
        "groups": args.groups,
        "clients": merge_clients(reports),
        "window": throughput_window(reports, samples),
        "engine": timers.report(),
        "max_inflight_steps": config.engine.max_inflight_steps,
        "light_load_below_running": config.engine.light_load_below_running,
    }
    stats = [json.loads(p.read_text()) for p in stats_paths if p.exists()]
    since = result["clients"]["started_perf"]
    views = [worker_view(s, since) for s in stats]
    if views:
        result["worker"] = views[0]
        result["workers"] = views
    if len(stats) == 1:
        result["intake"] = intake_view(stats[0], since, args.concurrency)
        result["ending"] = ending_view(stats[0], since, result["clients"]["ended_perf"])
    return result


def print_report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    eng, cli, wrk = result["engine"], result["clients"], result.get("worker", {})
    mode = "instant worker" if args.step_ms == 0 else f"worker step {args.step_ms:g} ms"
    mode += f", {result['max_inflight_steps']} steps in flight"
    if result["light_load_below_running"]:
        below = result["light_load_below_running"]
        mode += f" (at most {LIGHT_LOAD_INFLIGHT_STEPS} below {below} running while none waits)"
    stream = "non-streaming" if args.no_stream else "streaming"
    groups = f"{args.groups} groups × " if args.groups > 1 else ""
    print(
        f"{groups}{args.concurrency} {stream} requests × {args.prompt_len} prompt × {args.output_len} output tokens, "
        f"{mode}; {args.client} client in {cli['processes']} process(es); {cli['wall_s']:.2f} s; every request "
        f"one Done: {cli['all_done_once']}; tokens/request {cli['tokens_per_request']}; token messages per token "
        f"{cli['token_messages_per_token']:.2f}"
    )
    win = result.get("window", {})
    if "out_tok_s" in win:
        shares = "; ".join(
            f"{role} {win[f'{role}_cpu_us_per_token']:.1f} µs/token ({win[f'{role}_cores']:.2f} cores)"
            for role in ("engine", "fronts", "clients", "workers")
            if f"{role}_cores" in win
        )
        lo, hi = WINDOW
        print(
            f"tokens {lo:.0%}–{hi:.0%} received: {win['out_tok_s']:,.0f} out tok/s over {win['window_s']:.2f} s, "
            f"TPOT p50 {win.get('tpot_p50_ms', math.nan):.2f} ms; CPU: {shares}"
        )
    per_group = f" in each of {args.groups} groups, counted together" if args.groups > 1 else ""
    print(f"steady decode steps at batch {args.concurrency}{per_group}: {eng['steady_steps']}")
    for phase in EngineTimers.PHASES:
        if f"{phase}_p50_ms" in eng:
            print(
                f"  {phase:<11} p50 {eng[f'{phase}_p50_ms']:7.3f} ms   mean {eng[f'{phase}_mean_ms']:7.3f} ms"
            )
    if "cpu_per_step_ms" in eng:
        driver = sum(
            eng.get(f"{p}_mean_ms", 0.0) for p in ("schedule", "to_pb", "from_pb", "update", "deliver")
        )
        print(
            f"  engine process CPU per step {eng['cpu_per_step_ms']:.3f} ms (driver phases {driver:.3f} ms, rest "
            f"{eng['cpu_per_step_ms'] - driver:.3f} ms: client streams, gRPC, event loop); wall per step "
            f"{eng['wall_per_step_ms']:.3f} ms"
        )
    if "gc_ms_per_step" in eng:
        print(
            f"  garbage collection: {eng['gc_pauses_per_step']:.2f} runs and {eng['gc_ms_per_step']:.3f} ms per step, "
            f"longest {eng['gc_max_ms']:.2f} ms, runs by generation {eng['gc_by_generation']}"
        )
    intake = result.get("intake", {})
    if "all_in_ms" in intake:
        shown = intake["new_per_step"][:16]
        print(
            f"  intake: first step {intake['first_step_ms']:.1f} ms after the clients started, every request in a "
            f"step after {intake['all_in_ms']:.1f} ms ({intake['steps']} steps; new requests per step "
            f"{', '.join(map(str, shown))}{', ...' if len(intake['new_per_step']) > 16 else ''}; "
            f"{intake['cached_tokens']:,} of their prompt tokens cached)"
        )
    ending = result.get("ending", {})
    if "after_last_result_ms" in ending:
        print(
            f"  ending: the clients' last event {ending['after_last_result_ms']:.1f} ms after the worker's last "
            "result with tokens was due"
        )
    if wrk and args.step_ms > 0:
        print(
            f"  as the worker saw it ({wrk['steps']:.0f} steps): next_ready p50 {wrk['next_ready_p50_ms']:.2f} ms, "
            f"p90 {wrk['next_ready_p90_ms']:.2f} ms; busy {wrk['busy_share']:.1%}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=("engine", "worker", "clients"), default="engine")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--step-ms", type=float, default=0.0, help="fake worker step time (0: answer at once)"
    )
    parser.add_argument("--max-inflight-steps", type=int, default=0, help="0: the engine's default")
    parser.add_argument(
        "--light-load-below-running",
        type=int,
        default=-1,
        help=f"at most {LIGHT_LOAD_INFLIGHT_STEPS} steps in flight below this many running requests while none "
        "waits (0: never; -1: the engine's default)",
    )
    parser.add_argument(
        "--no-gc-freeze", action="store_true", help="leave the collector as the process started"
    )
    parser.add_argument(
        "--no-stream", action="store_true", help="clients ask for the final event only (lean)"
    )
    parser.add_argument(
        "--groups",
        type=int,
        default=1,
        help="fake worker processes (TP=1 groups), --concurrency streams each",
    )
    parser.add_argument("--client-procs", type=int, default=1, help="client processes splitting the streams")
    parser.add_argument(
        "--front-procs", type=int, default=0, help="the engine's front processes (serve --front-procs)"
    )
    parser.add_argument(
        "--client", choices=("w1", "lean"), default="w1",
        help="w1: bench/offline.py's client (bench/serve.py, plain asyncio, --num-channels); lean: minimal, uvloop",
    )  # fmt: skip
    parser.add_argument(
        "--num-channels", type=int, default=4, help="gRPC connections per client process (w1)"
    )
    parser.add_argument(
        "--batch-submit",
        action="store_true",
        help="w1: each client process sends its requests in one GenerateBatch call (bench/offline.py --batch-submit)",
    )
    parser.add_argument(
        "--again",
        action="store_true",
        help="w1: each client process first sends its requests untimed, then, once all are done, the same "
        "prompts again (W1 again: the engine's prefix cache holds them); the report is the second burst's",
    )
    parser.add_argument(
        "--hold-s",
        type=float,
        default=HOLD_S,
        help="the fake worker holds its first result this long or until every request was in a step, so decode "
        "starts at the full batch; 0: no hold, the steps take the requests as the engine admits them (the "
        "intake line)",
    )
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--profile", default="", help="write a cProfile of the steady steps here (pstats)")
    parser.add_argument(
        "--profile-intake",
        default="",
        help="with --again: write a cProfile of the engine process from the timed burst's release until every "
        "request is in a sent step (pstats)",
    )
    parser.add_argument(
        "--profile-ending",
        default="",
        help="with --again: write a cProfile of the engine process from the timed burst's first finished request "
        "until the clients are done (pstats)",
    )
    parser.add_argument("--json", default="")
    parser.add_argument("--work-dir", default="/tmp")
    # internal: the child processes
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--address", default="")
    parser.add_argument("--stats", default="")
    parser.add_argument("--model-name", default="")
    parser.add_argument("--worker-id", default="fake-0")
    parser.add_argument("--first-request", type=int, default=0)
    args = parser.parse_args(argv)
    if args.no_stream:
        args.client = "lean"
    if (args.batch_submit or args.again) and args.client != "w1":
        parser.error("--batch-submit and --again are the w1 client's")
    try:
        import uvloop
    except ImportError:  # plain asyncio then
        uvloop = None  # type: ignore[assignment]
    runner: Callable[[Any], Any] = uvloop.run if uvloop is not None else asyncio.run
    if args.role == "worker":
        runner(serve_fake_worker(args))
        return 0
    if args.role == "clients":
        print("ready", flush=True)
        sys.stdin.readline()  # the go: every client process starts together
        if args.client == "w1":
            if args.again:  # the same prompts once untimed, then, once every process is done, timed
                asyncio.run(run_w1_clients(args))
                print("warm", flush=True)
                sys.stdin.readline()
            report = asyncio.run(run_w1_clients(args))  # as bench/offline.py runs it
        else:
            report = runner(run_lean_clients(args))
        print(json.dumps(report))
        return 0
    from ominix_runtime.server.logging import configure_logging

    configure_logging("warning", json_output=True)
    timers = EngineTimers(args.concurrency, args.groups)
    timers.install()
    if args.profile:
        timers.profile = cProfile.Profile()
    if args.profile_intake:
        if not args.again:
            print("--profile-intake needs --again", file=sys.stderr)
            return 2
        timers.intake_profile = cProfile.Profile()
    if args.profile_ending:
        if not args.again:
            print("--profile-ending needs --again", file=sys.stderr)
            return 2
        if args.profile or args.profile_intake:  # one cProfile at a time: enabling one stops another's hook
            print("--profile-ending goes alone (not with --profile or --profile-intake)", file=sys.stderr)
            return 2
        timers.ending_profile = cProfile.Profile()
    result = runner(run_engine(args, timers))
    print_report(args, result)
    profiles = (
        (args.profile, timers.profile),
        (args.profile_intake, timers.intake_profile),
        (args.profile_ending, timers.ending_profile),
    )
    for path, profile in profiles:
        if path and profile is not None:
            profile.dump_stats(path)
            pstats.Stats(path).sort_stats("tottime").print_stats(25)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
