"""Backend conformance checks. Each is an async function of a :class:`Harness`; it returns a short message
on success and raises :class:`CheckFailed` with a readable explanation otherwise.

The checks drive the backend through a real EngineCore, so a step-level backend is judged together with
the engine's scheduler (which owns its event stream), and a request-level backend by the events it streams
(the engine counts any contract breach it had to repair as a protocol violation).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from ominix_runtime.contract import (
    BackendAdapter,
    BackendCapability,
    Done,
    Error,
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


class CheckSkipped(Exception):
    """The check cannot apply to this backend (the message says why); it reports SKIP, never PASS."""


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


def _fitting_max_tokens(core: EngineCore, prompt_len: int, want: int, concurrent: int = 1) -> int:
    """``want`` reduced so that prompt + max_tokens fits the context and every group's KV, and a
    request-level backend's pool holds ``concurrent`` such requests at once (else it queues them)."""
    limit = want
    for g in core.groups:
        limit = min(limit, g.capability.model.max_model_len - prompt_len)
        capacity = g.kv_token_capacity  # the engine-managed KV of a step-level group
        if capacity is None:
            capacity = g.capability.kv_capacity_tokens // concurrent or None  # a backend's own pool
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
    max_tokens = _fitting_max_tokens(core, 8, 2000, concurrent=3)
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
    """A request needing more KV than the backend has is rejected at once with KV_CAPACITY_EXCEEDED; the
    size comes from the capacity the backend reports (a request-level backend's own pool, e.g. SGLang's)."""
    core = await h.engine()
    cap = _cap(core)
    max_len = cap.model.max_model_len
    note = ""
    if cap.granularity == Granularity.STEP:
        capacity = core.groups[0].kv_token_capacity
        assert capacity is not None  # a step-level group: the engine manages its KV
        if capacity + 1 > max_len:
            # Every request within max_model_len fits; check the engine-side limit with a reduced KV instead
            # (a fresh engine: a worker takes one engine's Run stream at a time).
            await core.stop()
            core = await h.engine(SchedulerConfig(max_kv_blocks=2))
            capacity = 2 * cap.kv_block_size
            note = "engine limited to 2 KV blocks: "
    else:
        capacity = cap.kv_capacity_tokens
        if capacity <= 0:
            raise CheckSkipped("the backend reports no KV capacity")
        if capacity + 4 > max_len:
            raise CheckSkipped(
                f"the backend's KV pool ({capacity} tokens) holds any request within its context "
                f"length ({max_len}): no admissible request can exceed it"
            )
        note = f"backend-reported pool of {capacity} tokens: "
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


# Most concurrent requests a request-level exhaustion run may use (each check has a time limit).
MAX_EXHAUSTION_REQUESTS = 64


async def survives_kv_exhaustion(h: Harness) -> str:
    """Concurrent requests demanding more KV than the backend has all complete: a step-level backend by
    preemption, a request-level one by its own queueing or retraction. Sized from the reported capacity."""
    probe = await h.engine()
    cap = _cap(probe)
    n_requests = 8
    if cap.granularity != Granularity.STEP:
        return await _request_level_exhaustion(h, probe, cap)
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


async def _request_level_exhaustion(h: Harness, core: EngineCore, cap: BackendCapability) -> str:
    capacity = cap.kv_capacity_tokens
    if capacity <= 0:
        raise CheckSkipped("the backend reports no KV capacity to exhaust")
    per_request = min(max(capacity // 4, 2), cap.model.max_model_len - 1)
    n_requests = math.ceil(1.5 * capacity / per_request)
    if n_requests > MAX_EXHAUSTION_REQUESTS:
        raise CheckSkipped(
            f"exhausting {capacity} KV tokens with requests of at most {per_request} tokens needs "
            f"{n_requests} concurrent requests (more than {MAX_EXHAUSTION_REQUESTS})"
        )
    max_tokens = min(8, per_request // 2)
    prompt_len = per_request - max_tokens
    reqs = [
        _request(h, cap, "exhaust", n=prompt_len, max_tokens=max_tokens, salt=40 + i)
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
    demand = n_requests * per_request
    return (
        f"{n_requests} concurrent requests of {per_request} tokens ({demand} tokens, "
        f"{demand / capacity:.1f}x the backend's {capacity}-token pool): all complete"
    )


async def unsupported_model_rejected(h: Harness) -> str:
    """A request for a model no backend serves is refused at submit with CAPABILITY_MISMATCH."""
    core = await h.engine()
    cap = _cap(core)
    req = _request(h, cap, "model")
    req.model = "conformance/no-such-model"
    try:
        core.submit(req)
    except OminixError as exc:
        if exc.kind != RuntimeErrorKind.CAPABILITY_MISMATCH:
            raise CheckFailed(
                f"rejected with {exc.kind.name} instead of CAPABILITY_MISMATCH: {exc.message}"
            ) from exc
        return f"rejected: {exc.message}"
    core.abort(req.request_id)
    raise CheckFailed(f"a request for {req.model!r} was accepted (the backend serves {cap.model.name!r})")


async def abort_is_idempotent(h: Harness) -> str:
    """Aborting twice, aborting an unknown id and aborting a finished request are harmless no-ops: one
    Done(ABORT), no second terminal event, no KV left."""
    core = await h.engine()
    cap = _cap(core)
    handle = core.submit(_request(h, cap, "abort-twice", max_tokens=_fitting_max_tokens(core, 8, 2000)))
    events = [await anext(handle.__aiter__())]
    if is_terminal(events[0]):
        raise CheckFailed(f"ended before it could be aborted: {events[0]!r}")
    first, second = core.abort(handle.request_id), core.abort(handle.request_id)
    events += [e async for e in handle]
    if not first:
        raise CheckFailed("the first abort found no live request")
    if second:
        raise CheckFailed("a second abort of the same request found it live again")
    ends = [e for e in events if is_terminal(e)]
    if len(ends) != 1 or not isinstance(ends[0], Done) or ends[0].finish_reason != FinishReason.ABORT:
        raise CheckFailed(f"expected exactly one Done(ABORT), got {ends!r}")
    if core.abort("conformance-never-submitted") or core.abort(handle.request_id):
        raise CheckFailed("aborting an unknown or finished request reported a live request")
    await asyncio.sleep(0.05)  # a late event from the backend would show up as a protocol violation
    if core.stats().protocol_violations:
        raise CheckFailed(
            "the backend sent events after the abort: "
            + "; ".join(core.stats().recent_protocol_violations[:2])
        )
    _check_no_kv_held(core)
    return "abort twice, unknown id, finished id: one Done(ABORT), no KV held"


async def deadline_enforced(h: Harness) -> str:
    """A request whose deadline passes ends with Error(TIMEOUT) and frees its KV."""
    core = await h.engine()
    cap = _cap(core)
    deadline_s = 0.05
    req = _request(h, cap, "deadline", max_tokens=_fitting_max_tokens(core, 8, 4000))
    req.deadline = req.arrival_time + deadline_s
    start = time.monotonic()
    (events,) = (await _collect(core, [req])).values()
    took = time.monotonic() - start
    end = events[-1]
    n_tokens = sum(len(e.token_ids) for e in events if isinstance(e, Token))
    if isinstance(end, Done) and end.finish_reason == FinishReason.LENGTH and took < deadline_s:
        raise CheckSkipped(
            f"the backend generated all {n_tokens} tokens within the {deadline_s * 1000:g} ms deadline"
        )
    if not isinstance(end, Error) or end.kind != RuntimeErrorKind.TIMEOUT:
        raise CheckFailed(f"after a {deadline_s * 1000:g} ms deadline the request ended with {end!r}")
    if sum(is_terminal(e) for e in events) != 1:
        raise CheckFailed(f"{sum(is_terminal(e) for e in events)} terminal events")
    _check_no_kv_held(core)
    return f"Error(TIMEOUT) after {took * 1000:.0f} ms and {n_tokens} tokens, no KV held"


def _check_no_kv_held(core: EngineCore) -> None:
    for g in core.groups:
        leased, _ = g.kv_blocks
        if leased:
            raise CheckFailed(f"{g.worker_id}: {leased} KV blocks still leased")
        g.check_integrity()
        if g.num_running or g.num_queued:
            raise CheckFailed(f"{g.worker_id}: requests still counted as live after they ended")


async def same_seed_same_tokens(h: Harness) -> str:
    """A seeded request draws the same tokens when it runs again in the same situation: alone twice, and
    inside the same batch twice (every request of that batch, each with its own seed).

    That is what seeded sampling promises, here as in vLLM: the draw depends on the seed, the position and
    the logits, and the logits of a bfloat16 or float16 model legitimately depend on the batch around the
    request (other batch shapes round differently in the matrix products), so the same request alone and
    inside a batch may part after a few tokens; neither vLLM nor SGLang (without
    ``--enable-deterministic-inference``) promises batch invariance. So runs are compared only with runs of
    the same composition, with prefix caching off (a prefix hit changes the prefill's shapes too); whether
    alone and in the batch agreed is reported, not judged. A backend that ignores the seed draws anew on
    the second run and fails. A request-level backend forms its batches and caches prefixes itself: it
    reruns alike only when it computes deterministically (SGLang: ``--enable-deterministic-inference``).
    """
    core = await h.engine(SchedulerConfig(enable_prefix_caching=False))
    cap = _cap(core)

    def target(tag: str) -> GenerateRequest:  # temperature 1.0 (the default): a real draw
        return _request(h, cap, tag, n=12, max_tokens=10, salt=77, seed=4242, top_k=50)

    def batch(tag: str) -> list[GenerateRequest]:  # the target among five others, each with its own seed
        others = [
            _request(h, cap, f"{tag}-other", n=5 + 4 * i, max_tokens=12, salt=90 + i, seed=i)
            for i in range(5)
        ]
        return [*others[:3], target(tag), *others[3:]]

    def toks(events: list[WorkerEvent]) -> list[int]:
        if not isinstance(events[-1], Done):
            raise CheckFailed(f"a seeded request ended with {events[-1]!r}")
        return [t for e in events if isinstance(e, Token) for t in e.token_ids]

    def first_difference(a: list[int], b: list[int]) -> int | None:
        if a == b:
            return None
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    def same(label: str, seed: int | None, ref: list[int], got: list[int], hint: str = "") -> None:
        pos = first_difference(ref, got)
        if pos is not None:
            raise CheckFailed(
                f"seed {seed} {label}: tokens differ at position {pos}: {ref[pos : pos + 4]} vs "
                f"{got[pos : pos + 4]}{hint}"
            )

    # SGLang's own batching and radix cache change the shapes of a rerun unless it is told not to.
    hint = (
        " (an SGLang server reruns alike only with --enable-deterministic-inference)"
        if cap.granularity == Granularity.REQUEST
        else ""
    )
    alone: list[list[int]] = []
    for tag in ("seed-alone", "seed-again"):
        request = target(tag)
        alone.append(toks((await _collect(core, [request]))[request.request_id]))
    same("run alone twice", 4242, alone[0], alone[1], hint)
    runs: list[list[tuple[int | None, list[int]]]] = []
    for tag in ("seed-batch", "seed-batch-again"):
        requests = batch(tag)
        out = await _collect(core, requests)
        runs.append([(r.sampling.seed, toks(out[r.request_id])) for r in requests])
    for (seed, ref), (_, got) in zip(runs[0], runs[1], strict=True):
        same("in the same batch twice", seed, ref, got, hint)
    pos = first_difference(alone[0], runs[0][3][1])
    versus = (
        "the same tokens"
        if pos is None
        else f"parted at position {pos} (allowed: low-precision logits depend on the batch)"
    )
    return (
        f"{len(alone[0])} tokens identical alone twice and in a batch of {len(runs[0])} twice; "
        f"alone vs in the batch: {versus}"
    )


CheckFn = Callable[[Harness], Awaitable[str]]

ALL_CHECKS: dict[str, CheckFn] = {
    "capability_declaration": capability_declaration,
    "prefill_done_before_first_token": prefill_done_before_first_token,
    "events_ordered_per_request": events_ordered_per_request,
    "exactly_one_terminal_event": exactly_one_terminal_event,
    "abort_frees_kv": abort_frees_kv,
    "capacity_overflow_rejected": capacity_overflow_rejected,
    "survives_kv_exhaustion": survives_kv_exhaustion,
    "unsupported_model_rejected": unsupported_model_rejected,
    "abort_is_idempotent": abort_is_idempotent,
    "deadline_enforced": deadline_enforced,
    "same_seed_same_tokens": same_seed_same_tokens,
}

__all__ = ["ALL_CHECKS", "CheckFailed", "CheckFn", "CheckSkipped", "Harness"]
