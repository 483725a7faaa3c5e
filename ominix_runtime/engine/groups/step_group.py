"""The step-level worker group: scheduler + KV registry + one ordered worker stream, and the task driving it.

The loop keeps up to ``max_inflight_steps`` steps in flight (default 3: step N+1 is sent once step N-2's
result is back, so a pipelined worker has it a whole device step before it is due; the scheduler's
placeholders make that safe), and at most ``LIGHT_LOAD_INFLIGHT_STEPS`` (2) while fewer than
``light_load_below_running`` requests run and none waits, so a request that arrives joins a step one device
step sooner.
A cheap registry integrity check runs now and then while idle; deadlines are the base class's (the
engine core sweeps them).

Failure: a broken stream, a missed heartbeat or a step past ``step_timeout`` marks the group unhealthy. Its
live requests are handed to the engine (``evacuate``), which resumes them on another worker group from
prompt + the tokens already streamed, or ends them with Error(BACKEND_UNAVAILABLE). The group's registry is
dropped with its scheduler; the driver then polls the worker with backoff and, once it answers Describe
again with the same model, starts over with a fresh scheduler (the worker's KV is gone too).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Literal

from ominix_runtime.contract import (
    BackendAdapter,
    BackendCapability,
    DecodeStep,
    Error,
    FinishReason,
    GenerateRequest,
    Granularity,
    OminixError,
    RequestState,
    RuntimeErrorKind,
    StepBackend,
    StepResult,
    StepStream,
    Token,
    Usage,
    WorkerEvent,
)
from ominix_runtime.engine.config import EngineCoreConfig
from ominix_runtime.engine.groups.worker_group import ErrorInfo, GroupHooks, RequestTimes, WorkerGroup
from ominix_runtime.engine.kv_registry import RegistrySnapshot
from ominix_runtime.engine.logs import log_event
from ominix_runtime.engine.request import EngineRequest
from ominix_runtime.engine.scheduler import Scheduler
from ominix_runtime.engine.stats import StepReport

# Above this many blocks the idle-time check is the O(1) quiescence check only (a full walk would stall).
_FULL_CHECK_MAX_BLOCKS = 16384


@dataclass(slots=True)
class _Applied:
    """A step whose result the scheduler has taken: what its step report and delivery need."""

    step: DecodeStep
    sent_at: float
    compute_seconds: float
    events: list[WorkerEvent]


class StepWorkerGroup(WorkerGroup):
    """Owns the scheduler of one StepBackend and the task that drives it."""

    granularity = Granularity.STEP
    resumes_requests = True

    def __init__(
        self, backend: StepBackend, capability: BackendCapability, config: EngineCoreConfig, hooks: GroupHooks
    ) -> None:
        super().__init__(capability, config, hooks)
        self.backend = backend
        self.scheduler = Scheduler(capability, config.scheduler, counters=self.counters)
        self._wake = asyncio.Event()
        self._opened = asyncio.Event()
        self._stopping = False
        self._inflight: deque[tuple[DecodeStep, float]] = deque()
        self._stream: StepStream | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_integrity_check = 0.0
        self._last_result_at = 0.0

    @classmethod
    def create(
        cls,
        backend: BackendAdapter,
        capability: BackendCapability,
        config: EngineCoreConfig,
        hooks: GroupHooks,
    ) -> StepWorkerGroup:
        if not isinstance(backend, StepBackend):
            raise OminixError(
                RuntimeErrorKind.CAPABILITY_MISMATCH,
                f"backend {capability.worker_id} states step granularity but cannot open a step stream",
            )
        return cls(backend, capability, config, hooks)

    # ---- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"ominix-driver-{self.worker_id}")
        opened = asyncio.create_task(self._opened.wait())
        done, _ = await asyncio.wait({self._task, opened}, return_when=asyncio.FIRST_COMPLETED)
        if opened not in done:
            opened.cancel()
            self._task.result()  # re-raise the failure to open
            raise OminixError(
                RuntimeErrorKind.BACKEND_UNAVAILABLE, f"worker {self.worker_id} stream did not open"
            )

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            # Failures were already reported by the loop itself.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._stream is not None:
            with contextlib.suppress(Exception):  # closing a broken stream may fail; nothing left to do
                await self._stream.close()
        self.running = False

    # ---- requests -------------------------------------------------------------------------------------

    def submit(self, request: GenerateRequest) -> None:
        self.scheduler.add_request(request)
        self._track_deadline(request)
        self._wake.set()

    def abort(self, request_id: str, reason: FinishReason, error: ErrorInfo | None) -> bool:
        events = self.scheduler.abort_request(request_id, reason, error)
        self._emit(events)
        self._wake.set()
        return bool(events)

    def finish(self, request_id: str, reason: FinishReason, matched_stop: str) -> bool:
        events = self.scheduler.finish_request(request_id, reason, matched_stop)
        self._emit(events)
        self._wake.set()
        return bool(events)

    def live_request(self, request_id: str) -> GenerateRequest | None:
        live = self.scheduler.requests.get(request_id)
        return live.request if live is not None else None

    def prefix_hit_tokens(self, request: GenerateRequest) -> int:
        return self.scheduler.prefix_hit_tokens(request.prompt_token_ids) if self.healthy else 0

    @property
    def num_queued(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting_tokens(self) -> int:
        return self.scheduler.waiting.num_waiting_tokens

    @property
    def kv_blocks(self) -> tuple[int, int]:
        return self.scheduler.registry.num_leased_blocks, self.scheduler.registry.num_blocks

    def kv_bytes(self) -> tuple[int, int]:
        """(used, capacity) KV bytes. A stated layout's block holds only its group's layers, so each group's
        blocks count at their layers' share of ``kv_bytes_per_block`` (every layer's bytes of one block)."""
        layout = self.capability.kv_groups
        if not layout:
            return super().kv_bytes()
        per_block = self.capability.kv_bytes_per_block
        num_layers = sum(len(g.layer_indices) for g in layout)
        used = capacity = 0
        for group, (leased, blocks) in zip(layout, self.scheduler.registry.group_usage(), strict=True):
            group_block = per_block * len(group.layer_indices) // num_layers
            used += leased * group_block
            capacity += blocks * group_block
        return used, capacity

    @property
    def kv_token_capacity(self) -> int:
        return self.scheduler.registry.num_blocks * self.scheduler.registry.block_size

    async def flush_prefix_cache(self) -> bool:
        self.scheduler.registry.reset_prefix_cache()
        return True

    def prefix_cache_tokens(self) -> tuple[int, int]:
        registry = self.scheduler.registry
        return registry.prefix_query_tokens, registry.prefix_hit_tokens

    def kv_snapshot(self) -> RegistrySnapshot:
        return self.scheduler.registry.snapshot()

    @property
    def num_preempted(self) -> int:
        return sum(
            1
            for r in self.scheduler.requests.values()
            if r.state == RequestState.PREEMPTED or (r.state == RequestState.WAITING and r.num_preemptions)
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    # ---- the loop -------------------------------------------------------------------------------------

    def _emit(self, events: list[WorkerEvent]) -> None:
        if events:
            self.hooks.deliver(events)
        finished = self.scheduler.finished
        if finished:
            self.scheduler.finished = []
            for req in finished:
                self._report_finished(req)

    def _report_finished(self, req: EngineRequest) -> None:
        queued = req.queued_time
        self._report_run(
            req.request,
            req.finish_reason or FinishReason.ERROR,
            req.error_kind,
            output_tokens=req.num_output_tokens,
            cached_tokens=req.num_cached_tokens,
            times=RequestTimes(
                queued=queued,
                finished=req.finished_time if req.finished_time is not None else queued,
                started=req.first_scheduled_time,
                first_token=req.first_token_time,
            ),
            num_prompt_tokens=req.num_prompt_tokens,
            num_preemptions=req.num_preemptions,
            inter_token_latencies=req.token_gaps,
        )

    async def _run(self) -> None:
        try:
            self._stream = await self.backend.open()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - start() re-raises it: the engine does not start
            self.healthy = False
            raise exc
        while not self._stopping:
            self.running = True
            self.healthy = True
            self._opened.set()
            try:
                await self._loop(self._stream)
                return
            except asyncio.CancelledError:
                self.running = False
                raise
            except Exception as exc:  # noqa: BLE001 - any failure ends the group's requests, never the engine
                self.running = False
                self._fail(exc)
            if not self.config.reconnect:
                return
            self._stream = await self._reconnect()

    async def _reconnect(self) -> StepStream:
        """Poll the worker with backoff until it describes the same model again; fresh scheduler and stream."""
        stale, self._stream = self._stream, None
        if stale is not None:
            with contextlib.suppress(Exception):  # a dead stream may fail to close; it is dropped anyway
                await asyncio.wait_for(stale.close(), self.config.reconnect_rpc_timeout)
        delay = self.config.reconnect_backoff_initial
        while True:
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.config.reconnect_backoff_max)
            try:
                cap = await asyncio.wait_for(self.backend.describe(), self.config.reconnect_rpc_timeout)
                problem = self._incompatible(cap)
                if problem:
                    log_event("warning", "worker_reconnect_refused", worker_id=self.worker_id, reason=problem)
                    continue
                stream = await asyncio.wait_for(self.backend.open(), self.config.reconnect_rpc_timeout)
            except asyncio.CancelledError:
                raise
            except OminixError as exc:
                if exc.kind is not RuntimeErrorKind.CAPABILITY_MISMATCH:
                    log_event("debug", "worker_reconnect_failed", worker_id=self.worker_id, error=str(exc))
                    continue
                # Not the worker this group served (e.g. another launch nonce): refused, asked again later.
                log_event("warning", "worker_reconnect_refused", worker_id=self.worker_id, reason=exc.message)
                continue
            except Exception as exc:  # noqa: BLE001 - still down: try again later
                log_event("debug", "worker_reconnect_failed", worker_id=self.worker_id, error=str(exc))
                continue
            self.capability = cap
            self.scheduler = Scheduler(cap, self.config.scheduler, counters=self.counters)
            self._deadlines.clear()
            self._last_result_at = 0.0
            self.num_reconnects += 1
            log_event("info", "worker_reconnected", worker_id=self.worker_id)
            return stream

    def _incompatible(self, cap: BackendCapability) -> str:
        old = self.capability
        if cap.worker_id != old.worker_id:
            return f"worker_id changed from {old.worker_id!r} to {cap.worker_id!r}"
        for attr in ("name", "vocab_size", "max_model_len", "eos_token_ids"):
            if getattr(cap.model, attr) != getattr(old.model, attr):
                return f"model {attr} changed"
        return ""

    async def _loop(self, stream: StepStream) -> None:
        loop = asyncio.get_running_loop()
        # One recv() stays pending even while idle, so a worker that dies (or stops sending heartbeats)
        # between requests is noticed at once rather than when the next step is sent.
        recv: asyncio.Future[StepResult] | None = None
        try:
            while not self._stopping:
                while len(self._inflight) < self.config.inflight_limit(
                    self.scheduler.num_running, self.scheduler.num_waiting
                ):
                    step = self.scheduler.schedule()
                    self._emit(self.scheduler.take_events())
                    if step is None:
                        break
                    self._inflight.append((step, loop.time()))
                    await stream.send(step)
                if recv is None:
                    recv = asyncio.ensure_future(stream.recv())
                if not self._inflight:
                    self._idle_check(loop.time())
                    self._wake.clear()
                    # Aborts (deadlines included) set _wake; the timeout paces the idle integrity check.
                    timeout = 1.0
                    wake = asyncio.ensure_future(self._wake.wait())
                    waiting: set[asyncio.Future[Literal[True]] | asyncio.Future[StepResult]] = {wake, recv}
                    await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                    wake.cancel()
                    if recv.done():
                        recv.result()  # raises the stream's failure
                        raise OminixError(
                            RuntimeErrorKind.INTERNAL,
                            f"worker {self.worker_id} sent a result with no step due",
                        )
                    continue
                done, _ = await asyncio.wait({recv}, timeout=self.config.step_timeout)
                if not done:
                    raise OminixError(
                        RuntimeErrorKind.BACKEND_UNAVAILABLE,
                        f"worker {self.worker_id} sent no result within {self.config.step_timeout:g} s",
                    )
                result, recv = recv.result(), None
                now = loop.time()
                applied = [self._apply(result)]
                # Results that came in while this loop was busy (the engine is behind its worker): applied
                # before any is delivered, so each request's tokens of those steps reach its stream together
                # and go out as one message. That is what lets a loaded engine catch up with its workers
                # rather than slowing their every step (one stream message per token is most of the cost).
                try:
                    while self._inflight and (more := stream.recv_nowait()) is not None:
                        applied.append(self._apply(more))
                finally:  # a failing stream still delivers what was applied (a resumed request goes on from it)
                    self._emit([e for a in applied for e in a.events])
                self._record_steps(applied, now)
        finally:
            if recv is not None:
                recv.cancel()
                with contextlib.suppress(BaseException):  # its failure, if any, was already reported
                    await recv

    def _apply(self, result: StepResult) -> _Applied:
        """Apply a step's result to the scheduler; its events are the caller's to deliver."""
        step, sent_at = self._inflight.popleft()
        if result.step_id != step.step_id:
            raise OminixError(
                RuntimeErrorKind.INTERNAL,
                f"worker {self.worker_id} answered step {result.step_id} while step {step.step_id} was due",
            )
        return _Applied(step, sent_at, result.compute_seconds, self.scheduler.update(step, result))

    def _record_steps(self, applied: list[_Applied], now: float) -> None:
        """Step reports of results taken together at ``now``: they ran one after another on the worker, from
        when the first could start (sent, and the step before it done) until now, so each gets an equal share
        of that time (a result taken without waiting would otherwise count as a step of no time at all)."""
        started = max(applied[0].sent_at, self._last_result_at)
        self._last_result_at = now
        duration = (now - started) / len(applied)
        for a in applied:
            self._record_step(a.step, a.compute_seconds, duration, a.events)

    def _record_step(
        self, step: DecodeStep, compute_seconds: float, duration: float, events: list[WorkerEvent]
    ) -> None:
        sampled = sum(len(e.token_ids) for e in events if isinstance(e, Token))
        batch = len(step.new_requests) + len(step.running_requests)
        self._observe_decode_rate(sampled, duration)
        self.recent_step_durations.append(duration)
        self.recent_batch_sizes.append(batch)
        self.hooks.step_report(
            self.worker_id,
            StepReport(
                step_id=step.step_id,
                duration=duration,
                num_tokens=step.num_scheduled_tokens,
                batch_size=batch,
                num_new_requests=len(step.new_requests),
                num_sampled_tokens=sampled,
                compute_seconds=compute_seconds,
            ),
        )

    def _idle_check(self, now: float) -> None:
        if now - self._last_integrity_check < self.config.idle_integrity_check_interval:
            return
        self._last_integrity_check = now
        self.integrity_checks += 1
        registry = self.scheduler.registry
        try:
            if not self.scheduler.requests:
                registry.check_quiescent()
            if registry.num_blocks <= _FULL_CHECK_MAX_BLOCKS:  # the full check walks every block
                self.scheduler.check_integrity()
        except AssertionError as exc:
            self.integrity_violations += 1
            log_event("error", "kv_integrity_violation", worker_id=self.worker_id, error=str(exc))

    def _fail(self, exc: BaseException) -> None:
        self.healthy = False
        self.num_failures += 1
        message = f"worker {self.worker_id} failed: {exc}"
        log_event("error", "worker_group_failed", worker_id=self.worker_id, error=str(exc))
        self._inflight.clear()
        error = (RuntimeErrorKind.BACKEND_UNAVAILABLE, message)
        try:
            self.scheduler.drop_inflight()
            evicted = self.scheduler.evict_all()
        except Exception as bug:  # noqa: BLE001 - even a broken scheduler must end every request once
            log_event("error", "worker_group_evict_failed", worker_id=self.worker_id, error=str(bug))
            self._end_all(error)
            return
        self._deadlines.clear()
        left = self._hand_over(evicted)
        for req in left:
            try:
                events = self.scheduler.fail_evicted(req, error)
            except Exception:  # noqa: BLE001 - the terminal event must go out whatever happened
                events = [Usage(req.request_id, 0, 0), Error(req.request_id, *error)]
            self._emit(events)
        self._end_all(error)  # anything the scheduler still holds

    def _end_all(self, error: ErrorInfo) -> None:
        for rid in list(self.scheduler.requests):
            try:
                events = self.scheduler.abort_request(rid, FinishReason.ERROR, error)
            except Exception:  # noqa: BLE001 - even a broken scheduler must end every request once
                self.scheduler.requests.pop(rid, None)
                events = [Usage(rid, 0, 0), Error(rid, *error)]
            self._emit(events)

    def adopt(self, req: EngineRequest) -> None:
        """Take over a request from a failed group (raises OminixError when it cannot run here)."""
        self.scheduler.adopt(req)
        self._track_deadline(req.request)
        self._wake.set()
