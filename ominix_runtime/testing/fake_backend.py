"""Deterministic in-process backends for tests and the conformance suite (no model, no torch).

:class:`FakeStepBackend` behaves like a real step-level worker: it keeps every request's token sequence,
applies DecodeStep diffs, and checks what a worker would silently trust — block ids within capacity, no
block written while another live request holds it, prefix-hit blocks really holding the request's tokens,
tokens scheduled only when known. A violation is recorded in ``violations`` and fails the stream.
A request that got a per-request error stays until the engine drops it and answers any later entry
for it (possible with two steps in flight) with an error again. The sampled token is a seeded hash of (effective_seed, output position, last tokens), so a request
preempted and recomputed draws the same tokens.

:class:`FakeRequestBackend` is a request-level backend (like SGLang); with ``broken=True`` it breaks the
event contract (a token before prefill_done, two terminal events) so the conformance suite can be shown
to fail readably.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ominix_runtime.contract import (
    FAKE_PROFILE,
    NULL_BLOCK_ID,
    AttentionKind,
    BackendCapability,
    BackendKind,
    DecodeStep,
    Done,
    FinishReason,
    GenerateRequest,
    Granularity,
    KVGroup,
    ModelInfo,
    OminixError,
    PrefillDone,
    RequestOutput,
    RuntimeErrorKind,
    SamplingParams,
    StepResult,
    Token,
    Usage,
    WorkerEvent,
    stated_profile,
)

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread deterministic hash of one 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def fake_sample(
    effective_seed: int, output_position: int, last_tokens: list[int], vocab_size: int, greedy: bool
) -> int:
    """The token the fake worker samples. Greedy sampling ignores the seed, like a real model would."""
    h = _mix64(0 if greedy else effective_seed)
    h = _mix64(h ^ output_position)
    for t in last_tokens[-4:]:
        h = _mix64(h ^ t)
    return h % vocab_size


@dataclass(slots=True)
class FakeConfig:
    worker_id: str = "fake-0"
    model_name: str = "fake-model"
    vocab_size: int = 1000
    eos_token_ids: tuple[int, ...] = (2,)
    max_model_len: int = 4096
    kv_num_blocks: int = 256
    kv_block_size: int = 16
    kv_bytes_per_block: int = 1024
    max_batch_tokens: int = 512
    max_running_requests: int = 64
    supports_prefix_caching: bool = True
    # A prompt cached whole computes its last token alone (NewRequestData.num_cached_kv_tokens).
    supports_whole_prompt_hits: bool = True
    step_latency: float = 0.0  # seconds per step
    # > 0: every layer attends to this many tokens; the fake states one sliding-window KV group and checks
    # that every position a step reads is still intact.
    sliding_window: int = 0
    # Failure injection (step ids count from 1, as the engine sends them).
    fail_step: int | None = None  # every request in this step gets a per-request error
    die_after_steps: int | None = None  # the stream breaks once this many steps have been answered
    hang_at_step: int | None = None  # this step's result never comes
    unknown_output_at_step: int | None = None  # this step's result also names a request nobody sent
    describe_delay: float = 0.0


STEPS_KEPT = 256  # FakeStepBackend.steps_seen


def fake_capability(c: FakeConfig, granularity: Granularity) -> BackendCapability:
    """What a fake backend states: the fake profile filled in from its config."""
    return stated_profile(
        BackendKind.FAKE,
        worker_id=c.worker_id,
        granularity=granularity,
        model=ModelInfo(
            name=c.model_name,
            vocab_size=c.vocab_size,
            max_model_len=c.max_model_len,
            eos_token_ids=c.eos_token_ids,
            architecture="FakeForCausalLM",
        ),
        kv_block_size=c.kv_block_size,
        kv_num_blocks=c.kv_num_blocks,
        kv_bytes_per_block=c.kv_bytes_per_block,
        max_batch_tokens=c.max_batch_tokens,
        max_running_requests=c.max_running_requests,
        supports_prefix_caching=c.supports_prefix_caching,
        supports_whole_prompt_hits=c.supports_whole_prompt_hits,
        version=FAKE_PROFILE.version or "fake",
        kv_groups=(
            KVGroup(
                AttentionKind.SLIDING_WINDOW,
                (0,),
                c.kv_block_size,
                c.kv_num_blocks,
                sliding_window=c.sliding_window,
            ),
        )
        if c.sliding_window
        else (),
    )


@dataclass(slots=True)
class _FakeRequest:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    effective_seed: int
    kv_block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    kv_cached_until: int = 0  # positions below hold their KV from a prefix hit: read, never written
    failed: bool = False  # a per-request error was returned; kept until the engine drops it


class FakeViolation(AssertionError):
    """The engine sent something a real worker could not have executed correctly."""


class FakeStepBackend:
    """A step-level backend that keeps exact per-request state. See the module docstring."""

    def __init__(self, config: FakeConfig | None = None) -> None:
        self.config = config or FakeConfig()
        self.violations: list[str] = []
        self.requests: dict[str, _FakeRequest] = {}
        self.block_contents: dict[int, dict[int, int]] = {}  # block id -> slot -> token id written there
        self.block_holders: dict[int, set[str]] = {}
        self.num_steps = 0
        # The latest steps, for tests that read what the engine sent; bounded, so that a soak's RSS check
        # measures the engine and not this record.
        self.steps_seen: deque[DecodeStep] = deque(maxlen=STEPS_KEPT)
        self.closed = False
        self.down = False  # crash() / revive()
        self._streams: list[FakeStepStream] = []

    def capability(self) -> BackendCapability:
        return fake_capability(self.config, Granularity.STEP)

    @property
    def num_streams_opened(self) -> int:
        """Run streams opened so far (the engine must open none when negotiation refuses it)."""
        return len(self._streams)

    def crash(self) -> None:
        """Simulate a killed worker: open streams break, Describe and Run fail until :meth:`revive`."""
        self.down = True
        self.requests.clear()
        self.block_holders.clear()
        for s in self._streams:
            s.break_()

    def revive(self) -> None:
        """The worker is back (with empty state); the engine may reconnect."""
        self.down = False

    async def describe(self) -> BackendCapability:
        if self.down:
            raise OminixError(RuntimeErrorKind.BACKEND_UNAVAILABLE, f"{self.config.worker_id} is down")
        if self.config.describe_delay:
            await asyncio.sleep(self.config.describe_delay)
        return self.capability()

    async def open(self) -> FakeStepStream:
        if self.down:
            raise OminixError(RuntimeErrorKind.BACKEND_UNAVAILABLE, f"{self.config.worker_id} is down")
        # A new stream starts from an empty worker state, like a real worker's Run stream.
        self.requests.clear()
        self.block_holders.clear()
        stream = FakeStepStream(self)
        self._streams.append(stream)
        return stream

    async def health(self) -> bool:
        return not self.closed and not self.down

    async def close(self) -> None:
        self.closed = True
        for s in self._streams:
            await s.close()

    # ---- step execution -------------------------------------------------------------------------------

    def _violation(self, message: str) -> None:
        self.violations.append(message)
        raise FakeViolation(message)

    def _drop(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            self._violation(f"finished_request_ids names unknown request {request_id}")
            return
        for b in req.kv_block_ids:
            if b != NULL_BLOCK_ID:
                self.block_holders[b].discard(request_id)

    def _add_blocks(self, req: _FakeRequest, block_ids: list[int]) -> None:
        for b in block_ids:
            if b == NULL_BLOCK_ID and self.config.sliding_window:
                req.kv_block_ids.append(b)  # slid out of the window before the worker saw it
                continue
            if not 0 <= b < self.config.kv_num_blocks:
                self._violation(f"{req.request_id}: block {b} outside [0, {self.config.kv_num_blocks})")
            if req.request_id in self.block_holders.get(b, set()):
                self._violation(f"{req.request_id}: block {b} sent twice for the same request")
            req.kv_block_ids.append(b)
            self.block_holders.setdefault(b, set()).add(req.request_id)

    def _first_read(self, num_computed_tokens: int) -> int:
        """First position a step starting at ``num_computed_tokens`` reads (a window's first token)."""
        if not self.config.sliding_window:
            return 0
        return max(0, num_computed_tokens - self.config.sliding_window + 1)

    def _slide(self, req: _FakeRequest, start: int) -> None:
        """Check the window a step starting at ``start`` reads, and stop holding blocks wholly before it."""
        bs = self.config.kv_block_size
        first = self._first_read(start)
        for i in range(first // bs):
            b = req.kv_block_ids[i]
            if b != NULL_BLOCK_ID:
                self.block_holders[b].discard(req.request_id)
        for pos in range(first, start):
            block = req.kv_block_ids[pos // bs]
            if (
                block == NULL_BLOCK_ID
                or self.block_contents.get(block, {}).get(pos % bs) != req.token_ids[pos]
            ):
                self._violation(f"{req.request_id}: position {pos} in the window lost its KV (block {block})")
                return

    def execute(self, step: DecodeStep) -> StepResult:
        c = self.config
        self.num_steps += 1
        self.steps_seen.append(step)
        for rid in step.finished_request_ids:
            self._drop(rid)
        scheduled: list[tuple[_FakeRequest, int]] = []
        for new in step.new_requests:
            if new.request_id in self.requests:
                self._violation(f"new request {new.request_id} is already live on the worker")
            req = _FakeRequest(
                new.request_id,
                list(new.prompt_token_ids) + list(new.output_token_ids),
                len(new.prompt_token_ids),
                new.sampling,
                new.effective_seed,
            )
            self.requests[new.request_id] = req
            self._add_blocks(req, list(new.kv_block_ids))
            bs = c.kv_block_size
            cached = new.kv_cached_until
            if cached % bs:
                self._violation(f"{new.request_id}: prefix hit of {cached} tokens is not block-aligned")
            if new.num_computed_tokens >= len(req.token_ids):
                self._violation(
                    f"{new.request_id}: prefix hit covers the last token, nothing left to sample from"
                )
            problem = new.cached_kv_problem(c.supports_whole_prompt_hits)
            if problem:
                self._violation(f"{new.request_id}: {problem}")
            for pos in range(self._first_read(new.num_computed_tokens), cached):
                block = req.kv_block_ids[pos // bs]
                if self.block_contents.get(block, {}).get(pos % bs) != req.token_ids[pos]:
                    self._violation(
                        f"{new.request_id}: prefix-hit block {block} does not hold token position {pos}"
                    )
                    break
            req.num_computed_tokens = new.num_computed_tokens
            req.kv_cached_until = cached
            scheduled.append((req, new.num_scheduled_tokens))
        for run in step.running_requests:
            known = self.requests.get(run.request_id)
            if known is None:
                self._violation(f"running request {run.request_id} is unknown to the worker")
                continue
            if c.sliding_window:  # the engine released the blocks behind the window before it grew the table
                self._slide(known, known.num_computed_tokens)
            self._add_blocks(known, list(run.new_kv_block_ids))
            scheduled.append((known, run.num_scheduled_tokens))
        if step.num_scheduled_tokens > c.max_batch_tokens:
            self._violation(
                f"step {step.step_id} schedules {step.num_scheduled_tokens} > {c.max_batch_tokens} tokens"
            )
        if len(self.requests) > c.max_running_requests:
            self._violation(
                f"{len(self.requests)} live requests > max_running_requests {c.max_running_requests}"
            )
        outputs: list[RequestOutput] = []
        for req, n in scheduled:
            outputs.append(self._compute(req, n, step.step_id))
        if c.unknown_output_at_step == step.step_id:
            outputs.append(RequestOutput("no-such-request", sampled_token_id=1))
        return StepResult(
            step.step_id, outputs, compute_seconds=c.step_latency, num_tokens=step.num_scheduled_tokens
        )

    def _compute(self, req: _FakeRequest, n: int, step_id: int) -> RequestOutput:
        c = self.config
        if req.failed:
            # With two steps in flight the engine may schedule a request once more after it failed.
            return RequestOutput(
                req.request_id, error_kind=RuntimeErrorKind.INTERNAL, error_message="failed earlier"
            )
        bs = c.kv_block_size
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        if n <= 0 or end > len(req.token_ids):
            self._violation(
                f"{req.request_id}: scheduled tokens [{start}, {end}) but the worker knows {len(req.token_ids)}"
            )
        if end > len(req.kv_block_ids) * bs:
            self._violation(
                f"{req.request_id}: {end} tokens need more than its {len(req.kv_block_ids)} blocks"
            )
        if c.sliding_window:
            self._slide(req, start)
        for pos in range(max(start, req.kv_cached_until), end):  # a whole-prompt hit's last token: no write
            block = req.kv_block_ids[pos // bs]
            others = self.block_holders[block] - {req.request_id}
            if others:
                self._violation(f"{req.request_id}: writes block {block} also held by live {sorted(others)}")
            self.block_contents.setdefault(block, {})[pos % bs] = req.token_ids[pos]
        req.num_computed_tokens = end
        if c.fail_step == step_id:
            req.failed = True
            return RequestOutput(
                req.request_id, error_kind=RuntimeErrorKind.INTERNAL, error_message="injected failure"
            )
        if end < len(req.token_ids):
            return RequestOutput(req.request_id)  # chunked prefill continues
        position = len(req.token_ids) - req.num_prompt_tokens
        token = fake_sample(req.effective_seed, position, req.token_ids, c.vocab_size, req.sampling.is_greedy)
        req.token_ids.append(token)
        return RequestOutput(req.request_id, sampled_token_id=token)


class FakeStepStream:
    """Results in step order; send() never blocks, recv() waits for the next step."""

    def __init__(self, backend: FakeStepBackend) -> None:
        self._backend = backend
        self._pending: deque[DecodeStep] = deque()
        self._ready = asyncio.Event()
        self._closed = False
        self._broken = False
        self._num_answered = 0

    async def send(self, step: DecodeStep) -> None:
        if self._closed or self._backend.closed:
            raise OminixError(RuntimeErrorKind.BACKEND_UNAVAILABLE, "fake stream is closed")
        self._pending.append(step)
        self._ready.set()

    def break_(self) -> None:
        self._broken = True
        self._closed = True
        self._ready.set()

    async def recv(self) -> StepResult:
        c = self._backend.config
        if self._broken:
            raise OminixError(RuntimeErrorKind.BACKEND_UNAVAILABLE, "fake worker crashed")
        while not self._pending:
            if self._closed:
                raise OminixError(RuntimeErrorKind.BACKEND_UNAVAILABLE, "fake stream is closed")
            self._ready.clear()
            await self._ready.wait()
        if c.die_after_steps is not None and self._num_answered >= c.die_after_steps:
            self._closed = True
            raise OminixError(
                RuntimeErrorKind.BACKEND_UNAVAILABLE, f"fake worker died after {self._num_answered} steps"
            )
        step = self._pending.popleft()
        if c.hang_at_step == step.step_id:
            await asyncio.Event().wait()  # never set: the engine's step timeout must catch this
        if c.step_latency:
            await asyncio.sleep(c.step_latency)
        return self._answer(step)

    def recv_nowait(self) -> StepResult | None:
        """A step answers at once only without latency or a hang (those go through recv)."""
        c = self._backend.config
        if self._broken:
            raise OminixError(RuntimeErrorKind.BACKEND_UNAVAILABLE, "fake worker crashed")
        if not self._pending or c.step_latency or c.hang_at_step == self._pending[0].step_id:
            return None
        if c.die_after_steps is not None and self._num_answered >= c.die_after_steps:
            return None  # recv reports the death
        return self._answer(self._pending.popleft())

    def _answer(self, step: DecodeStep) -> StepResult:
        if self._broken:
            raise OminixError(RuntimeErrorKind.BACKEND_UNAVAILABLE, "fake worker crashed")
        try:
            result = self._backend.execute(step)
        except FakeViolation as exc:
            self._closed = True
            raise OminixError(
                RuntimeErrorKind.INTERNAL, f"fake worker rejected step {step.step_id}: {exc}"
            ) from exc
        self._num_answered += 1
        return result

    async def close(self) -> None:
        self._closed = True
        self._ready.set()


class FakeRequestBackend:
    """A request-level backend (owns its own batching) producing fake tokens.

    ``broken=True`` emits a token before prefill_done and a second terminal event: a backend that breaks
    the event contract, for showing that the conformance suite catches it.
    """

    def __init__(
        self, config: FakeConfig | None = None, broken: bool = False, token_delay: float = 0.0
    ) -> None:
        self.config = config or FakeConfig(worker_id="fake-request-0")
        self.broken = broken
        self.token_delay = token_delay
        self._aborted: set[str] = set()
        self._running = 0
        self.closed = False

    async def describe(self) -> BackendCapability:
        return fake_capability(self.config, Granularity.REQUEST)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[WorkerEvent]:
        c = self.config
        rid = request.request_id
        sp = request.sampling
        tokens = list(request.prompt_token_ids)
        seed = sp.seed if sp.seed is not None else 0
        self._running += 1
        try:
            if not self.broken:
                yield PrefillDone(rid, len(tokens))
            reason = FinishReason.LENGTH
            for position in range(sp.max_tokens):
                if rid in self._aborted:
                    reason = FinishReason.ABORT
                    break
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                else:
                    await asyncio.sleep(0)
                token = fake_sample(seed, position, tokens, c.vocab_size, sp.is_greedy)
                tokens.append(token)
                by_stop_token = token in sp.stop_token_ids or (token in c.eos_token_ids and not sp.ignore_eos)
                yield Token(rid, [token], ended_by_stop_token=by_stop_token)
                if self.broken and position == 0:
                    yield PrefillDone(rid, len(request.prompt_token_ids))
                if by_stop_token:
                    reason = FinishReason.STOP
                    break
            n_out = len(tokens) - len(request.prompt_token_ids)
            yield Usage(rid, len(request.prompt_token_ids), n_out)
            yield Done(rid, reason)
            if self.broken:
                yield Done(rid, reason)
        finally:
            self._running -= 1
            self._aborted.discard(rid)

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    async def load(self) -> dict[str, float]:
        return {"running_requests": float(self._running), "queued_requests": 0.0}

    async def health(self) -> bool:
        return not self.closed  # it never goes down (only the step-level fake crashes)

    async def close(self) -> None:
        self.closed = True
