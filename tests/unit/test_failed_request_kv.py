"""A request the worker fails leaves no block in the prefix cache that may never have been written.

Blocks enter the prefix cache when the step that fills them is built, steps ahead of the worker's answers. A
worker that fails a request computes nothing more for it, so the blocks of its steps still in flight stay
unwritten. The engine takes a failed request's blocks out of the cache when it ends the request, and a
running request that hit them meanwhile computes its prompt again, before any of its results is read.
FakeStepBackend records every block's contents and flags a hit on a block that does not hold the tokens it
is read for.
"""

from __future__ import annotations

import pytest

from ominix_runtime.contract import (
    Done,
    Error,
    FinishReason,
    GenerateRequest,
    RequestOutput,
    RuntimeErrorKind,
    SamplingParams,
    StepResult,
    Token,
    WorkerEvent,
)
from ominix_runtime.contract.request import Priority
from ominix_runtime.engine.config import SchedulerConfig
from ominix_runtime.engine.scheduler import Scheduler
from ominix_runtime.testing.fake_backend import FakeConfig, FakeStepBackend, FakeViolation


def _request(rid: str, prompt: list[int]) -> GenerateRequest:
    return GenerateRequest(rid, list(prompt), SamplingParams(max_tokens=3, seed=1, ignore_eos=True))


def _scheduler(backend: FakeStepBackend) -> Scheduler:
    return Scheduler(backend.capability(), SchedulerConfig(prefill_tokens_beside_decodes=0), seed=1)


def _run_to_end(s: Scheduler, backend: FakeStepBackend) -> list[WorkerEvent]:
    events: list[WorkerEvent] = []
    while s.requests:
        step = s.schedule()
        assert step is not None
        events += s.update(step, backend.execute(step))
    return events


def _tokens(events: list[WorkerEvent], rid: str) -> list[int]:
    return [t for e in events if isinstance(e, Token) and e.request_id == rid for t in e.token_ids]


def test_a_request_failed_with_steps_in_flight_leaves_no_unwritten_block_cached() -> None:
    backend = FakeStepBackend(FakeConfig(kv_block_size=4, kv_num_blocks=32, max_batch_tokens=4, fail_step=1))
    s = _scheduler(backend)
    prompt = list(range(10, 23))  # 13 tokens: chunks [0,4) [4,8) [8,12) [12,13)
    s.add_request(_request("a", prompt))
    first, second = s.schedule(), s.schedule()  # two steps in flight, as the engine keeps them
    assert first is not None and second is not None
    assert any(isinstance(e, Error) for e in s.update(first, backend.execute(first)))  # failed in step 1
    s.update(second, backend.execute(second))  # its chunk [4,8) in step 2: answered, never computed
    s.check_integrity()
    s.add_request(_request("b", prompt))  # the same prompt from another client
    events = _run_to_end(s, backend)
    assert not backend.violations, backend.violations
    assert [e.request_id for e in events if isinstance(e, Done)] == ["b"]
    s.registry.check_quiescent()


def test_a_request_that_hit_a_failed_requests_blocks_computes_its_prompt_again() -> None:
    backend = FakeStepBackend(FakeConfig(kv_block_size=4, kv_num_blocks=64, max_batch_tokens=12, fail_step=1))
    s = _scheduler(backend)
    prompt = list(range(100, 130))  # 30 tokens: [0,12) in step 1, [12,24) in step 2, [24,30) in step 3
    s.add_request(_request("a", prompt))
    first, second = s.schedule(), s.schedule()
    assert first is not None and second is not None
    follower = prompt[:24] + [7, 8, 9]  # hits a's 6 blocks, registered when step 2 was built
    s.add_request(_request("b", follower))
    third = s.schedule()
    assert third is not None and [n.request_id for n in third.new_requests] == ["b"]
    assert third.new_requests[0].num_computed_tokens == 24  # b read a's blocks, [12,24) not yet written
    events = s.update(first, backend.execute(first))  # a fails: its blocks leave the cache, b starts over
    assert [e.request_id for e in events if isinstance(e, Error)] == ["a"]
    assert s.counters.preemptions == 1
    events += s.update(second, backend.execute(second))
    # Step 3 was sent before a's failure was known: the worker reads b's hit of unwritten KV there (what the
    # fake flags), and the engine, which preempted b, discards what came of it.
    with pytest.raises(FakeViolation, match="b: prefix-hit block"):
        backend.execute(third)
    backend.violations.clear()
    events += s.update(third, StepResult(third.step_id))
    events += _run_to_end(s, backend)
    assert not backend.violations, backend.violations
    # b's tokens are those of the same prompt served from scratch by a fresh engine.
    fresh_backend = FakeStepBackend(FakeConfig(kv_block_size=4, kv_num_blocks=64, max_batch_tokens=12))
    fresh = _scheduler(fresh_backend)
    fresh.add_request(_request("b", follower))
    assert _tokens(events, "b") == _tokens(_run_to_end(fresh, fresh_backend), "b")
    assert len(_tokens(events, "b")) == 3
    s.registry.check_quiescent()


def test_a_request_ended_by_its_deadline_leaves_the_prefix_it_wrote_to_those_sharing_it() -> None:
    """Only a failure the worker reports voids KV: a passed deadline (or an abort, or a shutdown) leaves the
    steps already sent to compute, so a shared prefix it wrote stays cached and nobody is preempted."""
    backend = FakeStepBackend(FakeConfig(kv_block_size=4, kv_num_blocks=64, max_batch_tokens=64))
    s = _scheduler(backend)
    system = list(range(100, 132))  # a 32-token prefix shared by every request
    s.add_request(GenerateRequest("a", [*system, 1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True)))
    for _ in range(3):
        step = s.schedule()
        assert step is not None
        s.update(step, backend.execute(step))
    for i in range(4):
        s.add_request(
            GenerateRequest(f"h{i}", [*system, 7, 8, i], SamplingParams(max_tokens=50, ignore_eos=True))
        )
    for _ in range(3):
        step = s.schedule()
        assert step is not None
        s.update(step, backend.execute(step))
    s.abort_request("a", FinishReason.ABORT, (RuntimeErrorKind.TIMEOUT, "the request's deadline passed"))
    assert s.counters.preemptions == 0 and sorted(s.running) == ["h0", "h1", "h2", "h3"]
    assert s.registry.find_prefix([*system, 9]).num_tokens == 32


def test_a_hitter_preempted_before_the_failure_is_read_drops_what_its_steps_in_flight_bring() -> None:
    """b hits a's blocks, then a realtime request preempts b; a's failure comes after: b's step in flight,
    which read KV never written, brings a token that must not be streamed."""
    backend = FakeStepBackend(
        FakeConfig(
            kv_block_size=4, kv_num_blocks=64, max_batch_tokens=12, fail_step=1, max_running_requests=2
        )
    )
    s = _scheduler(backend)
    prompt = list(range(100, 130))

    def request(rid: str, tokens: list[int], priority: Priority) -> GenerateRequest:
        return GenerateRequest(
            rid, tokens, SamplingParams(max_tokens=3, seed=1, ignore_eos=True), priority=priority
        )

    s.add_request(request("a", prompt, Priority.REALTIME))
    first, second = s.schedule(), s.schedule()
    s.add_request(request("b", prompt[:24] + [7, 8, 9, 10, 11, 12], Priority.BATCH))
    third = s.schedule()
    assert third is not None and [n.request_id for n in third.new_requests] == ["b"]
    s.add_request(request("c", [1, 2, 3], Priority.REALTIME))
    s.schedule()
    assert s.last_plan is not None and s.last_plan.preempted_request_ids == ["b"]
    assert first is not None and second is not None
    events = s.update(first, backend.execute(first)) + s.update(second, backend.execute(second))
    # What a worker would bring for b from step 3, computed over the KV never written.
    events += s.update(third, StepResult(third.step_id, [RequestOutput("b", sampled_token_id=42)]))
    assert _tokens(events, "b") == []
    b = s.requests["b"]
    assert b.num_output_tokens == 0 and b.num_void_inflight_steps == 0


def test_blocks_computed_over_a_failed_requests_unwritten_kv_leave_the_cache_whoever_holds_them() -> None:
    """b hits a's blocks and registers two of its own over them, then its client aborts it; a's failure comes
    after. b's blocks, chained on a's, go too: once a's prefix is computed again (the same digests), they would
    otherwise be hits for b's prompt."""
    backend = FakeStepBackend(FakeConfig(kv_block_size=4, kv_num_blocks=64, max_batch_tokens=12, fail_step=1))
    s = _scheduler(backend)
    prompt = list(range(100, 130))
    s.add_request(_request("a", prompt))
    first, second = s.schedule(), s.schedule()
    follower = prompt[:24] + [7, 8, 9, 10, 11, 12, 13, 14, 15]  # a's 6 blocks, then 2 full blocks of its own
    s.add_request(_request("b", follower))
    third, fourth = s.schedule(), s.schedule()
    assert first and second and third and fourth
    s.abort_request("b", FinishReason.ABORT)
    for step in (first, second):
        s.update(step, backend.execute(step))
    with pytest.raises(FakeViolation, match="b: prefix-hit block"):  # the worker reads what a never wrote
        backend.execute(third)
    backend.violations.clear()
    for step in (third, fourth):  # what the worker brings for the aborted b is discarded
        s.update(step, StepResult(step.step_id))
    s.add_request(_request("again", prompt[:24] + [1]))  # computes a's prefix again, correctly
    _run_to_end(s, backend)
    assert s.registry.find_prefix(follower).num_tokens == 24  # a's prefix, not b's blocks after it


def test_blocks_of_steps_the_worker_answered_stay_cached_when_a_later_step_fails() -> None:
    """Only blocks registered for steps not yet answered may be unwritten: those of answered steps stay."""
    backend = FakeStepBackend(FakeConfig(kv_block_size=4, kv_num_blocks=32, max_batch_tokens=4, fail_step=2))
    s = _scheduler(backend)
    prompt = list(range(10, 23))  # chunks [0,4) in step 1, [4,8) in step 2 (fails), [8,12) in step 3
    s.add_request(_request("a", prompt))
    first = s.schedule()
    assert first is not None
    s.update(first, backend.execute(first))  # answered: block 0 is written
    second, third = s.schedule(), s.schedule()
    assert second is not None and third is not None
    assert any(isinstance(e, Error) for e in s.update(second, backend.execute(second)))
    s.update(third, backend.execute(third))
    assert s.registry.find_prefix([*prompt[:8], 99]).num_tokens == 4  # block 0 only
