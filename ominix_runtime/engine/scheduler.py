"""Step scheduler for one worker group: synchronous, no awaits, no I/O (vLLM v1 style).

Every request has ``num_computed_tokens``; each step grants it ``num_scheduled_tokens`` so that computed
catches up with its known tokens (prompt + outputs). That one rule covers chunked prefill, prefix hits,
resume after preemption and decode. ``schedule()`` serves running requests first (priority class, then
arrival), then admits waiting ones while the token budget, ``max_running_requests`` and KV allow.
``update(step, result)`` turns a worker's StepResult into per-request events and applies stop conditions.
The policy rules (budget, chunking, priority, preemption victim, anti-starvation, overlap) are written out
in docs/SCHEDULER.md.

Overlap (steps in flight). The driver may send step N+1 before step N's result is back. Hence:

- ``num_computed_tokens`` advances at schedule time (optimistically), and a step that computes a request's
  last known token adds one *placeholder* output (``num_placeholders``): the worker samples that token and
  keeps it, so the next step can schedule the decode of that token without knowing its value.
- ``update()`` replaces placeholders by the real tokens, in step order. Outputs of requests that ended in
  the meantime (stop, abort, deadline) are discarded; their KV was freed at once, which is safe because the
  worker runs steps in order and drops a request (``finished_request_ids``) before the next step that may
  reuse its blocks.
- A request preempted while a step of its is in flight stays PREEMPTED (not eligible) until those steps
  return; the tokens they carry still count as output and are fed back when it resumes.
- New prefix-cache entries are registered only after a step is fully built, so a request never hits a block
  that the same step is still writing.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ominix_runtime.contract import (
    NULL_BLOCK_ID,
    BackendCapability,
    BatchPlan,
    DecodeStep,
    Done,
    Error,
    FinishReason,
    GenerateRequest,
    InvalidArgument,
    NewRequestData,
    OminixError,
    PrefillDone,
    RequestLimits,
    RequestOutput,
    RequestState,
    RunningRequestData,
    RuntimeErrorKind,
    StepResult,
    Token,
    Usage,
    WorkerEvent,
    terminal_state_for,
    validate_request,
)
from ominix_runtime.engine.config import SchedulerConfig
from ominix_runtime.engine.kv_registry import KVRegistry, PrefixHit
from ominix_runtime.engine.request import EngineRequest
from ominix_runtime.engine.stats import SchedulerCounters
from ominix_runtime.engine.waiting_queue import WaitingQueue

# A passed deadline is a failure (the proto counts timeouts as failed), a cancellation an abort.
_ABORT_LIKE = (RuntimeErrorKind.CANCELLED,)


@dataclass(slots=True)
class _Scheduled:
    req: EngineRequest
    num_tokens: int
    expects_sample: bool  # this step computes the request's last known token, so the worker samples one


def _fits(available: Sequence[int], *demands: Sequence[int]) -> bool:
    """Per KV group: whether the available blocks cover the sum of the demands."""
    return all(a >= sum(d) for a, *d in zip(available, *demands, strict=True))


def arrival_on_clock(request: GenerateRequest, now: float) -> float:
    """When ``request`` arrived, on a clock that reads ``now``: its ``arrival_time``, stamped by the front
    before tokenization (the deadline and the client's PrefillDone.ttft_seconds count from it, so run reports
    do too), or ``now`` when it has none or one after ``now`` (stamped on another clock).

    In the engine the stamp and the clock are both ``time.monotonic()``: GenerateRequest's default, what the
    fronts stamp (in a front process too: the front link never leaves the host, and CLOCK_MONOTONIC is one
    clock for all of its processes) and what every group times with. A replay stamps arrivals on its
    simulated clock, the one its scheduler reads.
    """
    arrival = request.arrival_time
    return arrival if 0.0 < arrival <= now else now


class Scheduler:
    """Policy core of one worker group. See the module docstring for the overlap rules.

    ``clock`` times requests (queue, first token, end) for run reports; requests' ``arrival_time`` is read on
    it (see :func:`arrival_on_clock`). Scheduling order is admission order (``arrival_seq``), whatever the
    clocks say.
    """

    def __init__(
        self,
        capability: BackendCapability,
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        seed: int | None = None,
        counters: SchedulerCounters | None = None,
    ) -> None:
        config = config or SchedulerConfig()
        self.capability = capability
        self.config = config
        self.worker_id = capability.worker_id
        self.clock = clock
        self.registry = KVRegistry(
            capability.worker_id,
            min(capability.kv_num_blocks, config.max_kv_blocks or capability.kv_num_blocks),
            capability.kv_block_size,
            enable_prefix_caching=config.enable_prefix_caching and capability.supports_prefix_caching,
            layout=capability.kv_groups,
            whole_prompt_hits=capability.supports_whole_prompt_hits,
        )
        self.max_batch_tokens = min(
            config.max_batch_tokens or capability.max_batch_tokens, capability.max_batch_tokens
        )
        self.max_running_requests = min(
            config.max_running_requests or capability.max_running_requests, capability.max_running_requests
        )
        # Never below max_running_requests: a step of decodes alone always fits. (Running prompt chunks of a
        # higher class or earlier arrival still go first, as under max_batch_tokens.)
        self.max_batch_tokens_with_decodes = min(
            max(config.max_batch_tokens_with_decodes or self.max_batch_tokens, self.max_running_requests),
            self.max_batch_tokens,
        )
        # A burst's budget (see SchedulerConfig): at least the budget with decodes, at most max_batch_tokens.
        self.max_batch_tokens_in_burst = self.max_batch_tokens_with_decodes
        if config.burst_backlog_tokens > 0 and config.max_batch_tokens_in_burst > 0:
            self.max_batch_tokens_in_burst = min(
                max(config.max_batch_tokens_in_burst, self.max_batch_tokens_with_decodes),
                self.max_batch_tokens,
            )
        self.chunked_prefill = config.enable_chunked_prefill and capability.supports_chunked_prefill
        self.max_model_len = capability.model.max_model_len
        self.vocab_size = capability.model.vocab_size
        self.eos_token_ids = frozenset(capability.model.eos_token_ids)
        self.waiting = WaitingQueue()
        self.running: dict[str, EngineRequest] = {}
        self.requests: dict[str, EngineRequest] = {}  # every live request (waiting, running, preempted)
        # The owning group passes its own counters so that they outlive a scheduler replaced on reconnect.
        self.counters = counters if counters is not None else SchedulerCounters()
        self.finished: list[EngineRequest] = []  # ended requests, drained by the group (for its run reports)
        self.last_plan: BatchPlan | None = None
        self._pending_finished_ids: list[str] = []
        self._schedule_events: list[WorkerEvent] = []  # of requests schedule() ended; see take_events()
        self._inflight: dict[int, list[_Scheduled]] = {}
        self._next_step_id = 1
        self._admission_wait_steps = 0  # steps in a row that backlog_admission_slots held admission
        self._arrival_seq = 0
        self._rng = random.Random(seed)

    # ---- admission ------------------------------------------------------------------------------------

    def validate(self, req: GenerateRequest) -> None:
        """Raise OminixError when ``req`` can never run on this worker group."""
        validate_request(
            req,
            RequestLimits(
                vocab_size=self.vocab_size,
                max_model_len=self.max_model_len,
                kv_capacity_tokens=self.registry.max_request_tokens(self.max_batch_tokens),
                holder=f"worker {self.worker_id}",
                needs_token_ids=True,
            ),
        )
        # Without chunked prefill a prompt is computed in one step, so one over the step budget never runs.
        n = len(req.prompt_token_ids)
        if n > self.max_batch_tokens and not self.chunked_prefill:
            raise InvalidArgument(
                f"the prompt has {n} tokens; worker {self.worker_id} computes at most {self.max_batch_tokens} "
                "tokens per step (max_batch_tokens) and chunked prefill is off"
            )

    def add_request(self, req: GenerateRequest) -> None:
        """Admit ``req`` to the waiting queue, or raise OminixError (nothing changes then)."""
        try:
            if req.request_id in self.requests:
                raise InvalidArgument(f"request id {req.request_id!r} is already in use")
            self.validate(req)
        except OminixError:
            self.counters.rejected += 1
            raise
        seed = req.sampling.seed if req.sampling.seed is not None else self._rng.getrandbits(63)
        self._arrival_seq += 1
        ereq = EngineRequest(
            request=req,
            arrival_seq=self._arrival_seq,
            effective_seed=seed,
            all_token_ids=list(req.prompt_token_ids),
            num_prompt_tokens=len(req.prompt_token_ids),
            queued_time=arrival_on_clock(req, self.clock()),
        )
        self.requests[req.request_id] = ereq
        self.waiting.push_back(ereq)
        self.counters.accepted += 1
        self.counters.prompt_tokens += ereq.num_prompt_tokens

    # ---- queries --------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_inflight_steps(self) -> int:
        return len(self._inflight)

    def drop_inflight(self) -> None:
        """Forget steps that will never be answered (the worker is gone); their requests must be ended."""
        for entries in self._inflight.values():
            for entry in entries:
                entry.req.num_inflight_steps -= 1
                if entry.expects_sample:
                    entry.req.num_placeholders -= 1
        self._inflight.clear()

    def evict_all(self) -> list[EngineRequest]:
        """Take every live request out of this (dead) group, in scheduling order, without ending them.

        Call after :meth:`drop_inflight`. Leases are released so the registry stays consistent; the caller
        either hands each request to another group (:meth:`adopt`) or ends it (:meth:`fail_evicted`).
        """
        evicted = sorted(self.requests.values(), key=lambda r: r.order_key)
        for req in evicted:
            if self.running.pop(req.request_id, None) is not None:
                self.registry.free(req.request_id)
            self.waiting.remove(req.request_id)
            req.worker_has_state = False
        self.requests.clear()
        self._pending_finished_ids.clear()
        return evicted

    def fail_evicted(self, req: EngineRequest, error: tuple[RuntimeErrorKind, str]) -> list[WorkerEvent]:
        """End a request taken out by :meth:`evict_all` that no other group could take."""
        events: list[WorkerEvent] = []
        self._end(req, events, FinishReason.ERROR, error)
        return events

    def adopt(self, old: EngineRequest) -> None:
        """Resume a request evicted from a failed group: recompute prompt + the outputs already streamed.

        The effective seed is kept, and the worker seeds by output position, so the tokens that follow are
        the ones the failed worker would have sampled. Raises OminixError when it cannot run here.
        """
        req = old.request
        if req.request_id in self.requests:
            raise InvalidArgument(f"request id {req.request_id!r} is already in use")
        self.validate(req)
        self._arrival_seq += 1
        ereq = EngineRequest(
            request=req,
            arrival_seq=self._arrival_seq,
            effective_seed=old.effective_seed,
            all_token_ids=list(old.all_token_ids),
            num_prompt_tokens=old.num_prompt_tokens,
            queued_time=old.queued_time,
            num_cached_tokens=old.num_cached_tokens,
            num_preemptions=old.num_preemptions + (old.state != RequestState.WAITING),
            prefill_reported=old.prefill_reported,
            first_scheduled_time=old.first_scheduled_time,
            first_token_time=old.first_token_time,
            last_token_time=old.last_token_time,
            token_gaps=old.token_gaps,
        )
        self.requests[req.request_id] = ereq
        self.waiting.push_back(ereq)
        self.counters.resumed += 1

    def take_events(self) -> list[WorkerEvent]:
        """Events of requests that ``schedule()`` ended (one it could never compute), for the caller to
        deliver after each ``schedule()`` call."""
        events, self._schedule_events = self._schedule_events, []
        return events

    def has_work(self) -> bool:
        return bool(self.requests) or bool(self._pending_finished_ids)

    def prefix_hit_tokens(self, token_ids: list[int]) -> int:
        return self.registry.find_prefix(token_ids).num_tokens

    def check_integrity(self) -> None:
        """Registry invariants plus: leases belong exactly to running requests."""
        self.registry.check_integrity()
        leased = set(self.registry.leased_request_ids())
        running = set(self.running)
        if leased != running:
            raise AssertionError(
                f"KV leases {sorted(leased - running)} / running {sorted(running - leased)} differ"
            )
        for rid, req in self.running.items():
            lease = self.registry.lease(rid)
            assert lease is not None
            if lease.num_tokens_reserved < req.num_computed_tokens:
                raise AssertionError(
                    f"request {rid} computed {req.num_computed_tokens} tokens beyond its lease"
                )

    # ---- schedule -------------------------------------------------------------------------------------

    def schedule(self) -> DecodeStep | None:
        """Build the next step, or None when there is nothing to send."""
        step_id = self._next_step_id
        scheduled: list[_Scheduled] = []
        new_requests: list[NewRequestData] = []
        running_requests: list[RunningRequestData] = []
        preempted: list[str] = []

        self._preempt_for_priority(step_id, preempted)
        num_preempted_for_priority = len(preempted)
        budget = self.max_batch_tokens
        in_burst = False
        if self.max_batch_tokens_with_decodes < budget and self.chunked_prefill and self._any_decoding():
            budget = self.max_batch_tokens_with_decodes
            if self.max_batch_tokens_in_burst > budget and self._taking_in_a_burst():
                budget = self.max_batch_tokens_in_burst
                in_burst = True
        plan = BatchPlan(step_id=step_id, token_budget=budget)

        order = sorted(self.running.values(), key=lambda r: r.order_key)
        kv_blocked = False
        several_groups = self.registry.num_groups > 1
        for idx, req in enumerate(order):
            if budget <= 0:
                break
            if req.request_id not in self.running:
                continue  # preempted earlier in this loop
            n = self._num_to_schedule(req, budget)
            if n <= 0:
                continue
            table_lengths = self._table_lengths(req) if several_groups else []
            new_blocks = self._allocate_running(req, n)
            while new_blocks is None:
                victim = self._pick_victim(order, idx, step_id)
                if victim is req and self._has_later_candidate(order, idx):
                    # Everything after it is protected: pause (keep its KV) rather than recompute it.
                    kv_blocked = True
                    break
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
                new_blocks = self._allocate_running(req, n)
            if new_blocks is None:
                continue
            group_blocks = self._appended_group_blocks(req, table_lengths) if several_groups else []
            running_requests.append(RunningRequestData(req.request_id, new_blocks, n, group_blocks))
            self._commit(req, n, scheduled, plan)
            budget -= n

        # No admissions after a KV shortage among running requests: it would only feed the thrash. A slot
        # just freed for a higher class is filled at once, whatever backlog_admission_slots says.
        kv_short = len(preempted) > num_preempted_for_priority or kv_blocked
        if not kv_short and (
            num_preempted_for_priority > 0 or not self._hold_admission_this_step(budget, plan)
        ):
            self._admission_wait_steps = 0
            limit_left = self._prefill_limit_left(budget, plan)
            self._admit_waiting(step_id, budget, limit_left, scheduled, new_requests, plan)

        finished_ids = self._pending_finished_ids
        self._pending_finished_ids = []
        if not scheduled and not finished_ids:
            return None
        if in_burst:
            self.counters.burst_budget_steps += 1
        self._next_step_id += 1
        for s in scheduled:
            req = s.req
            if self.registry.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens):
                req.registrations.append((step_id, self.registry.registered_blocks(req.request_id)))
        if scheduled:
            self._inflight[step_id] = scheduled
        plan.num_new_requests = len(new_requests)
        plan.num_running_requests = len(running_requests)
        plan.preempted_request_ids = preempted
        self.last_plan = plan
        return DecodeStep(step_id, new_requests, running_requests, finished_ids)

    def _taking_in_a_burst(self) -> bool:
        """Every waiting request has a free running slot, together they hold at least ``burst_backlog_tokens``
        known tokens (prompts, with a resumed request's outputs; prefix hits not subtracted), the free or
        reusable (prefix-cached) KV holds them all beside what the running requests still need, and no running
        request is of a higher class than the first of them."""
        # More waiting than can run: the first tokens of those beyond the slots wait for requests to end,
        # which longer steps do not hasten.
        if not self.waiting or len(self.waiting) > self.max_running_requests - len(self.running):
            return False
        if self.waiting.num_waiting_tokens < self.config.burst_backlog_tokens:
            return False
        # A higher class's streams would pay for a lower one's first tokens.
        head = next(iter(self.waiting))
        if any(r.priority < head.priority for r in self.running.values()):
            return False
        # Requests that must wait for KV, not for slots: longer steps would only reach that limit sooner. A
        # sliding group holds a prompt's window and one chunk; a shared prefix counts once per request here.
        need = [0] * self.registry.num_groups
        for req in self.waiting:
            n = len(req.all_token_ids)
            for g, blocks in enumerate(
                self.registry.footprint(n, max(0, n - self.max_batch_tokens_in_burst))
            ):
                need[g] += blocks
        return _fits(self.registry.available_blocks(), need, self._running_growth_blocks())

    def _any_decoding(self) -> bool:
        """Whether a running request is past its prompt with at most one token left to compute, and its
        sample still usable: the step will carry its decode (unless KV runs short). A resumed request
        recomputing its outputs is not decoding yet."""
        return any(
            r.num_computed_tokens >= max(r.num_prompt_tokens, r.num_tokens - 1)
            and not self._sample_unusable(r)
            for r in self.running.values()
        )

    def _sample_unusable(self, req: EngineRequest) -> bool:
        """The token a decode of ``req`` would sample now could not be used: max_tokens or max_model_len is
        already covered by tokens in flight."""
        return (
            req.num_output_tokens + req.num_placeholders >= req.request.sampling.max_tokens
            or req.num_tokens >= self.max_model_len
        )

    def _allocate_running(self, req: EngineRequest, n: int) -> list[int] | None:
        return self.registry.allocate(
            req.request_id, req.num_computed_tokens + n, num_computed_tokens=req.num_computed_tokens
        )

    def _table_lengths(self, req: EngineRequest) -> list[int]:
        lease = self.registry.lease(req.request_id)
        return [len(t) for t in lease.block_tables] if lease else []

    def _appended_group_blocks(self, req: EngineRequest, before: list[int]) -> list[list[int]]:
        """Blocks appended this step to the tables of KV groups 1..n-1 (empty for one group)."""
        lease = self.registry.lease(req.request_id)
        if lease is None or len(lease.block_tables) == 1:
            return []
        return [list(t[n:]) for t, n in zip(lease.block_tables[1:], before[1:], strict=True)]

    def _num_to_schedule(self, req: EngineRequest, budget: int) -> int:
        remaining = req.num_tokens - req.num_computed_tokens
        if remaining <= 0:
            return 0
        if remaining == 1 and req.num_computed_tokens >= req.num_prompt_tokens and self._sample_unusable(req):
            return 0  # a decode whose token could no longer be used
        n = min(remaining, budget)
        if n < remaining and not self.chunked_prefill:
            return 0
        return n

    def _commit(self, req: EngineRequest, n: int, scheduled: list[_Scheduled], plan: BatchPlan) -> None:
        is_prefill = n > 1 or req.num_computed_tokens < req.num_prompt_tokens
        req.num_computed_tokens += n
        expects_sample = req.num_computed_tokens == req.num_tokens
        if expects_sample:
            req.num_placeholders += 1
        req.num_inflight_steps += 1
        scheduled.append(_Scheduled(req, n, expects_sample))
        self.counters.computed_tokens += n
        if is_prefill:
            plan.num_prefill_tokens += n
        else:
            plan.num_decode_tokens += n

    def _admissible_waiting(self) -> Iterator[EngineRequest]:
        """Waiting requests in scheduling order, less those preempted with results still in flight (they
        resume once their results are back)."""
        return (r for r in self.waiting if r.num_inflight_steps == 0)

    def _hold_admission_this_step(self, budget: int, plan: BatchPlan) -> bool:
        """Whether this step leaves the waiting requests waiting for more free running slots
        (``backlog_admission_slots``), counting the step when it does.

        Only under a backlog (more admissible waiting requests, those without results in flight, than free
        slots), in a step that carries decodes and has budget left, with a slot free but fewer than the
        setting (at most ``max_running_requests`` - 1), for at most ``backlog_admission_max_wait_steps`` steps
        in a row, and never while the first admissible request is of a higher class than some running one
        (with no slot free it would displace that one at once)."""
        # More slots than can be free while something decodes would only delay every admission.
        slots = min(self.config.backlog_admission_slots, self.max_running_requests - 1)
        free = self.max_running_requests - len(self.running)
        if (
            slots <= 1
            or plan.num_decode_tokens == 0
            or budget <= 0
            or not 0 < free < slots
            or self._admission_wait_steps >= self.config.backlog_admission_max_wait_steps
        ):
            return False
        admissible = self._admissible_waiting()
        head = next(admissible, None)
        if head is None or sum(1 for _ in itertools.islice(admissible, free)) < free:
            return False  # the head and at most free - 1 others: every one of them has a slot
        if any(r.priority > head.priority for r in self.running.values()):
            return False
        self._admission_wait_steps += 1
        self.counters.admission_held_steps += 1
        return True

    def _prefill_limit_left(self, budget: int, plan: BatchPlan) -> int | None:
        """What the prefill limit beside decodes leaves this step for prompts it has not held back yet, or
        None when it does not apply.

        It applies when the step carries decodes and the waiting requests are few enough to go in this step
        and the next one under it: their tokens within what is left of ``prefill_tokens_beside_decodes``
        after the running requests' prefill chunks plus the whole limit again (``prefill_backlog_tokens``
        instead, when set; and within ``budget``), their number within the free running slots. A prompt
        held back by it goes beside it from the next step on (``_admit_waiting``), so it costs a prompt one
        step at most. Only with chunked prefill: without it a prompt longer than the limit could never be
        admitted while anything decodes."""
        limit = self.config.prefill_tokens_beside_decodes
        if limit <= 0 or not self.chunked_prefill or plan.num_decode_tokens == 0:
            return None
        left = max(0, limit - plan.num_prefill_tokens)
        if left >= budget:
            return None
        # More waiting than free slots (preempted ones with results in flight counted too): a backlog, and
        # the count below stays short.
        if len(self.waiting) > self.max_running_requests - len(self.running):
            return None
        # More waiting tokens than this step and the next can take under the limit (or than
        # ``prefill_backlog_tokens`` past this step's share): holding them back would only queue them until the
        # queue is released at once. With the whole budget as this threshold, at
        # 32 req/s on an H200 a prompt waited in nearly every step and ITL p50 / p99 went from 17 / 161 ms
        # without the limit to 36 / 200 ms (bench/RESULTS.md, 2026-11-30).
        threshold = min(budget, left + (self.config.prefill_backlog_tokens or limit))
        waiting_tokens = 0
        for req in self.waiting:  # stops as soon as the backlog shows; prefix hits not subtracted
            waiting_tokens += len(req.all_token_ids)
            if waiting_tokens > threshold:
                return None
        return left

    def _admit_waiting(
        self,
        step_id: int,
        budget: int,
        limit_left: int | None,
        scheduled: list[_Scheduled],
        new_requests: list[NewRequestData],
        plan: BatchPlan,
    ) -> None:
        """Admit waiting requests in order while ``budget``, the running slots and KV allow. ``limit_left``
        (``_prefill_limit_left``): the tokens prompts not yet held back may take; one that gets none is marked
        held and from then on takes only ``budget``."""
        blocked: list[EngineRequest] = []  # waiting requests skipped this step for lack of KV or budget
        admitted: list[EngineRequest] = []
        too_long: list[tuple[EngineRequest, int]] = []  # (request, tokens it must compute in one step)
        limit_applies = limit_left is not None
        limit = limit_left or 0
        for req in self.waiting:
            if budget <= 0 or len(self.running) >= self.max_running_requests:
                break
            if req.num_inflight_steps > 0:
                continue  # preempted with results still in flight: resume once they are back
            room = budget
            limited = limit_applies and not req.held_by_prefill_limit
            if limited:
                if limit <= 0:
                    req.held_by_prefill_limit = True
                    if req.num_times_bypassed >= self.config.max_bypass_steps:
                        break  # anti-starvation, as for KV below
                    blocked.append(req)  # a held request admitted after it bypasses it
                    continue
                room = min(budget, limit)
            hit = self.registry.find_prefix(req.all_token_ids)
            remaining = req.num_tokens - hit.num_tokens
            n = min(remaining, room)
            blocks = None
            if n == remaining or self.chunked_prefill:
                blocks = self.registry.allocate(
                    req.request_id, hit.num_tokens + n, hit, num_computed_tokens=hit.num_tokens,
                    num_known_tokens=len(req.all_token_ids),
                )  # fmt: skip
            if blocks is None:
                if remaining > self.max_batch_tokens and not self.chunked_prefill:
                    # validate() refuses such prompts, but a preempted or adopted request recomputes its
                    # outputs too. Left waiting it would never run, and past max_bypass_steps would block
                    # everything behind it.
                    too_long.append((req, remaining))
                    continue
                if req.num_times_bypassed >= self.config.max_bypass_steps:
                    break  # anti-starvation: nothing behind it is admitted until it fits
                blocked.append(req)
                continue
            for b in blocked:  # they were bypassed by a later request in this step
                b.num_times_bypassed += 1
            blocked.clear()
            admitted.append(req)
            self._start(req, hit, step_id)
            lease = self.registry.lease(req.request_id)
            assert lease is not None
            new_requests.append(
                NewRequestData(
                    request_id=req.request_id,
                    prompt_token_ids=req.all_token_ids[: req.num_prompt_tokens],
                    sampling=req.request.sampling,
                    kv_block_ids=list(lease.block_tables[0]),
                    num_computed_tokens=hit.num_tokens,
                    num_scheduled_tokens=n,
                    effective_seed=req.effective_seed,
                    output_token_ids=req.output_token_ids,
                    traceparent=req.request.traceparent,
                    group_kv_block_ids=[list(t) for t in lease.block_tables[1:]],
                    num_cached_kv_tokens=hit.num_kv_tokens if hit.whole else 0,
                )
            )
            self._commit(req, n, scheduled, plan)
            budget -= n
            if limited:
                limit -= n
        for req in admitted:  # removed after the loop: the queue is not modified while iterated
            self.waiting.remove(req.request_id)
        for req, remaining in too_long:
            error = (
                RuntimeErrorKind.KV_CAPACITY_EXCEEDED,
                f"request {req.request_id} must compute {remaining} tokens in one step (its prompt and the "
                f"outputs it recomputes) but worker {self.worker_id} computes at most {self.max_batch_tokens} "
                "per step (max_batch_tokens) and chunked prefill is off",
            )
            self._end(req, self._schedule_events, FinishReason.ERROR, error)

    def _start(self, req: EngineRequest, hit: PrefixHit, step_id: int) -> None:
        req.prefix_blocks = hit.group_block_ids
        self.registry.prefix_query_tokens += len(req.all_token_ids)
        self.registry.prefix_hit_tokens += hit.num_tokens
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self.clock()
            req.num_cached_tokens = hit.num_tokens
            self.counters.cached_tokens += hit.num_tokens
        if req.state == RequestState.PREEMPTED:
            req.transition(RequestState.WAITING)
        req.transition(RequestState.PREFILL)
        if req.num_preemptions:
            req.protected_until_step = step_id + self.config.preemption_protection_steps
        req.num_times_bypassed = 0
        req.held_by_prefill_limit = False
        req.num_computed_tokens = hit.num_tokens
        req.worker_has_state = True
        self.running[req.request_id] = req

    # ---- preemption -----------------------------------------------------------------------------------

    def _pick_victim(self, order: list[EngineRequest], start: int, step_id: int) -> EngineRequest:
        """Lowest priority, then latest arrival, among requests not yet scheduled in this step.

        Requests recently resumed after a preemption are passed over while any other candidate exists.
        ``order[start]`` (the request asking for KV) is a candidate too: it may have to yield itself (or,
        when only protected requests follow it, pause for this step; the caller decides).
        """
        fallback: EngineRequest | None = None
        for cand in reversed(order[start:]):
            if cand.request_id not in self.running:
                continue
            if cand.protected_until_step <= step_id:
                return cand
            if fallback is None:
                fallback = cand
        assert fallback is not None
        return fallback

    def _has_later_candidate(self, order: list[EngineRequest], start: int) -> bool:
        return any(c.request_id in self.running for c in order[start + 1 :])

    def _preempt_for_priority(self, step_id: int, preempted: list[str]) -> None:
        """Let the first eligible waiting request displace running requests of a strictly lower class.

        Only when displacing them all would make room for it; otherwise they would be preempted for nothing
        (and re-admitted and preempted again, step after step).
        """
        head = next(self._admissible_waiting(), None)
        if head is None or not self.running:
            return
        # Per KV group: what the head's first chunk would take (a sliding group's window is part of it).
        need = self.registry.footprint(min(head.num_tokens, self.max_batch_tokens))

        def lacks(available: tuple[int, ...], growth: tuple[int, ...]) -> bool:
            return not _fits(available, need, growth)

        def short_of_room() -> bool:
            return len(self.running) >= self.max_running_requests or lacks(
                self.registry.available_blocks(), self._running_growth_blocks()
            )

        if not short_of_room():
            return
        lower = [r for r in self.running.values() if r.priority > head.priority]
        if not lower or len(self.running) - len(lower) >= self.max_running_requests:
            return
        kept = [r for r in self.running.values() if r.priority <= head.priority]
        reclaimable = [0] * self.registry.num_groups
        for r in lower:
            for g, held in enumerate(self._live_blocks(r)):
                reclaimable[g] += held
        available = tuple(a + r for a, r in zip(self.registry.available_blocks(), reclaimable, strict=True))
        if lacks(available, self._running_growth_blocks(kept)):
            return
        while self.running and short_of_room():
            victim = max(self.running.values(), key=lambda r: r.order_key)
            if victim.priority <= head.priority:
                return
            self._preempt(victim)
            preempted.append(victim.request_id)

    def _live_blocks(self, req: EngineRequest) -> tuple[int, ...]:
        """Per KV group: blocks ``req`` holds now (slid-out entries excluded)."""
        lease = self.registry.lease(req.request_id)
        if lease is None:
            return (0,) * self.registry.num_groups
        return tuple(sum(1 for b in t if b != NULL_BLOCK_ID) for t in lease.block_tables)

    def _running_growth_blocks(self, requests: list[EngineRequest] | None = None) -> tuple[int, ...]:
        """Per KV group: blocks these running requests (all by default) would take this step if each got all
        it asks for."""
        total = [0] * self.registry.num_groups
        for req in self.running.values() if requests is None else requests:
            footprint = self.registry.footprint(req.num_tokens, req.num_computed_tokens)
            for g, (want, have) in enumerate(zip(footprint, self._live_blocks(req), strict=True)):
                total[g] += max(0, want - have)
        return tuple(total)

    def _preempt(self, req: EngineRequest) -> None:
        self.registry.free(req.request_id)
        del self.running[req.request_id]
        req.num_computed_tokens = 0
        req.registrations.clear()  # of the lease just freed: the next one registers from its start
        req.written_blocks = ()
        req.transition(RequestState.PREEMPTED)
        req.num_preemptions += 1
        req.num_times_bypassed = 0
        self.counters.preemptions += 1
        self._drop_worker_state(req)
        self.waiting.push_front(req)
        if req.num_inflight_steps == 0:
            req.transition(RequestState.WAITING)

    def _fail_from_worker(
        self, req: EngineRequest, events: list[WorkerEvent], error: tuple[RuntimeErrorKind, str]
    ) -> None:
        """End ``req`` on a failure the worker reported for it, after taking its unwritten KV out of reach."""
        self._uncache_unwritten(req)
        self._end(req, events, FinishReason.ERROR, error)

    def _uncache_unwritten(self, req: EngineRequest) -> None:
        """The blocks ``req`` registered for steps the worker has not answered leave the prefix cache, with
        every block chained on them (KV the worker may never write, for a request it failed), and requests
        that read them lose the outputs of their steps in flight: running ones are preempted to compute their
        prompts again, and a preempted one with steps still out drops what they bring. Only worker-reported
        failures come here: a deadline, an abort or a shutdown leaves the steps already sent to compute."""
        taken = self.registry.uncache_unwritten(req.request_id, req.written_blocks)
        if not taken:
            return
        for rid in self.registry.leases_holding(taken):
            other = self.running.get(rid)
            if other is not None and other is not req:
                other.num_void_inflight_steps = other.num_inflight_steps
                self._preempt(other)
        for other in self.requests.values():
            if other.num_inflight_steps and other.request_id not in self.running and other is not req:
                hit = {(g, b) for g, blocks in enumerate(other.prefix_blocks) for b in blocks}
                if not hit.isdisjoint(taken):
                    other.num_void_inflight_steps = other.num_inflight_steps

    def _confirm_written(self, req: EngineRequest, step_id: int) -> None:
        """The worker answered ``step_id`` for ``req``: the blocks registered up to its build are written."""
        registrations = req.registrations
        while registrations and registrations[0][0] <= step_id:
            req.written_blocks = registrations.pop(0)[1]

    def _drop_worker_state(self, req: EngineRequest) -> None:
        if req.worker_has_state:
            self._pending_finished_ids.append(req.request_id)
            req.worker_has_state = False

    # ---- results --------------------------------------------------------------------------------------

    def update(self, step: DecodeStep, result: StepResult) -> list[WorkerEvent]:
        """Apply the result of ``step``; returns per-request events in order."""
        entries = self._inflight.pop(step.step_id, [])
        if result.step_id != step.step_id:
            raise ValueError(f"result for step {result.step_id} given for step {step.step_id}")
        self.counters.steps += 1
        outputs = {o.request_id: o for o in result.outputs}
        events: list[WorkerEvent] = []
        for entry in entries:
            req = entry.req
            req.num_inflight_steps -= 1
            out = outputs.pop(req.request_id, None)
            if req.is_finished:
                self.counters.discarded_outputs += out is not None
                continue
            if entry.expects_sample:
                req.num_placeholders -= 1
            if req.num_void_inflight_steps:
                req.num_void_inflight_steps -= 1
                self.counters.discarded_outputs += out is not None
            elif out is None:
                self._fail_from_worker(
                    req, events, (RuntimeErrorKind.INTERNAL, "the worker returned no output")
                )
            elif out.error_kind is not None:
                self._fail_from_worker(req, events, (out.error_kind, out.error_message or "worker error"))
            elif out.sampled_token_id is None:
                if entry.expects_sample:
                    self._fail_from_worker(
                        req, events, (RuntimeErrorKind.INTERNAL, "the worker sampled no token")
                    )
                elif req.registrations:
                    self._confirm_written(req, step.step_id)
            elif not entry.expects_sample:
                self._fail_from_worker(req, events, (RuntimeErrorKind.INTERNAL, "token sampled mid-prefill"))
            else:
                if req.registrations:
                    self._confirm_written(req, step.step_id)
                self._append_token(req, out.sampled_token_id, out, events)
            if req.state == RequestState.PREEMPTED and req.num_inflight_steps == 0 and not req.is_finished:
                req.transition(RequestState.WAITING)
        self.counters.unexpected_outputs += len(outputs)
        return events

    def _append_token(
        self, req: EngineRequest, token_id: int, out: RequestOutput, events: list[WorkerEvent]
    ) -> None:
        req.all_token_ids.append(token_id)
        self.counters.generated_tokens += 1
        now = self.clock()
        if req.last_token_time is not None:
            req.token_gaps.append(now - req.last_token_time)
        req.last_token_time = now
        if not req.prefill_reported:
            req.prefill_reported = True
            req.first_token_time = now
            events.append(PrefillDone(req.request_id, req.num_prompt_tokens, req.num_cached_tokens))
        if req.state == RequestState.PREFILL:
            req.transition(RequestState.DECODE)
        logprobs = out.logprobs
        reason = self._stop_reason(req, token_id)
        # A stop token (a stop_token_ids entry or an eos) that ends the request stays an output token; the
        # front leaves its text out, as vLLM does (special tokens' text is skipped anyway).
        by_stop_token = reason == FinishReason.STOP
        events.append(
            Token(
                req.request_id,
                [token_id],
                [logprobs] if logprobs is not None else [],
                ended_by_stop_token=by_stop_token,
            )
        )
        if reason is not None:
            self._end(req, events, reason)

    def _stop_reason(self, req: EngineRequest, token_id: int) -> FinishReason | None:
        sp = req.request.sampling
        num_out = req.num_output_tokens
        if num_out >= sp.min_tokens and (
            token_id in sp.stop_token_ids or (not sp.ignore_eos and token_id in self.eos_token_ids)
        ):
            return FinishReason.STOP
        if num_out >= sp.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    # ---- ending requests ------------------------------------------------------------------------------

    def abort_request(
        self,
        request_id: str,
        reason: FinishReason = FinishReason.ABORT,
        error: tuple[RuntimeErrorKind, str] | None = None,
    ) -> list[WorkerEvent]:
        """End a live request now (KV freed at once); returns its terminal events, or [] if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        events: list[WorkerEvent] = []
        self._end(req, events, reason, error)
        return events

    def finish_request(
        self, request_id: str, reason: FinishReason = FinishReason.STOP, matched_stop: str = ""
    ) -> list[WorkerEvent]:
        """End a live request normally (the engine found a stop string); [] if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        events: list[WorkerEvent] = []
        self._end(req, events, reason, None, matched_stop)
        return events

    def _end(
        self,
        req: EngineRequest,
        events: list[WorkerEvent],
        reason: FinishReason,
        error: tuple[RuntimeErrorKind, str] | None = None,
        matched_stop: str = "",
    ) -> None:
        if error is not None:
            target = RequestState.ABORTED if error[0] in _ABORT_LIKE else RequestState.FAILED
            reason = FinishReason.ABORT if target == RequestState.ABORTED else FinishReason.ERROR
        else:
            target = terminal_state_for(reason)
        req.transition(target)
        req.finish_reason = reason
        req.error_kind = error[0] if error else None
        req.finished_time = self.clock()
        rid = req.request_id
        self.requests.pop(rid, None)
        self.waiting.remove(rid)
        if self.running.pop(rid, None) is not None:
            if error is None:  # KV of a failed request is not worth sharing
                self.registry.cache_blocks(rid, req.all_token_ids, req.num_computed_tokens)
            self.registry.free(rid)
        self._drop_worker_state(req)
        req.num_placeholders = 0
        events.append(Usage(rid, req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens))
        if error is not None:
            events.append(Error(rid, error[0], error[1]))
        else:
            events.append(Done(rid, reason, matched_stop=matched_stop))
        c = self.counters
        if target == RequestState.FINISHED:
            c.finished += 1
        elif target == RequestState.ABORTED:
            c.aborted += 1
        else:
            c.failed += 1
        self.finished.append(req)
