"""The engine-side record of one request inside a scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from ominix_runtime.contract import (
    FinishReason,
    GenerateRequest,
    Priority,
    RequestState,
    RuntimeErrorKind,
    check_transition,
)


@dataclass(slots=True)
class EngineRequest:
    """Mutable scheduling state of one request. Every state change goes through :meth:`transition`."""

    request: GenerateRequest
    arrival_seq: int  # FCFS order within a priority class
    effective_seed: int  # fixed at admission so a resumed request samples the same tokens
    request_id: str = ""
    order_key: tuple[int, int] = (0, 0)  # scheduling order: priority class, then arrival (FCFS)
    all_token_ids: list[int] = field(default_factory=list)  # prompt + real output tokens
    num_prompt_tokens: int = 0
    num_placeholders: int = 0  # output tokens scheduled but whose result has not come back yet
    num_computed_tokens: int = 0  # optimistic: counts tokens of steps still in flight
    num_inflight_steps: int = 0
    # Of those, the ones whose outputs are void: computed over KV that may never have been written (a failed
    # request's blocks it hit), they are dropped, and the request computes its prompt again.
    num_void_inflight_steps: int = 0
    prefix_blocks: tuple[tuple[int, ...], ...] = ()  # per KV group: the blocks of its last prefix hit
    # Per KV group: the registered blocks whose steps the worker answered, and the counts registered when
    # each step still in flight was built (step id, counts), oldest first.
    written_blocks: tuple[int, ...] = ()
    registrations: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    worker_has_state: bool = False  # sent as a NewRequest and not yet dropped via finished_request_ids
    num_cached_tokens: int = 0  # prefix-cache hit at first admission (reported in Usage)
    num_preemptions: int = 0
    protected_until_step: int = 0  # anti-thrash: not picked as a preemption victim before this step
    num_times_bypassed: int = 0  # anti-starvation: steps in which smaller requests were admitted around it
    held_by_prefill_limit: bool = False  # kept waiting by the prefill limit beside decodes: not again
    prefill_reported: bool = False
    finish_reason: FinishReason | None = None
    error_kind: RuntimeErrorKind | None = None
    # Times on the scheduler's clock.
    queued_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_gaps: list[float] = field(default_factory=list)  # inter-token latencies, one per sampling step

    @property
    def priority(self) -> Priority:
        return self.request.priority

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        """Known tokens plus placeholders for tokens being sampled right now."""
        return len(self.all_token_ids) + self.num_placeholders

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def __post_init__(self) -> None:
        self.request_id = self.request.request_id
        self.order_key = (int(self.request.priority), self.arrival_seq)

    def transition(self, dst: RequestState) -> None:
        self.state = check_transition(self.state, dst)
