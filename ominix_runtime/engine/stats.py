"""Plain stats snapshots (no metrics library here; server/metrics.py turns them into Prometheus series)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ominix_runtime.contract import BackendHealth, FinishReason, RuntimeErrorKind


@dataclass(slots=True)
class SchedulerCounters:
    """Monotonic counters of one scheduler (one worker group)."""

    accepted: int = 0
    rejected: int = 0
    finished: int = 0  # stop or length
    aborted: int = 0  # abort, deadline
    failed: int = 0  # backend or per-request error
    prompt_tokens: int = 0  # prompt tokens of accepted requests
    generated_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    computed_tokens: int = 0  # tokens scheduled for computation (prefill + decode, recompute included)
    preemptions: int = 0
    admission_held_steps: int = 0  # steps that left a backlog waiting for more free slots
    burst_budget_steps: int = 0  # steps beside decodes that took a burst's budget
    steps: int = 0
    discarded_outputs: int = 0  # outputs for requests that ended while their step was in flight
    unexpected_outputs: int = 0  # outputs naming a request the step did not schedule
    resumed: int = 0  # requests taken over from a failed worker group (recomputed here)


@dataclass(frozen=True, slots=True)
class StepReport:
    """One step of one worker group, reported after its result came back."""

    step_id: int
    duration: float  # seconds on the worker: from send (or the previous result, if later) to this result
    num_tokens: int  # tokens scheduled
    batch_size: int  # requests scheduled
    num_new_requests: int
    num_sampled_tokens: int
    compute_seconds: float = 0.0  # as reported by the worker


@dataclass(frozen=True, slots=True)
class RunReport:
    """One finished request."""

    request_id: str
    worker_id: str
    finish_reason: FinishReason
    error_kind: RuntimeErrorKind | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    num_preemptions: int
    queue_time: float | None  # arrival → first scheduled
    ttft: float | None  # arrival → first token
    tpot: float | None  # (e2e - ttft) / (output_tokens - 1)
    e2e: float  # arrival → end
    priority: int = 0
    model: str = ""  # the model the request named (empty: the engine's served model)
    arrival_time: float = 0.0  # on the monotonic clock: the phases above are offsets from it
    # Gaps between consecutive token deliveries of this request (one per step that sampled for it).
    inter_token_latencies: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The fields a least-loaded router reads, per worker group."""

    worker_id: str
    queued_requests: int
    running_requests: int
    waiting_tokens: int
    kv_bytes_used: int
    kv_bytes_capacity: int
    estimated_decode_tokens_per_second: float
    healthy: bool
    # Filled in by EngineCore.load() (a group knows neither its drain state nor the wall clock).
    health: BackendHealth = BackendHealth.AVAILABLE
    timestamp_ms: int = 0  # Unix milliseconds when taken
    model_ids: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = ()
    backend_kind: str = ""  # upstream contract name of the backend kind


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """Per worker group, read by the metrics endpoint: gauges as they are now, counters since start.

    Step-level groups know their KV registry; request-level backends (SGLang) leave the KV figures at 0
    with ``kv_known`` False, so no made-up KV series are exported for them.
    """

    worker_id: str
    backend: str  # the capability's backend kind: cuda, cpu, ascend, sglang, fake
    model_name: str
    up: bool  # the driver's stream is open and the group is healthy
    running_requests: int
    waiting_requests: int
    preempted_requests: int  # waiting to resume after a preemption
    kv_known: bool
    kv_blocks_capacity: int
    kv_block_size: int  # tokens per block
    kv_blocks_used: int  # leased by live requests
    kv_blocks_cached: int  # unleased blocks that hold prefix-cache content (evictable)
    kv_blocks_free: int  # unleased and empty
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prompt_tokens: int  # of requests admitted here
    generation_tokens: int
    preemptions: int
    admission_held_steps: int  # steps that left a backlog waiting for more free slots
    burst_budget_steps: int  # steps beside decodes that took a burst's budget
    failovers: int  # times this group failed and its live requests were failed over
    restarts: int  # times the engine reconnected to this worker after a failure
    resumed_requests: int  # requests taken over here from a failed group
    integrity_violations: int
    protocol_violations: int


@dataclass(frozen=True, slots=True)
class EngineStats:
    accepted: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_hit_ratio: float = 0.0  # hit tokens / queried tokens
    integrity_checks: int = 0
    integrity_violations: int = 0
    protocol_violations: int = 0  # backend broke the event contract (request-level backends)
    discarded_outputs: int = 0
    running_requests: int = 0
    queued_requests: int = 0
    recent_step_durations: list[float] = field(default_factory=list)
    recent_batch_sizes: list[int] = field(default_factory=list)
    recent_protocol_violations: list[str] = field(default_factory=list)
