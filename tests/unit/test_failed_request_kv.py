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
    GenerateRequest,
    SamplingParams,
    StepResult,
    Token,
    WorkerEvent,
)
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
