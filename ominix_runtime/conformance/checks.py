"""Backend conformance checks. Each is an async function of a :class:`Harness`; it returns a short message
on success and raises :class:`CheckFailed` with a readable explanation otherwise.

The checks drive the backend through a real EngineCore, so a step-level backend is judged together with
the engine's scheduler (which owns its event stream), and a request-level backend by the events it streams
(the engine counts any contract breach it had to repair as a protocol violation).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from ominix_runtime.contract import (
    BackendAdapter,
    BackendCapability,
    Done,
    FinishReason,
    GenerateRequest,
    Granularity,
    OminixError,
    PrefillDone,
    RuntimeErrorKind,
    SamplingParams,
    Token,
    Usage,
    WorkerEvent,
    is_terminal,
)
from ominix_runtime.engine import EngineCore, EngineCoreConfig, RequestHandle, SchedulerConfig


class CheckFailed(AssertionError):
    """A conformance check failed; the message says what was observed and what was expected."""


BackendFactory = Callable[[], Sequence[BackendAdapter]]


@dataclass(slots=True)
class Harness:
    """Fresh backends and engines for one check."""

    make_backends: BackendFactory
    step_timeout: float = 120.0
    _engines: list[EngineCore] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    async def engine(self, scheduler: SchedulerConfig | None = None) -> EngineCore:
        config = EngineCoreConfig(scheduler=scheduler or SchedulerConfig(), step_timeout=self.step_timeout)
        core = EngineCore(list(self.make_backends()), config)
        self._engines.append(core)
        await core.start()
        return core

    async def close(self) -> None:
        for core in self._engines:
            await core.stop()
        self._engines.clear()

    def request_id(self, tag: str) -> str:
        return f"conformance-{tag}-{next(self._ids)}"


def _prompt(cap: BackendCapability, n: int, salt: int = 0) -> list[int]:
    vocab = cap.model.vocab_size if cap.model.vocab_size > 0 else 32000
    eos = set(cap.model.eos_token_ids)
    base = min(100, max(vocab // 4, 1))
    out: list[int] = []
    i = 0
    while len(out) < n:
        t = (base + (salt * 7919 + i * 31) % max(vocab - base, 1)) % vocab
        if t not in eos:
            out.append(t)
        i += 1
    return out


def _request(
    h: Harness,
    cap: BackendCapability,
    tag: str,
    n: int = 8,
    max_tokens: int = 6,
    salt: int = 0,
    seed: int | None = None,
    top_k: int = -1,
) -> GenerateRequest:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed, top_k=top_k)
    return GenerateRequest(h.request_id(tag), _prompt(cap, n, salt), sp)


async def _collect(core: EngineCore, requests: Sequence[GenerateRequest]) -> dict[str, list[WorkerEvent]]:
    handles = [core.submit(r) for r in requests]

    async def one(handle: RequestHandle) -> list[WorkerEvent]:
        return [e async for e in handle]

    outs = await asyncio.gather(*(one(hd) for hd in handles))
    return {hd.request_id: events for hd, events in zip(handles, outs, strict=True)}


def _names(events: Sequence[WorkerEvent]) -> str:
    shown = [type(e).__name__ for e in events[:8]]
    return ", ".join(shown) + (", ..." if len(events) > 8 else "")


def _cap(core: EngineCore) -> BackendCapability:
    return core.capabilities()[0]


def _fitting_max_tokens(core: EngineCore, prompt_len: int, want: int) -> int:
    """``want`` reduced so that prompt + max_tokens fits the context and every group's KV."""
    limit = want
    for g in core.groups:
        limit = min(limit, g.capability.model.max_model_len - prompt_len)
        capacity = g.kv_token_capacity
        if capacity is not None:
            limit = min(limit, capacity - prompt_len)
    return max(1, limit)


# ---- checks ---------------------------------------------------------------------------------------------


async def capability_declaration(h: Harness) -> str:
    """Every backend states a complete, self-consistent capability (capability.problems() is empty)."""
    backends = list(h.make_backends())
    try:
        caps = [await b.describe() for b in backends]
    finally:
        for b in backends:
            await b.close()
    problems = [f"{c.worker_id or '?'}: {p}" for c in caps for p in c.problems()]
    if problems:
        raise CheckFailed("capability problems: " + "; ".join(problems))
    parts = []
    for c in caps:
        kv = (
            f"{c.kv_num_blocks} blocks x {c.kv_block_size}"
            if c.granularity == Granularity.STEP
            else "request-level"
        )
        parts.append(f"{c.worker_id} ({c.kind.name.lower()}, {c.device}, {kv})")
    return ", ".join(parts)


async def prefill_done_before_first_token(h: Harness) -> str:
    """PrefillDone comes before the first Token of every request."""
    core = await h.engine()
    cap = _cap(core)
    reqs = [_request(h, cap, "prefill", n=5 + i, salt=i) for i in range(4)]
    streams = await _collect(core, reqs)
    for rid, events in streams.items():
        first_token = next((i for i, e in enumerate(events) if isinstance(e, Token)), None)
        prefill = next((i for i, e in enumerate(events) if isinstance(e, PrefillDone)), None)
        if first_token is None:
            raise CheckFailed(f"{rid}: no Token at all (events: {_names(events)})")
        if prefill is None or prefill > first_token:
            raise CheckFailed(f"{rid}: Token arrived before PrefillDone (events: {_names(events)})")
    return f"{len(streams)} requests"


async def events_ordered_per_request(h: Harness) -> str:
    """Per request: PrefillDone, Token..., Usage, terminal; ids match; Usage counts the tokens streamed."""
    core = await h.engine()
    cap = _cap(core)
    reqs = [_request(h, cap, "order", n=6 + 3 * i, max_tokens=4 + i, salt=10 + i) for i in range(6)]
    streams = await _collect(core, reqs)
    for rid, events in streams.items():
        wrong_id = [e for e in events if e.request_id != rid]
        if wrong_id:
            raise CheckFailed(f"{rid}: got an event for {wrong_id[0].request_id!r}")
        if len(events) < 2 or not isinstance(events[-2], Usage) or not is_terminal(events[-1]):
            raise CheckFailed(
                f"{rid}: stream must end with Usage then Done/Error (events: {_names(events[-4:])})"
            )
        body = events[:-2]
        if not body or not isinstance(body[0], PrefillDone):
            raise CheckFailed(f"{rid}: stream must start with PrefillDone (events: {_names(events)})")
        if any(not isinstance(e, Token) for e in body[1:]):
            raise CheckFailed(
                f"{rid}: only Tokens may follow PrefillDone before Usage (events: {_names(events)})"
            )
        n_tokens = sum(len(e.token_ids) for e in body if isinstance(e, Token))
        usage = events[-2]
        assert isinstance(usage, Usage)
        if usage.completion_tokens != n_tokens:
            raise CheckFailed(
                f"{rid}: Usage.completion_tokens {usage.completion_tokens} but {n_tokens} tokens sent"
            )
    return f"{len(streams)} requests, {sum(len(v) for v in streams.values())} events"


async def exactly_one_terminal_event(h: Harness) -> str:
    """Every request ends with exactly one Done or Error, also when aborted, and the backend sent no extras."""
    core = await h.engine()
    cap = _cap(core)
    reqs = [_request(h, cap, "terminal", n=6, max_tokens=3 + i, salt=20 + i) for i in range(5)]
    handles = [core.submit(r) for r in reqs]
    core.abort(handles[0].request_id)
    for hd in handles:
        events = [e async for e in hd]
        n = sum(is_terminal(e) for e in events)
        if n != 1:
            raise CheckFailed(f"{hd.request_id}: {n} terminal events (events: {_names(events)})")
    await asyncio.sleep(0.05)  # let a request-level forwarder notice trailing events
    stats = core.stats()
    if stats.protocol_violations:
        # Terminal-event breaches first: they are what this check is about.
        shown = sorted(stats.recent_protocol_violations, key=lambda v: "terminal event" not in v)[:2]
        raise CheckFailed(
            f"the backend broke the event contract {stats.protocol_violations} time(s) (the engine passed on "
            "only the first terminal event): " + "; ".join(shown)
        )
    return f"{len(handles)} requests (one aborted)"


async def abort_frees_kv(h: Harness) -> str:
    """Aborting running requests ends them with Done(ABORT) and returns every KV block at once."""
    core = await h.engine()
    cap = _cap(core)
    max_tokens = _fitting_max_tokens(core, 8, 2000)
    handles = [
        core.submit(_request(h, cap, "abort", n=8, max_tokens=max_tokens, salt=30 + i)) for i in range(3)
    ]
    for hd in handles:  # wait until each is really running
        first = await anext(hd.__aiter__())
        if is_terminal(first):
            raise CheckFailed(f"{hd.request_id}: ended before it could be aborted: {first!r}")
    for hd in handles:
        if not core.abort(hd.request_id):
            raise CheckFailed(f"{hd.request_id}: abort() found no live request")
    for hd in handles:
        events = [e async for e in hd]
        end = events[-1] if events else None
        if not isinstance(end, Done) or end.finish_reason != FinishReason.ABORT:
            raise CheckFailed(f"{hd.request_id}: expected Done(ABORT), got {end!r}")
    for g in core.groups:
        leased, _ = g.kv_blocks
        if leased:
            raise CheckFailed(f"{g.worker_id}: {leased} KV blocks still leased after abort")
        g.check_integrity()  # no leases left without a running request
    used = sum(load.kv_bytes_used for load in core.load())
    if used:
        raise CheckFailed(f"load() still reports {used} KV bytes used after abort")
    return f"{len(handles)} aborted, 0 blocks leased"


async def capacity_overflow_rejected(h: Harness) -> str:
    """A request needing more KV than the worker has is rejected at once with KV_CAPACITY_EXCEEDED."""
    core = await h.engine()
    cap = _cap(core)
    if cap.granularity != Granularity.STEP:
        return "not applicable: a request-level backend owns its KV"
    capacity = core.groups[0].kv_token_capacity
    assert capacity is not None  # a step-level group: the engine manages its KV
    if capacity + 1 > cap.model.max_model_len:
        # Every request within max_model_len fits; check the engine-side limit with a reduced KV instead.
        core = await h.engine(SchedulerConfig(max_kv_blocks=2))
        capacity = 2 * cap.kv_block_size
        note = "engine limited to 2 KV blocks: "
    else:
        note = ""
    req = _request(h, cap, "overflow", n=4, max_tokens=capacity)
    try:
        core.submit(req)
    except OminixError as exc:
        if exc.kind != RuntimeErrorKind.KV_CAPACITY_EXCEEDED:
            raise CheckFailed(
                f"rejected with {exc.kind.name} instead of KV_CAPACITY_EXCEEDED: {exc.message}"
            ) from exc
        return f"{note}rejected: {exc.message}"
    core.abort(req.request_id)
    raise CheckFailed(f"a request needing {4 + capacity} tokens of KV (capacity {capacity}) was accepted")


async def survives_kv_exhaustion(h: Harness) -> str:
    """Many concurrent requests on a small KV cache all complete (preemption by recompute)."""
    probe = await h.engine()
    cap = _cap(probe)
    n_requests = 8
    if cap.granularity != Granularity.STEP:
        reqs = [_request(h, cap, "exhaust", n=16, max_tokens=8, salt=40 + i) for i in range(4 * n_requests)]
        streams = await _collect(probe, reqs)
        bad = [rid for rid, ev in streams.items() if not isinstance(ev[-1], Done)]
        if bad:
            raise CheckFailed(f"{len(bad)} of {len(reqs)} requests did not complete, e.g. {bad[0]}")
        return f"{len(reqs)} concurrent requests completed (request-level: the backend manages its KV)"
    await probe.stop()
    bs = cap.kv_block_size
    blocks = min(8, cap.kv_num_blocks)
    core = await h.engine(SchedulerConfig(max_kv_blocks=blocks))
    prompt_len = max(1, min(bs + bs // 2, blocks * bs // 2))
    max_tokens = max(1, min(bs, blocks * bs - prompt_len))
    reqs = [
        _request(h, cap, "exhaust", n=prompt_len, max_tokens=max_tokens, salt=50 + i)
        for i in range(n_requests)
    ]
    streams = await _collect(core, reqs)
    for rid, events in streams.items():
        end = events[-1]
        if not isinstance(end, Done) or end.finish_reason != FinishReason.LENGTH:
            raise CheckFailed(f"{rid}: ended with {end!r} instead of Done(LENGTH)")
        got = sum(len(e.token_ids) for e in events if isinstance(e, Token))
        if got != max_tokens:
            raise CheckFailed(f"{rid}: {got} tokens instead of {max_tokens}")
    stats = core.stats()
    if stats.preemptions == 0:
        raise CheckFailed(f"{n_requests} requests on {blocks} KV blocks completed without any preemption")
    core.check_integrity()
    return f"{n_requests} requests on {blocks} blocks of {bs}: all complete, {stats.preemptions} preemptions"


async def same_seed_same_tokens(h: Harness) -> str:
    """A seeded request draws the same tokens when run again, alone or inside a different batch."""
    core = await h.engine()
    cap = _cap(core)

    def target(tag: str) -> GenerateRequest:  # temperature 1.0 (the default): a real draw
        return _request(h, cap, tag, n=12, max_tokens=10, salt=77, seed=4242, top_k=50)

    alone = await _collect(core, [target("seed-alone")])
    again = await _collect(core, [target("seed-again")])
    others = [
        _request(h, cap, "seed-other", n=5 + 4 * i, max_tokens=12, salt=90 + i, seed=i) for i in range(5)
    ]
    mixed_target = target("seed-batch")
    batch = await _collect(core, [*others[:3], mixed_target, *others[3:]])

    def toks(events: list[WorkerEvent]) -> list[int]:
        if not isinstance(events[-1], Done):
            raise CheckFailed(f"the seeded request ended with {events[-1]!r}")
        return [t for e in events if isinstance(e, Token) for t in e.token_ids]

    ref = toks(next(iter(alone.values())))
    for label, got in (
        ("run again", toks(next(iter(again.values())))),
        ("in a batch", toks(batch[mixed_target.request_id])),
    ):
        if got != ref:
            pos = next(
                (i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), min(len(ref), len(got))
            )
            raise CheckFailed(
                f"seed 4242 {label}: tokens differ at position {pos}: {ref[pos : pos + 4]} vs {got[pos : pos + 4]}"
            )
    return f"{len(ref)} tokens identical alone, again and in a batch of {len(others) + 1}"


CheckFn = Callable[[Harness], Awaitable[str]]

ALL_CHECKS: dict[str, CheckFn] = {
    "capability_declaration": capability_declaration,
    "prefill_done_before_first_token": prefill_done_before_first_token,
    "events_ordered_per_request": events_ordered_per_request,
    "exactly_one_terminal_event": exactly_one_terminal_event,
    "abort_frees_kv": abort_frees_kv,
    "capacity_overflow_rejected": capacity_overflow_rejected,
    "survives_kv_exhaustion": survives_kv_exhaustion,
    "same_seed_same_tokens": same_seed_same_tokens,
}

__all__ = ["ALL_CHECKS", "CheckFailed", "CheckFn", "Harness"]
