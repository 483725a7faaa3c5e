"""EngineCore: the asyncio engine that owns one worker group per backend and the per-request streams."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from ominix_runtime.contract import (
    BackendAdapter,
    BackendCapability,
    BackendHealth,
    Error,
    FinishReason,
    GenerateRequest,
    InvalidArgument,
    OminixError,
    RuntimeErrorKind,
    Token,
    Usage,
    WorkerEvent,
    is_terminal,
)
from ominix_runtime.engine.config import EngineCoreConfig
from ominix_runtime.engine.groups import GroupHooks, WorkerGroup, build_group
from ominix_runtime.engine.logs import log_event
from ominix_runtime.engine.negotiation import ServingTerms, negotiate
from ominix_runtime.engine.request import EngineRequest
from ominix_runtime.engine.stats import EngineStats, LoadSnapshot, RunReport, StepReport

# How long a run report waits for the front end's verdict (``EngineCore.settle``) before the engine's own stands.
_VERDICT_WAIT_S = 5.0

# Routing: groups whose load (queued + running requests) is within this many requests of the least loaded
# one compete on prefix-cache affinity; beyond it, load wins.
_AFFINITY_LOAD_SLACK = 4


# Readers woken per turn of the event loop (ReaderWaker): small, so that a driver's next turn (taking a
# worker's result, sending the next step) never waits behind the stream writes of a whole step.
_WAKE_SLICE = 8


class ReaderWaker:
    """Wakes the readers of request inboxes ``_WAKE_SLICE`` at a time, one slice per turn of the event loop.

    Waking every reader of a step at once queued hundreds of stream writes ahead of the drivers' next turns:
    each worker result then waited behind the streaming of the step before it, and with a loaded loop the
    streaming set the step time. Sliced, a driver waits a slice per turn at most; readers still woken in
    arrival order, and one not yet woken when its request's next token arrives takes both (RequestHandle
    sends them as one message). Outside a running loop (no driver then) a reader is woken at once.
    """

    __slots__ = ("_ready", "_scheduled_on")

    def __init__(self) -> None:
        self._ready: deque[EventInbox] = deque()
        # The loop a wake-up turn is pending on; None when none is. Compared, not just set: a turn pending on
        # a loop that has since ended never runs.
        self._scheduled_on: asyncio.AbstractEventLoop | None = None

    def schedule(self, inbox: EventInbox) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            inbox.wake()
            return
        self._ready.append(inbox)
        if self._scheduled_on is not loop:
            self._scheduled_on = loop
            loop.call_soon(self._wake_slice)

    def _wake_slice(self) -> None:
        ready = self._ready
        for _ in range(min(_WAKE_SLICE, len(ready))):
            ready.popleft().wake()
        if ready:
            asyncio.get_running_loop().call_soon(self._wake_slice)
        else:
            self._scheduled_on = None


class EventSink(Protocol):
    """Where the engine puts one request's events: an EventInbox its reader takes them from, or a front
    process's link (server/front_hub.py), which batches the events of every request of that front."""

    def put(self, event: WorkerEvent) -> None: ...


class RequestAborter(Protocol):
    """What a RequestHandle aborts its request through (the EngineCore, or a front's link to it)."""

    def abort(self, request_id: str) -> bool: ...


class EventInbox:
    """One request's undelivered events. Cheaper than an asyncio.Queue: ``put`` appends and wakes the reader
    at most once (through ``waker`` when given, else at once), and the reader takes everything that has
    arrived in one go."""

    __slots__ = ("_events", "_waiter", "_waker", "_wake_pending")

    def __init__(self, waker: ReaderWaker | None = None) -> None:
        self._events: deque[WorkerEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._waker = waker
        self._wake_pending = False

    def put(self, event: WorkerEvent) -> None:
        self._events.append(event)
        if self._waiter is None or self._wake_pending:
            return
        if self._waker is None:
            self.wake()
        else:
            self._wake_pending = True
            self._waker.schedule(self)

    def wake(self) -> None:
        self._wake_pending = False
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[WorkerEvent]:
        """Every event that has arrived, waiting for the first one."""
        while not self._events:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events = list(self._events)
        self._events.clear()
        return events


def _coalesce(events: list[WorkerEvent]) -> list[WorkerEvent]:
    """Consecutive Token events as one (ids, logprobs and text in order; the later event says whether the last
    id ended the request on a stop token): a reader that fell behind catches up with one message per request
    instead of one per step. Logprobs are per token, so two events with logprobs merge only when each has one
    per token id: a backend may send a chunk without them (SGLang, when one entry is unreadable), and joined
    lists would then pair logprobs with the wrong tokens."""
    out: list[WorkerEvent] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, Token) and isinstance(last, Token):
            if (last.logprobs or event.logprobs) and (
                len(last.logprobs) != len(last.token_ids) or len(event.logprobs) != len(event.token_ids)
            ):
                out.append(event)  # each keeps its own alignment
                continue
            out[-1] = Token(
                last.request_id,
                last.token_ids + event.token_ids,
                last.logprobs + event.logprobs,
                last.text + event.text,
                event.ended_by_stop_token,  # the later event's: its last token is the joined one's
            )
        else:
            out.append(event)
    return out


class RequestHandle:
    """Async iterator of one request's WorkerEvents, in order; ends after the terminal event.

    With ``coalesce`` (a request without stop strings, so no token is ever cut after a match), tokens that
    queued up while the reader was busy come as one Token event.
    """

    def __init__(
        self,
        request_id: str,
        inbox: EventInbox,
        core: RequestAborter,
        coalesce: bool = False,
        admission: asyncio.Future[None] | None = None,
    ) -> None:
        self.request_id = request_id
        self._inbox = inbox
        self._core = core
        self._coalesce = coalesce
        self._ended = False
        self._admission = admission

    async def admitted(self) -> None:
        """Return once the engine has taken the request; raise its OminixError when it refused it. At once
        for a handle of an in-process engine (submit raised already); a front process waits for the
        engine process's answer."""
        if self._admission is not None:
            await self._admission

    def __aiter__(self) -> AsyncIterator[WorkerEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[WorkerEvent]:
        while events := await self.next_events():
            for event in events:
                yield event

    async def next_events(self) -> list[WorkerEvent]:
        """The events that have arrived (waiting for the first), in order, up to the terminal one; [] once
        the terminal event was taken. A stream front loops over these instead of iterating the handle: one
        async-generator layer less for every token of every request."""
        if self._ended:
            return []
        events = await self._inbox.take()
        if self._coalesce and len(events) > 1:
            events = _coalesce(events)
        for i, event in enumerate(events):
            if is_terminal(event):
                self._ended = True
                return events[: i + 1]
        return events

    def abort(self) -> None:
        """Abort the request (e.g. the client went away); frees its KV at once."""
        self._core.abort(self.request_id)


@dataclass(slots=True)
class _LiveRequest:
    inbox: EventSink
    group: WorkerGroup


class EngineCore:
    """Owns one worker group per backend: routing, admission, streams, stats, reports.

    Public API (used by the front server)::

        core = EngineCore(backends, EngineCoreConfig())
        await core.start(terms)     # describe backends, negotiate, build groups, start drivers
        handle = core.submit(req)   # validate + route; raises OminixError on rejection
        async for event in handle:  # PrefillDone, Token..., Usage, then exactly one Done or Error
            ...
        core.abort(request_id)      # -> bool; terminal event Done(ABORT)
        core.finish(request_id, FinishReason.STOP, matched_stop)  # stop string found by the front end
        core.load()                 # list[LoadSnapshot], one per group
        core.stats()                # EngineStats
        core.capabilities()         # list[BackendCapability]
        core.ready                  # every backend described and its driver running
        core.add_listener(cb)       # cb(RunReport) once per finished request
        core.add_step_listener(cb)  # cb(worker_id, StepReport) once per step
        await core.stop(drain_timeout)  # stop accepting; drain; end the rest with Error; close backends

    Every accepted request ends with exactly one terminal event, whatever happens: deadline → Error(TIMEOUT),
    stop → Error(BACKEND_UNAVAILABLE). When a step-level worker fails, its requests resume on another healthy
    group of the same model (from prompt + tokens already streamed, same seed); only those no group can take
    end with Error(BACKEND_UNAVAILABLE). The failed group gets no new requests until its driver reconnects.
    ``ready`` holds while at least one group serves. Must be used from one event loop; submit/abort/finish
    are synchronous.
    """

    def __init__(self, backends: Sequence[BackendAdapter], config: EngineCoreConfig | None = None) -> None:
        if not backends:
            raise ValueError("EngineCore needs at least one backend")
        self.config = config or EngineCoreConfig()
        self._backends = list(backends)
        self._groups: list[WorkerGroup] = []
        self._live: dict[str, _LiveRequest] = {}
        self._listeners: list[Callable[[RunReport], None]] = []
        self._step_listeners: list[Callable[[str, StepReport], None]] = []
        self._accepting = False
        self._started = False
        self._stopped = False
        self._rejected = 0
        self._all_done = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None
        self._draining: set[str] = set()  # worker ids that take no new requests (Drain)
        self._waker = ReaderWaker()
        # Requests with stop strings not yet reported. Their last token may complete a stop string, which only
        # the front end sees (it detokenizes): when the engine ended one on its length, its run report waits
        # for the front's verdict (``settle``), so that the log and the metrics name the reason its client got.
        self._stop_string_ids: set[str] = set()
        self._unsettled: dict[str, tuple[RunReport, asyncio.TimerHandle]] = {}

    # ---- lifecycle ------------------------------------------------------------------------------------

    async def start(self, terms: ServingTerms | None = None) -> None:
        """Describe every backend, negotiate (CAPABILITY_MISMATCH on ``terms``), then start the groups."""
        if self._started:
            return
        caps = await asyncio.gather(*(b.describe() for b in self._backends))
        negotiate(caps, terms)  # before any group opens a stream to its backend
        hooks = GroupHooks(
            deliver=self._deliver, report=self._on_report, step_report=self._on_step, evacuate=self._evacuate
        )
        self._groups = [
            build_group(backend, cap, self.config, hooks)
            for backend, cap in zip(self._backends, caps, strict=True)
        ]
        try:
            await asyncio.gather(*(g.start() for g in self._groups))
        except BaseException:
            await asyncio.gather(*(g.stop() for g in self._groups), return_exceptions=True)
            raise
        self._sweeper = asyncio.create_task(self._sweep_deadlines(), name="ominix-deadlines")
        self._started = True
        self._accepting = True
        log_event("info", "engine_started", workers=[g.worker_id for g in self._groups])

    async def stop(self, drain_timeout: float = 0.0) -> None:
        if self._stopped:
            return
        self._accepting = False
        if self._live and drain_timeout > 0:
            self._all_done.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._all_done.wait(), drain_timeout)
        for rid in list(self._live):
            live = self._live.get(rid)
            if live is not None:
                live.group.abort(
                    rid,
                    FinishReason.ERROR,
                    (RuntimeErrorKind.BACKEND_UNAVAILABLE, "the engine is shutting down"),
                )
        for rid, live in list(self._live.items()):  # a group that could not end it (already broken)
            self._deliver_terminal_fallback(rid, live)
        for rid in list(self._unsettled):  # no front will settle them now: the engine's verdict stands
            self.settle(rid, "")
        self._stop_string_ids.clear()
        self._stopped = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        await asyncio.gather(*(g.stop() for g in self._groups), return_exceptions=True)
        for b in self._backends:
            try:
                await b.close()
            except Exception as exc:  # noqa: BLE001 - closing is best effort
                log_event("warning", "backend_close_failed", error=str(exc))
        log_event("info", "engine_stopped")

    def _deliver_terminal_fallback(self, rid: str, live: _LiveRequest) -> None:
        self._deliver(
            [
                Usage(rid, 0, 0),
                Error(rid, RuntimeErrorKind.BACKEND_UNAVAILABLE, "the engine is shutting down"),
            ]
        )

    @property
    def ready(self) -> bool:
        """Started, not stopping, and at least one worker group serving new requests: one not drained either
        (with every group drained each new request is refused, so health says NOT_SERVING and a router sends
        them elsewhere)."""
        return (
            self._started
            and self._accepting
            and any(g.running and g.healthy and g.worker_id not in self._draining for g in self._groups)
        )

    # ---- requests -------------------------------------------------------------------------------------

    def submit(self, request: GenerateRequest, sink: EventSink | None = None) -> RequestHandle:
        """Validate and route ``request``; raise OminixError when it is rejected. Its events go to ``sink``
        when given (a front process's link; the handle then only aborts), else to the handle."""
        if not self._accepting:
            self._rejected += 1
            state = "shutting down" if self._started else "not started"
            raise OminixError(RuntimeErrorKind.BACKEND_UNAVAILABLE, f"the engine is {state}")
        if request.request_id in self._live:
            self._rejected += 1
            raise InvalidArgument(f"request id {request.request_id!r} is already in use")
        limit = self.config.max_waiting_requests
        # Counts, not load(): a load snapshot walks the waiting queue, once per request of a burst.
        if limit and sum(g.num_queued for g in self._groups) >= limit:
            self._rejected += 1
            raise OminixError(
                RuntimeErrorKind.ADMISSION_REJECTED, f"too many queued requests (limit {limit})"
            )
        group = self._route(request)
        group.submit(request)  # raises OminixError on rejection (counted by the group)
        inbox = EventInbox(self._waker)
        self._live[request.request_id] = _LiveRequest(sink or inbox, group)
        if request.sampling.stop:
            self._stop_string_ids.add(request.request_id)
        else:  # an earlier request of this id may have ended without a report (a broken group's fallback)
            self._stop_string_ids.discard(request.request_id)
        return RequestHandle(request.request_id, inbox, self, coalesce=not request.sampling.stop)

    def _route(self, request: GenerateRequest) -> WorkerGroup:
        if request.model and not any(g.capability.model.name == request.model for g in self._groups):
            self._rejected += 1
            served = ", ".join(sorted({repr(g.capability.model.name) for g in self._groups}))
            raise OminixError(
                RuntimeErrorKind.CAPABILITY_MISMATCH,
                f"no backend serves model {request.model!r} (served: {served})",
            )
        groups = [g for g in self._groups if g.healthy and g.running and g.worker_id not in self._draining]
        if request.model:
            groups = [g for g in groups if g.capability.model.name == request.model]
        if not groups:
            self._rejected += 1
            draining = " (draining)" if self._draining else ""
            raise OminixError(RuntimeErrorKind.BACKEND_UNAVAILABLE, f"no healthy backend{draining}")
        if len(groups) == 1:
            return groups[0]
        loads = {g.worker_id: g.num_queued + g.num_running for g in groups}
        least = min(loads.values())
        close = [g for g in groups if loads[g.worker_id] <= least + _AFFINITY_LOAD_SLACK]
        return max(close, key=lambda g: (g.prefix_hit_tokens(request), -loads[g.worker_id]))

    def _evacuate(self, failed: WorkerGroup, requests: list[EngineRequest]) -> list[EngineRequest]:
        """Resume a failed group's requests on healthy groups of the same model, the least loaded first and
        drained ones last; returns the ones left over.

        Requests that streamed nothing are simply recomputed; the others continue from prompt + the tokens
        already sent, with the same effective seed (the worker seeds by output position).
        """
        left: list[EngineRequest] = []
        for req in requests:
            rid = req.request_id
            live = self._live.get(rid)
            if live is None:
                continue
            targets = [
                g
                for g in self._groups
                if g.resumes_requests
                and g is not failed
                and g.healthy
                and g.running
                and g.capability.model.name == failed.capability.model.name
            ]
            # A drained group (Drain) takes a failed group's requests only when no other can: its operator
            # is emptying it.
            targets.sort(key=lambda g: (g.worker_id in self._draining, g.num_queued + g.num_running))
            for target in targets:
                try:
                    target.adopt(req)
                except OminixError as exc:
                    log_event(
                        "warning",
                        "resume_refused",
                        request_id=rid,
                        worker_id=target.worker_id,
                        error=exc.message,
                    )
                    continue
                live.group = target
                log_event(
                    "info",
                    "request_resumed",
                    request_id=rid,
                    from_worker=failed.worker_id,
                    to_worker=target.worker_id,
                    output_tokens=req.num_output_tokens,
                )
                break
            else:
                left.append(req)
        return left

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        live = self._live.get(request_id)
        if live is None:
            return False
        return live.group.abort(request_id, reason, None)

    def holds(self, request_id: str) -> bool:
        """Whether a request of this id has not delivered its terminal event yet."""
        return request_id in self._live

    def finish(
        self, request_id: str, reason: FinishReason = FinishReason.STOP, matched_stop: str = ""
    ) -> bool:
        live = self._live.get(request_id)
        if live is None:
            return False
        return live.group.finish(request_id, reason, matched_stop)

    def settle(self, request_id: str, matched_stop: str) -> bool:
        """The front end's verdict on a request with stop strings that the engine ended on its length:
        ``matched_stop`` when its last tokens completed a stop string (its client was told STOP), else "" (the
        LENGTH stands). Publishes the held run report; False when none is held for the id (never touches a live
        request, which may already reuse the id)."""
        held = self._unsettled.pop(request_id, None)
        if held is None:
            return False
        report, timer = held
        timer.cancel()
        if matched_stop:
            report = replace(report, finish_reason=FinishReason.STOP)
        self._publish(report)
        return True

    # ---- event plumbing -------------------------------------------------------------------------------

    def _deliver(self, events: list[WorkerEvent]) -> None:
        for event in events:
            live = self._live.get(event.request_id)
            if live is None:
                continue
            live.inbox.put(event)
            if is_terminal(event):
                del self._live[event.request_id]
        if not self._live:
            self._all_done.set()

    def _on_report(self, report: RunReport) -> None:
        rid = report.request_id
        if rid in self._stop_string_ids:
            self._stop_string_ids.discard(rid)
            if report.finish_reason == FinishReason.LENGTH and not self._stopped:
                # Published by ``settle``, or with the engine's verdict if no front settles it in time (its
                # client left before the end, or its front process died). An earlier request of the same id
                # still held had its whole successor's life to be settled: its verdict stands now.
                self.settle(rid, "")
                timer = asyncio.get_running_loop().call_later(_VERDICT_WAIT_S, self.settle, rid, "")
                self._unsettled[rid] = (report, timer)
                return
        self._publish(report)

    def _publish(self, report: RunReport) -> None:
        for cb in self._listeners:
            try:
                cb(report)
            except Exception as exc:  # noqa: BLE001 - a listener must not break the engine
                log_event("warning", "run_report_listener_failed", error=str(exc))

    def _on_step(self, worker_id: str, report: StepReport) -> None:
        for cb in self._step_listeners:
            try:
                cb(worker_id, report)
            except Exception as exc:  # noqa: BLE001 - a listener must not break the engine
                log_event("warning", "step_listener_failed", error=str(exc))

    def add_listener(self, cb: Callable[[RunReport], None]) -> None:
        self._listeners.append(cb)

    def add_step_listener(self, cb: Callable[[str, StepReport], None]) -> None:
        self._step_listeners.append(cb)

    async def _sweep_deadlines(self) -> None:
        """The one place deadlines are expired: every group's heap, every ``deadline_check_interval``."""
        interval = self.config.deadline_check_interval
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for g in self._groups:
                g.expire(now)

    # ---- introspection --------------------------------------------------------------------------------

    @property
    def groups(self) -> list[WorkerGroup]:
        return list(self._groups)

    def load(self) -> list[LoadSnapshot]:
        """One snapshot per group, with its lifecycle state, identity and the wall-clock time."""
        now_ms = int(time.time() * 1000)
        return [
            replace(
                g.load(),
                health=self.health_of(g),
                timestamp_ms=now_ms,
                model_ids=(g.capability.model.name,),
                capabilities=tuple(g.capability.capability_strings()),
                backend_kind=g.capability.kind.contract_name,
            )
            for g in self._groups
        ]

    def health_of(self, group: WorkerGroup) -> BackendHealth:
        if self._stopped:
            return BackendHealth.OFFLINE
        if not self._started or (not group.running and group.healthy):
            return BackendHealth.STARTING
        if not group.healthy or not group.running:
            return BackendHealth.UNHEALTHY
        if not self._accepting or group.worker_id in self._draining:
            return BackendHealth.DRAINING
        return BackendHealth.AVAILABLE

    # ---- operations -----------------------------------------------------------------------------------

    def drain(self, worker_id: str = "", draining: bool = True) -> list[str]:
        """Stop (or, with ``draining=False``, resume) routing new requests to one group or, for ``""``, all;
        live requests carry on. Returns the worker ids changed; raises InvalidArgument for an unknown id."""
        ids = [g.worker_id for g in self._groups if not worker_id or g.worker_id == worker_id]
        if not ids:
            raise InvalidArgument(f"no backend has worker id {worker_id!r}")
        for wid in ids:
            if draining:
                self._draining.add(wid)
            else:
                self._draining.discard(wid)
        log_event("info", "drain" if draining else "undrain", workers=ids)
        return ids

    async def flush_cache(self) -> dict[str, bool]:
        """Drop every prefix cache (the engine's block index of step-level groups, a request-level backend's
        own cache). Per worker id: whether that cache was dropped."""
        out: dict[str, bool] = {}
        for g in self._groups:
            try:
                out[g.worker_id] = await g.flush_prefix_cache()
            except Exception as exc:  # noqa: BLE001 - one backend refusing must not hide the others
                log_event("warning", "flush_cache_failed", worker_id=g.worker_id, error=str(exc))
                out[g.worker_id] = False
        log_event("info", "flush_cache", workers=out)
        return out

    def capabilities(self) -> list[BackendCapability]:
        return [g.capability for g in self._groups]

    def check_integrity(self) -> None:
        """Engine-side invariants of every group, e.g. registry and scheduler (raises AssertionError)."""
        for g in self._groups:
            g.check_integrity()

    def stats(self) -> EngineStats:
        fields = dict.fromkeys(
            (
                "accepted",
                "finished",
                "aborted",
                "failed",
                "rejected",
                "prompt_tokens",
                "generated_tokens",
                "cached_tokens",
                "preemptions",
                "steps",
                "discarded_outputs",
            ),
            0,
        )
        used = total = 0
        query_tokens = hit_tokens = 0
        checks = violations = protocol = running = queued = 0
        durations: list[float] = []
        batches: list[int] = []
        recent_protocol: list[str] = []
        for g in self._groups:
            c = g.counters
            for name in fields:
                fields[name] += getattr(c, name)
            u, t = g.kv_blocks
            used += u
            total += t
            kv = g.kv_snapshot()
            if kv is not None:
                query_tokens += kv.prefix_query_tokens
                hit_tokens += kv.prefix_hit_tokens
            protocol += g.num_protocol_violations
            recent_protocol += list(g.protocol_violations)
            checks += g.integrity_checks
            violations += g.integrity_violations
            load = g.load()
            running += load.running_requests
            queued += load.queued_requests
            durations += list(g.recent_step_durations)
            batches += list(g.recent_batch_sizes)
        fields["rejected"] += self._rejected
        return EngineStats(
            **fields,
            kv_blocks_used=used,
            kv_blocks_total=total,
            prefix_cache_hit_ratio=hit_tokens / query_tokens if query_tokens else 0.0,
            integrity_checks=checks,
            integrity_violations=violations,
            protocol_violations=protocol,
            running_requests=running,
            queued_requests=queued,
            recent_step_durations=durations[-self.config.recent_window :],
            recent_batch_sizes=batches[-self.config.recent_window :],
            recent_protocol_violations=recent_protocol,
        )
