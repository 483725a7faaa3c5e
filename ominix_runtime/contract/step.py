"""One scheduler iteration (DecodeStep) and its result (StepResult).

A DecodeStep carries new requests in full once and running requests as diffs; the worker keeps a
persistent batch. For a decoding request the input token is the worker's own last sampled token, so the
engine can send step N+1 before step N's result is back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ominix_runtime.contract.errors import RuntimeErrorKind
from ominix_runtime.contract.sampling import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    kv_block_ids: list[int]  # block table of KV group 0; NULL_BLOCK_ID where a window slid past
    num_computed_tokens: int  # prefix-cache hit: KV already in the first blocks
    num_scheduled_tokens: int
    effective_seed: int
    output_token_ids: list[int] = field(default_factory=list)  # resumed after preemption
    traceparent: str = ""  # W3C trace context of the engine's request span ("" when not traced)
    # Block tables of KV groups 1..n-1 of a hybrid layout (group 0's is kv_block_ids); empty for one group.
    group_kv_block_ids: list[list[int]] = field(default_factory=list)
    # Leading tokens whose KV the blocks already hold; 0: num_computed_tokens. Larger only for a prompt found
    # whole in the prefix cache: its last token is computed again for its logits, and its KV is not written.
    num_cached_kv_tokens: int = 0

    @property
    def kv_cached_until(self) -> int:
        """Positions below this hold their KV already: the worker writes none of them."""
        return max(self.num_cached_kv_tokens, self.num_computed_tokens)

    @property
    def is_whole_prompt_hit(self) -> bool:
        return self.num_cached_kv_tokens > self.num_computed_tokens

    def cached_kv_problem(self, takes_whole_prompt_hits: bool) -> str:
        """Why a worker that does (or does not) take whole-prompt hits cannot run this request's cached KV
        tokens; "" when it can. A whole-prompt hit holds the whole sequence, one token past num_computed_tokens."""
        if not self.is_whole_prompt_hit:
            return ""
        known = len(self.prompt_token_ids) + len(self.output_token_ids)
        if takes_whole_prompt_hits and self.num_cached_kv_tokens == self.num_computed_tokens + 1 == known:
            return ""
        return (
            f"{self.num_cached_kv_tokens} cached KV tokens with {self.num_computed_tokens} computed of {known} is "
            f"not a whole-prompt hit this worker takes"
        )


@dataclass(slots=True)
class RunningRequestData:
    request_id: str
    new_kv_block_ids: list[int]  # appended to group 0's table
    num_scheduled_tokens: int
    # Per KV group 1..n-1: blocks appended to that group's table; empty for a one-group layout.
    new_group_kv_block_ids: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class DecodeStep:
    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    running_requests: list[RunningRequestData] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.new_requests) + sum(
            r.num_scheduled_tokens for r in self.running_requests
        )

    @property
    def scheduled_request_ids(self) -> list[str]:
        return [r.request_id for r in self.new_requests] + [r.request_id for r in self.running_requests]

    @property
    def is_empty(self) -> bool:
        return not (self.new_requests or self.running_requests or self.finished_request_ids)


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(slots=True)
class SampledLogprobs:
    sampled: TokenLogprob
    top: list[TokenLogprob] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    sampled_token_id: int | None = None  # None while a chunked prefill is still running
    logprobs: SampledLogprobs | None = None
    error_kind: RuntimeErrorKind | None = None
    error_message: str = ""


@dataclass(slots=True)
class StepResult:
    step_id: int
    outputs: list[RequestOutput] = field(default_factory=list)
    compute_seconds: float = 0.0
    num_tokens: int = 0


@dataclass(slots=True)
class BatchPlan:
    """What the scheduler decided for one step, before it became a wire message: used by stats and tests."""

    step_id: int
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_new_requests: int = 0
    num_running_requests: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    token_budget: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens
