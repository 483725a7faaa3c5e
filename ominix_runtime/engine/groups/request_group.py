"""Forwarding path for a request-level backend (e.g. SGLang): the backend batches and owns its KV.

The engine keeps admission (priority classes, FCFS inside a class, at most ``max_running_requests`` sent to
the backend at once), deadlines, aborts and the event contract towards the client: whatever the backend
does, the client sees at most one terminal event. Contract breaches by the backend (a token before
prefill_done, a second terminal event, a stream that ends without one) are forwarded as they are where
harmless, counted as protocol violations and logged, so the conformance suite can report them. The
backend's load report and health are polled every LOAD_POLL_INTERVAL_S: while its health check fails (or
does not answer), the group is unhealthy and sends nothing new to it.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from ominix_runtime.contract import (
    BackendAdapter,
    BackendCapability,
    Done,
    Error,
    FinishReason,
    GenerateRequest,
    Granularity,
    InvalidArgument,
    OminixError,
    PrefillDone,
    RequestBackend,
    RequestLimits,
    RuntimeErrorKind,
    Token,
    Usage,
    WorkerEvent,
    is_terminal,
    validate_request,
)
from ominix_runtime.engine.config import EngineCoreConfig
from ominix_runtime.engine.groups.worker_group import ErrorInfo, GroupHooks, RequestTimes, WorkerGroup
from ominix_runtime.engine.logs import log_event
from ominix_runtime.engine.scheduler import arrival_on_clock
from ominix_runtime.engine.stats import LoadSnapshot

# How long a backend stream may keep talking after its terminal event before the engine stops listening.
_AFTER_TERMINAL_GRACE = 1.0
# How often the backend's own load report (KV use, throughput) is refreshed for GetLoad, and its health
# checked.
LOAD_POLL_INTERVAL_S = 1.0
# How long one health check may take: a backend that does not answer by then has failed that check (a hung
# server must not keep its group routable, nor stall the poller).
HEALTH_TIMEOUT_S = 5.0
# Failed checks in a row that take the group down; one passing check brings it back. A server's health route
# may run a real generation, so under load one slow answer is no outage.
HEALTH_FAILURES_TO_DOWN = 3


@dataclass(slots=True)
class _Forwarded:
    request: GenerateRequest
    seq: int
    queued_time: float
    started_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    token_gaps: list[float] = field(default_factory=list)
    prefill_seen: bool = False
    terminal_sent: bool = False
    num_output_tokens: int = 0
    cached_tokens: int = 0
    # The prompt's token count: its token ids, or, for a prompt forwarded as text, what the backend counted
    # (PrefillDone / Usage), which is then the only count there is.
    prompt_tokens: int = 0
    task: asyncio.Task[None] | None = None


class RequestWorkerGroup(WorkerGroup):
    """Forwards whole requests to one RequestBackend, at most ``max_running_requests`` at once."""

    granularity = Granularity.REQUEST

    def __init__(
        self,
        backend: RequestBackend,
        capability: BackendCapability,
        config: EngineCoreConfig,
        hooks: GroupHooks,
    ) -> None:
        super().__init__(capability, config, hooks)
        self.backend = backend
        limit = config.scheduler.max_running_requests or capability.max_running_requests
        self.max_running_requests = max(1, min(limit, capability.max_running_requests))
        self._queue: list[tuple[int, int, str]] = []  # (priority, seq, request id) heap
        self._live: dict[str, _Forwarded] = {}
        self._num_running = 0
        # Live requests not yet forwarded, and their prompt tokens: counted, as admission reads them per request.
        self._num_queued = 0
        self._queued_tokens = 0
        self._seq = 0
        self.backend_load: dict[str, float] = {}  # the backend's latest own report (RequestBackend.load)
        self._poller: asyncio.Task[None] | None = None
        self._failed_health_checks = 0  # in a row

    @classmethod
    def create(
        cls,
        backend: BackendAdapter,
        capability: BackendCapability,
        config: EngineCoreConfig,
        hooks: GroupHooks,
    ) -> RequestWorkerGroup:
        if not isinstance(backend, RequestBackend):
            raise OminixError(
                RuntimeErrorKind.CAPABILITY_MISMATCH,
                f"backend {capability.worker_id} states request granularity but cannot take whole requests",
            )
        return cls(backend, capability, config, hooks)

    # ---- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.running = True
        await self._poll_once()
        self._poller = asyncio.create_task(self._poll(), name=f"ominix-load-{self.worker_id}")

    async def _poll_once(self) -> None:
        await asyncio.gather(self._poll_health(), self._poll_load_once())

    async def _poll_load_once(self) -> None:
        try:
            self.backend_load = dict(await self.backend.load())
        except Exception as exc:  # noqa: BLE001 - a missing report leaves the engine's own counts
            log_event("debug", "backend_load_failed", worker_id=self.worker_id, error=str(exc))

    async def _poll_health(self) -> None:
        """Set the group's health from the backend's: after HEALTH_FAILURES_TO_DOWN failed checks in a row it
        gets no new requests (routing, and the queued ones wait) and reads as down in GetLoad and
        ominix_worker_up, until a check passes again."""
        try:
            healthy = bool(await asyncio.wait_for(self.backend.health(), HEALTH_TIMEOUT_S))
            problem = "" if healthy else "the backend says it is not healthy"
        except asyncio.TimeoutError:
            healthy, problem = False, f"no health answer within {HEALTH_TIMEOUT_S:g} s"
        except Exception as exc:  # noqa: BLE001 - a check that cannot reach the backend finds it down
            healthy, problem = False, f"health check failed: {exc!r}"
        self._failed_health_checks = 0 if healthy else self._failed_health_checks + 1
        if not healthy and self._failed_health_checks < HEALTH_FAILURES_TO_DOWN:
            return
        if healthy == self.healthy:
            return
        self.healthy = healthy
        if healthy:
            log_event("info", "backend_healthy_again", worker_id=self.worker_id)
            if self.running:
                self._pump()  # what queued while it was down goes out now
        else:
            log_event("warning", "backend_unhealthy", worker_id=self.worker_id, reason=problem)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(LOAD_POLL_INTERVAL_S)
            await self._poll_once()

    async def stop(self) -> None:
        self.running = False
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        tasks = [f.task for f in self._live.values() if f.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- requests -------------------------------------------------------------------------------------

    def validate(self, request: GenerateRequest) -> None:
        model = self.capability.model
        validate_request(
            request,
            RequestLimits(
                vocab_size=model.vocab_size if model.vocab_size > 0 else None,
                max_model_len=model.max_model_len if model.max_model_len > 0 else None,
                # The backend's own pool, as it reports it (SGLang: max_total_num_tokens): a request that can
                # never fit is refused here instead of waiting in the backend's queue forever.
                kv_capacity_tokens=self.capability.kv_capacity_tokens or None,
                holder=f"backend {self.worker_id}",
            ),
        )

    def submit(self, request: GenerateRequest) -> None:
        rid = request.request_id
        try:
            if rid in self._live:
                raise InvalidArgument(f"request id {rid!r} is already in use")
            self.validate(request)
        except OminixError:
            self.counters.rejected += 1
            raise
        self._seq += 1
        self._live[rid] = _Forwarded(
            request,
            self._seq,
            arrival_on_clock(request, time.monotonic()),
            prompt_tokens=len(request.prompt_token_ids),
        )
        self._num_queued += 1
        self._queued_tokens += len(request.prompt_token_ids)
        heapq.heappush(self._queue, (int(request.priority), self._seq, rid))
        self._track_deadline(request)
        self.counters.accepted += 1
        self.counters.prompt_tokens += len(request.prompt_token_ids)
        self._pump()

    def _pump(self) -> None:
        # Nothing goes to a backend whose health check fails: queued requests wait for it (_poll_health pumps
        # once it passes), or for their deadline.
        while self._queue and self._num_running < self.max_running_requests and self.healthy:
            _, _, rid = heapq.heappop(self._queue)
            fwd = self._live.get(rid)
            if fwd is None or fwd.task is not None:
                continue  # ended while queued
            fwd.started_time = time.monotonic()
            self._num_running += 1
            self._leave_queue(fwd)
            fwd.task = asyncio.create_task(self._forward(fwd), name=f"ominix-forward-{rid}")
            # The slot is given back when the task is done, not in the coroutine's own finally: a task
            # cancelled before its first step (an abort in the same turn of the loop) never runs its body.
            fwd.task.add_done_callback(functools.partial(self._forwarding_done, fwd))

    def _forwarding_done(self, fwd: _Forwarded, task: asyncio.Task[None]) -> None:
        """Runs once per forwarding task, however it ended: frees its running slot and fills it."""
        self._num_running -= 1
        self._end(fwd, FinishReason.ERROR, (RuntimeErrorKind.INTERNAL, "forwarding ended unexpectedly"))
        if self.running:
            self._pump()

    def abort(self, request_id: str, reason: FinishReason, error: ErrorInfo | None) -> bool:
        fwd = self._live.get(request_id)
        if fwd is None:
            return False
        self._end(fwd, reason, error)
        if fwd.task is not None and not fwd.task.done():
            fwd.task.cancel()
            asyncio.get_running_loop().create_task(self._backend_abort(request_id))
        return True

    def finish(self, request_id: str, reason: FinishReason, matched_stop: str) -> bool:
        fwd = self._live.get(request_id)
        if fwd is None:
            return False
        self._end(fwd, reason, None, matched_stop)
        if fwd.task is not None and not fwd.task.done():
            fwd.task.cancel()
            asyncio.get_running_loop().create_task(self._backend_abort(request_id))
        return True

    async def _backend_abort(self, request_id: str) -> None:
        try:
            await self.backend.abort(request_id)
        except Exception as exc:  # noqa: BLE001 - best effort; the client already got its terminal event
            log_event(
                "warning",
                "backend_abort_failed",
                worker_id=self.worker_id,
                request_id=request_id,
                error=str(exc),
            )

    def live_request(self, request_id: str) -> GenerateRequest | None:
        fwd = self._live.get(request_id)
        return fwd.request if fwd is not None else None

    def _leave_queue(self, fwd: _Forwarded) -> None:
        self._num_queued -= 1
        self._queued_tokens -= len(fwd.request.prompt_token_ids)

    @property
    def num_queued(self) -> int:
        return self._num_queued

    @property
    def num_running(self) -> int:
        return len(self._live) - self._num_queued

    @property
    def num_waiting_tokens(self) -> int:
        return self._queued_tokens

    async def flush_prefix_cache(self) -> bool:
        """The backend's own cache, when it offers a flush (SGLang's /flush_cache; refused while busy)."""
        flush = getattr(self.backend, "flush_cache", None)
        return bool(await flush()) if flush is not None else False

    def kv_bytes(self) -> tuple[int, int]:
        """The backend's own KV as it last reported it (polled every LOAD_POLL_INTERVAL_S): SGLang states its
        pool, so its figures are real ones, not a capacity of 0 that a router reads as full."""
        reported = self.backend_load
        capacity = int(reported.get("kv_bytes_capacity", 0)) or self.capability.kv_bytes_capacity
        used = int(reported.get("kv_bytes_used", 0))
        return (min(used, capacity) if capacity else used), capacity

    def load(self) -> LoadSnapshot:
        """Queue figures are the engine's own, except that forwarded requests the backend still queues count
        as queued; the decode rate is the backend's own when it reports one."""
        base = super().load()
        backend_queued = min(int(self.backend_load.get("queued_requests", 0)), base.running_requests)
        rate = self.backend_load.get("decode_tokens_per_second") or base.estimated_decode_tokens_per_second
        return replace(
            base,
            queued_requests=base.queued_requests + backend_queued,
            running_requests=base.running_requests - backend_queued,
            estimated_decode_tokens_per_second=float(rate),
        )

    # ---- forwarding -----------------------------------------------------------------------------------

    def _violation(self, fwd: _Forwarded, message: str) -> None:
        text = f"backend {self.worker_id}, request {fwd.request.request_id}: {message}"
        self.num_protocol_violations += 1
        self.protocol_violations.append(text)
        log_event("warning", "backend_protocol_violation", worker_id=self.worker_id, detail=text)

    async def _forward(self, fwd: _Forwarded) -> None:
        rid = fwd.request.request_id
        backend_terminal = False
        try:
            iterator: AsyncIterator[WorkerEvent] = self.backend.generate(fwd.request).__aiter__()
            while True:
                try:
                    if backend_terminal:
                        event = await asyncio.wait_for(iterator.__anext__(), _AFTER_TERMINAL_GRACE)
                    else:
                        event = await iterator.__anext__()
                except (StopAsyncIteration, asyncio.TimeoutError):
                    break
                if backend_terminal:
                    kind = "terminal event" if is_terminal(event) else "event"
                    self._violation(
                        fwd, f"sent another {kind} ({type(event).__name__}) after its terminal event"
                    )
                    continue
                if event.request_id != rid:
                    self._violation(fwd, f"sent an event for request {event.request_id!r}")
                    event.request_id = rid
                if isinstance(event, PrefillDone):
                    if fwd.prefill_seen:
                        self._violation(fwd, "sent prefill_done twice")
                        continue
                    fwd.prefill_seen = True
                    fwd.cached_tokens = event.cached_tokens
                    self._backend_prompt_count(fwd, event.prompt_tokens)
                elif isinstance(event, Token):
                    if not fwd.prefill_seen:
                        self._violation(fwd, "sent a token before prefill_done")
                    now = time.monotonic()
                    if fwd.first_token_time is None:
                        fwd.first_token_time = now
                    if fwd.last_token_time is not None:
                        fwd.token_gaps.append(now - fwd.last_token_time)
                    fwd.last_token_time = now
                    fwd.num_output_tokens += len(event.token_ids)
                    self.counters.generated_tokens += len(event.token_ids)
                if is_terminal(event):
                    backend_terminal = True
                    if isinstance(event, Done):
                        self._end(fwd, event.finish_reason, None, event.matched_stop, text=event.text)
                    else:
                        self._end(fwd, FinishReason.ERROR, (event.kind, event.message))
                    continue
                if isinstance(event, Usage):
                    fwd.cached_tokens = event.cached_tokens
                    self._backend_prompt_count(fwd, event.prompt_tokens)
                    continue  # the engine sends its own Usage right before the terminal event
                if not fwd.terminal_sent:
                    self.hooks.deliver([event])
            if not backend_terminal:
                self._violation(fwd, "ended its stream without a terminal event")
                self._end(
                    fwd,
                    FinishReason.ERROR,
                    (RuntimeErrorKind.BACKEND_UNAVAILABLE, "backend stream ended early"),
                )
        except asyncio.CancelledError:
            pass  # aborted or stopping: the terminal event was already sent by whoever cancelled
        except Exception as exc:  # noqa: BLE001 - a backend failure ends this request, not the engine
            self._end(
                fwd, FinishReason.ERROR, (RuntimeErrorKind.BACKEND_UNAVAILABLE, f"backend failed: {exc}")
            )
        # The running slot and a request left without a terminal event are settled by _forwarding_done.

    def _backend_prompt_count(self, fwd: _Forwarded, prompt_tokens: int) -> None:
        """Take the backend's prompt token count for a request forwarded without token ids (text only)."""
        if fwd.request.prompt_token_ids or prompt_tokens <= 0 or prompt_tokens == fwd.prompt_tokens:
            return
        self.counters.prompt_tokens += prompt_tokens - fwd.prompt_tokens
        fwd.prompt_tokens = prompt_tokens

    def _end(
        self,
        fwd: _Forwarded,
        reason: FinishReason,
        error: ErrorInfo | None,
        matched_stop: str = "",
        text: str = "",
    ) -> None:
        """Send Usage + the terminal event once; later calls do nothing."""
        if fwd.terminal_sent:
            return
        fwd.terminal_sent = True
        rid = fwd.request.request_id
        self._live.pop(rid, None)
        if fwd.task is None:  # ended while queued
            self._leave_queue(fwd)
        c = self.counters
        usage = Usage(rid, fwd.prompt_tokens, fwd.num_output_tokens, fwd.cached_tokens)
        terminal: WorkerEvent
        if error is not None:
            terminal = Error(rid, error[0], error[1])
            if error[0] == RuntimeErrorKind.CANCELLED:  # a passed deadline counts as failed
                reason = FinishReason.ABORT
                c.aborted += 1
            else:
                reason = FinishReason.ERROR
                c.failed += 1
        else:
            terminal = Done(rid, reason, text=text, matched_stop=matched_stop)
            if reason == FinishReason.ABORT:
                c.aborted += 1
            else:
                c.finished += 1
        c.cached_tokens += fwd.cached_tokens
        self.hooks.deliver([usage, terminal])
        now = time.monotonic()
        if fwd.first_token_time is not None:
            self._observe_decode_rate(fwd.num_output_tokens - 1, now - fwd.first_token_time)
        self._report_run(
            fwd.request,
            reason,
            error[0] if error else None,
            output_tokens=fwd.num_output_tokens,
            cached_tokens=fwd.cached_tokens,
            num_prompt_tokens=fwd.prompt_tokens,
            times=RequestTimes(
                queued=fwd.queued_time,
                finished=now,
                started=fwd.started_time,
                first_token=fwd.first_token_time,
            ),
            inter_token_latencies=fwd.token_gaps,
        )
