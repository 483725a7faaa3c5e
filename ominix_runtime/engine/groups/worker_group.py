"""WorkerGroup: what every worker group has, whatever granularity its backend works at.

A group serves one backend; the engine core routes requests to groups and talks to them only through this
class. The base owns what is the same for every kind: deadlines (one heap, expired by the core's sweep),
counters, the decode-rate average, run reports, the load snapshot and the failover hooks. A subclass says how
requests reach its backend: :class:`~ominix_runtime.engine.groups.step_group.StepWorkerGroup` schedules steps
itself (scheduler + KV registry + one ordered worker stream);
:class:`~ominix_runtime.engine.groups.request_group.RequestWorkerGroup` forwards whole requests to a backend
that batches and owns its KV (SGLang). A new kind of group is a new subclass, registered in ``groups/__init__``.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from ominix_runtime.contract import (
    BackendAdapter,
    BackendCapability,
    FinishReason,
    GenerateRequest,
    Granularity,
    OminixError,
    RuntimeErrorKind,
    WorkerEvent,
)
from ominix_runtime.engine.config import EngineCoreConfig
from ominix_runtime.engine.kv_registry import RegistrySnapshot
from ominix_runtime.engine.request import EngineRequest
from ominix_runtime.engine.stats import LoadSnapshot, RunReport, SchedulerCounters, StepReport, WorkerStats

# (kind, message) of an error that ends a request; None when it ends normally.
ErrorInfo = tuple[RuntimeErrorKind, str]


@dataclass(frozen=True, slots=True)
class GroupHooks:
    """How a group reaches the engine core. All are called synchronously on the event loop."""

    deliver: Callable[[list[WorkerEvent]], None]  # per-request events, in order
    report: Callable[[RunReport], None]  # once per finished request
    step_report: Callable[[str, StepReport], None]  # (worker_id, report) once per step
    # Called with a failed group's live requests; returns those no other group took (the failed group
    # ends them).
    evacuate: Callable[[WorkerGroup, list[EngineRequest]], list[EngineRequest]]


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """The moments a run report is computed from (``time.monotonic()`` seconds)."""

    queued: float  # arrival
    finished: float
    started: float | None = None  # first scheduled / forwarded
    first_token: float | None = None


class WorkerGroup(ABC):
    """One backend as the engine core sees it: admission, deadlines, load, stats and failover."""

    granularity: ClassVar[Granularity]
    # Whether this kind can take over requests from a failed group (from prompt + tokens streamed).
    resumes_requests: ClassVar[bool] = False

    def __init__(self, capability: BackendCapability, config: EngineCoreConfig, hooks: GroupHooks) -> None:
        self.capability = capability
        self.worker_id = capability.worker_id
        self.config = config
        self.hooks = hooks
        self.counters = SchedulerCounters()  # monotonic for the group's lifetime (reconnects included)
        self.healthy = True
        self.running = False  # started and able to take requests
        self.decode_tokens_per_second = 0.0
        self.integrity_checks = 0
        self.integrity_violations = 0
        self.num_failures = 0
        self.num_reconnects = 0
        self.num_protocol_violations = 0  # the backend broke the event contract
        self.protocol_violations: deque[str] = deque(maxlen=64)
        self.recent_step_durations: deque[float] = deque(maxlen=config.recent_window)
        self.recent_batch_sizes: deque[int] = deque(maxlen=config.recent_window)
        self._deadlines: list[tuple[float, str]] = []  # (deadline, request id) heap

    @classmethod
    @abstractmethod
    def create(
        cls,
        backend: BackendAdapter,
        capability: BackendCapability,
        config: EngineCoreConfig,
        hooks: GroupHooks,
    ) -> WorkerGroup:
        """A group of this kind for ``backend``; CAPABILITY_MISMATCH when the backend cannot work that way."""

    # ---- lifecycle ------------------------------------------------------------------------------------

    @abstractmethod
    async def start(self) -> None:
        """Ready to take requests when it returns; raises when the backend cannot be reached."""

    @abstractmethod
    async def stop(self) -> None:
        """Stop driving the backend. Requests still live are the caller's to end (see EngineCore.stop)."""

    # ---- requests -------------------------------------------------------------------------------------

    @abstractmethod
    def submit(self, request: GenerateRequest) -> None:
        """Admit ``request``, or raise OminixError (counted as rejected; nothing changes then)."""

    @abstractmethod
    def abort(self, request_id: str, reason: FinishReason, error: ErrorInfo | None) -> bool:
        """End a live request now with Usage + its terminal event; False when it is not live here."""

    @abstractmethod
    def finish(self, request_id: str, reason: FinishReason, matched_stop: str) -> bool:
        """End a live request normally (the front end found a stop string); False when it is not live."""

    @abstractmethod
    def live_request(self, request_id: str) -> GenerateRequest | None:
        """The live request with this id, or None."""

    def prefix_hit_tokens(self, request: GenerateRequest) -> int:
        """Prompt tokens this group could serve from its prefix cache (routing affinity)."""
        return 0

    # ---- deadlines ------------------------------------------------------------------------------------

    def _track_deadline(self, request: GenerateRequest) -> None:
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, request.request_id))

    def expire(self, now: float) -> None:
        """End every live request whose deadline is at or before ``now`` with Error(TIMEOUT)."""
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, rid = heapq.heappop(self._deadlines)
            live = self.live_request(rid)
            # An entry may outlive its request; a later request may reuse the id with another deadline.
            if live is not None and live.deadline == deadline:
                self.abort(
                    rid, FinishReason.ABORT, (RuntimeErrorKind.TIMEOUT, "the request's deadline passed")
                )

    # ---- failover -------------------------------------------------------------------------------------

    def adopt(self, request: EngineRequest) -> None:
        """Take over a request from a failed group; raises OminixError when it cannot run here."""
        raise OminixError(
            RuntimeErrorKind.BACKEND_UNAVAILABLE,
            f"worker group {self.worker_id} cannot resume requests of another group",
        )

    def _hand_over(self, requests: list[EngineRequest]) -> list[EngineRequest]:
        """Offer a failed group's requests to the others; returns those nobody took."""
        return self.hooks.evacuate(self, requests)

    # ---- load and stats -------------------------------------------------------------------------------

    @property
    @abstractmethod
    def num_queued(self) -> int:
        """Requests admitted but not yet running."""

    @property
    @abstractmethod
    def num_running(self) -> int: ...

    @property
    @abstractmethod
    def num_waiting_tokens(self) -> int:
        """Prompt tokens of the queued requests."""

    @property
    def kv_blocks(self) -> tuple[int, int]:
        """(used, total) KV blocks the engine manages for this group; (0, 0) when the backend owns its KV."""
        return 0, 0

    @property
    def kv_token_capacity(self) -> int | None:
        """Tokens of KV the engine manages for this group; None when the backend owns its KV."""
        return None

    def kv_bytes(self) -> tuple[int, int]:
        """(used, capacity) KV bytes, for load reports."""
        used, total = self.kv_blocks
        per_block = self.capability.kv_bytes_per_block
        return used * per_block, total * per_block

    def kv_snapshot(self) -> RegistrySnapshot | None:
        """The engine-side KV registry's figures (prefix cache included); None when the backend owns its KV."""
        return None

    async def flush_prefix_cache(self) -> bool:
        """Forget every cached prefix (requests in flight keep their KV; nothing computed over KV from before
        the flush is served to later requests); False when there is none to drop."""
        return False

    @property
    def num_preempted(self) -> int:
        """Requests waiting to resume after a preemption (only an engine-side scheduler preempts)."""
        return 0

    def stats(self) -> WorkerStats:
        """This group's figures for the metrics endpoint: gauges as they are now, counters since start."""
        load = self.load()
        counters = self.counters
        kv = self.kv_snapshot()
        return WorkerStats(
            worker_id=self.worker_id,
            backend=self.capability.kind.name.lower(),
            model_name=self.capability.model.name,
            up=self.running and self.healthy,
            running_requests=load.running_requests,
            waiting_requests=load.queued_requests,
            preempted_requests=self.num_preempted,
            kv_known=kv is not None,
            kv_blocks_capacity=kv.num_blocks if kv else 0,
            kv_block_size=kv.block_size if kv else 0,
            kv_blocks_used=kv.num_leased_blocks if kv else 0,
            kv_blocks_cached=kv.num_cached_evictable_blocks if kv else 0,
            kv_blocks_free=kv.num_free_blocks if kv else 0,
            prefix_queried_tokens=kv.prefix_query_tokens if kv else 0,
            prefix_hit_tokens=kv.prefix_hit_tokens if kv else 0,
            prompt_tokens=counters.prompt_tokens,
            generation_tokens=counters.generated_tokens,
            preemptions=counters.preemptions,
            admission_held_steps=counters.admission_held_steps,
            burst_budget_steps=counters.burst_budget_steps,
            failovers=self.num_failures,
            restarts=self.num_reconnects,
            resumed_requests=counters.resumed,
            integrity_violations=self.integrity_violations,
            protocol_violations=self.num_protocol_violations,
        )

    def check_integrity(self) -> None:
        """Check the engine-side invariants of this group (raises AssertionError).

        Nothing by default: a group whose backend owns batching and KV keeps no engine-side invariants.
        """
        return None

    def load(self) -> LoadSnapshot:
        used, capacity = self.kv_bytes()
        return LoadSnapshot(
            worker_id=self.worker_id,
            queued_requests=self.num_queued,
            running_requests=self.num_running,
            waiting_tokens=self.num_waiting_tokens,
            kv_bytes_used=used,
            kv_bytes_capacity=capacity,
            estimated_decode_tokens_per_second=self.decode_tokens_per_second,
            healthy=self.healthy,
        )

    def _observe_decode_rate(self, tokens: int, seconds: float) -> None:
        """Fold one measurement into the decode-rate average (an EWMA) that load reports carry."""
        if seconds <= 0 or tokens <= 0:
            return
        rate = tokens / seconds
        alpha = self.config.decode_rate_ewma_alpha
        prev = self.decode_tokens_per_second
        self.decode_tokens_per_second = rate if prev == 0.0 else alpha * rate + (1 - alpha) * prev

    def _report_run(
        self,
        request: GenerateRequest,
        reason: FinishReason,
        error_kind: RuntimeErrorKind | None,
        output_tokens: int,
        cached_tokens: int,
        times: RequestTimes,
        num_prompt_tokens: int | None = None,
        num_preemptions: int = 0,
        inter_token_latencies: Sequence[float] = (),
    ) -> None:
        """Build the run report of a finished request and hand it to the core."""
        ttft = times.first_token - times.queued if times.first_token is not None else None
        tpot = None
        if times.first_token is not None and output_tokens > 1:
            tpot = (times.finished - times.first_token) / (output_tokens - 1)
        self.hooks.report(
            RunReport(
                request_id=request.request_id,
                worker_id=self.worker_id,
                finish_reason=reason,
                error_kind=error_kind,
                prompt_tokens=(
                    num_prompt_tokens if num_prompt_tokens is not None else len(request.prompt_token_ids)
                ),
                output_tokens=output_tokens,
                cached_tokens=cached_tokens,
                num_preemptions=num_preemptions,
                queue_time=times.started - times.queued if times.started is not None else None,
                ttft=ttft,
                tpot=tpot,
                e2e=times.finished - times.queued,
                priority=int(request.priority),
                model=request.model,
                arrival_time=times.queued,
                inter_token_latencies=tuple(inter_token_latencies),
            )
        )


__all__ = ["ErrorInfo", "GroupHooks", "RequestTimes", "WorkerGroup"]
