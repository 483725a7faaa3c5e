"""Scheduler policy with the fake worker and with hand-made StepResults."""

from __future__ import annotations

import pytest
from sched_helpers import Run, drive, make, request

from ominix_runtime.contract import (
    DecodeStep,
    Done,
    Error,
    FinishReason,
    OminixError,
    PrefillDone,
    Priority,
    RequestOutput,
    RequestState,
    RuntimeErrorKind,
    StepResult,
    Token,
    Usage,
    WorkerEvent,
)
from ominix_runtime.engine.config import SchedulerConfig
from ominix_runtime.engine.scheduler import Scheduler
from ominix_runtime.testing.fake_backend import FakeConfig, FakeStepBackend


def _prompt(n: int, base: int = 10) -> list[int]:
    return [base + (i % 50) for i in range(n)]


def test_budget_and_running_limits_are_respected() -> None:
    run = make(FakeConfig(max_batch_tokens=48, max_running_requests=3, kv_num_blocks=64, kv_block_size=4))
    for i in range(8):
        run.scheduler.add_request(request(f"r{i}", _prompt(30 + i, base=i * 7), max_tokens=5))
    drive(run)
    assert all(s.num_scheduled_tokens <= 48 for s in run.steps)
    live: set[str] = set()
    for s in run.steps:
        live -= set(s.finished_request_ids)
        live |= {r.request_id for r in s.new_requests}
        assert len(live) <= 3
    assert all(isinstance(run.terminal(f"r{i}"), Done) for i in range(8))


def test_chunked_prefill_of_a_prompt_larger_than_the_budget() -> None:
    run = make(FakeConfig(max_batch_tokens=32, kv_block_size=4, kv_num_blocks=64))
    run.scheduler.add_request(request("long", _prompt(100), max_tokens=3))
    drive(run, max_inflight=1)
    chunks = [s.num_scheduled_tokens for s in run.steps if s.num_scheduled_tokens]
    assert chunks[:4] == [32, 32, 32, 4]  # the prompt in budget-sized chunks
    assert chunks[4:] == [1, 1]  # then one token per step
    kinds = [type(e) for e in run.events["long"]]
    assert kinds == [PrefillDone, Token, Token, Token, Usage, Done]


def test_prefill_and_decode_are_mixed_in_one_step_running_first() -> None:
    run = make(FakeConfig(max_batch_tokens=16, kv_block_size=4, kv_num_blocks=64))
    s = run.scheduler
    s.add_request(request("a", _prompt(8), max_tokens=4))
    step1 = s.schedule()
    assert step1 is not None
    run.record(s.update(step1, run.backend.execute(step1)))
    s.add_request(request("b", _prompt(40), max_tokens=2))
    step2 = s.schedule()
    assert step2 is not None
    assert [r.request_id for r in step2.running_requests] == ["a"]
    assert step2.running_requests[0].num_scheduled_tokens == 1
    assert step2.new_requests[0].request_id == "b" and step2.new_requests[0].num_scheduled_tokens == 15
    run.record(s.update(step2, run.backend.execute(step2)))
    drive(run)


def _step_with_a_decode(
    config: SchedulerConfig,
    prompts: int,
    prompt_len: int = 40,
    shapes: tuple[tuple[int, int], ...] = (),
) -> tuple[Run, DecodeStep]:
    """Request "a" decoding, then ``prompts`` new prompts waiting (``prompt_len`` tokens each, or one per
    ``(length, base)`` of ``shapes``): the step the scheduler builds next."""
    run = make(FakeConfig(max_batch_tokens=128, kv_block_size=4, kv_num_blocks=256), config)
    s = run.scheduler
    s.add_request(request("a", _prompt(8), max_tokens=20))
    first = s.schedule()
    assert first is not None
    run.record(s.update(first, run.backend.execute(first)))
    for i, (length, base) in enumerate(shapes or [(prompt_len, i * 11) for i in range(prompts)]):
        s.add_request(request(f"p{i}", _prompt(length, base=base), max_tokens=2))
    step = s.schedule()
    assert step is not None
    return run, step


def test_prompts_beside_decodes_are_spread_over_steps_without_a_backlog() -> None:
    config = SchedulerConfig(prefill_tokens_beside_decodes=40)
    run, step = _step_with_a_decode(config, prompts=2)  # 80 waiting tokens: two steps' worth under the limit
    assert [r.request_id for r in step.running_requests] == ["a"]
    assert [(r.request_id, r.num_scheduled_tokens) for r in step.new_requests] == [("p0", 40)]
    run.record(run.scheduler.update(step, run.backend.execute(step)))
    following = run.scheduler.schedule()
    assert following is not None
    assert [(r.request_id, r.num_scheduled_tokens) for r in following.new_requests] == [("p1", 40)]
    run.record(run.scheduler.update(following, run.backend.execute(following)))
    drive(run)
    assert all(isinstance(run.terminal(rid), Done) for rid in ("a", "p0", "p1"))


def test_a_backlog_or_a_step_without_decodes_takes_the_whole_budget() -> None:
    config = SchedulerConfig(prefill_tokens_beside_decodes=40)
    _, backlog = _step_with_a_decode(config, prompts=4)  # 160 waiting tokens: more than the budget
    assert sum(r.num_scheduled_tokens for r in backlog.new_requests) == 127  # 128 less a's decode
    run = make(FakeConfig(max_batch_tokens=128, kv_block_size=4, kv_num_blocks=256), config)
    for i in range(2):
        run.scheduler.add_request(request(f"p{i}", _prompt(40, base=i * 11), max_tokens=2))
    first = run.scheduler.schedule()  # nothing decodes yet
    assert first is not None and [r.num_scheduled_tokens for r in first.new_requests] == [40, 40]
    _, unlimited = _step_with_a_decode(SchedulerConfig(prefill_tokens_beside_decodes=0), prompts=2)
    assert [r.num_scheduled_tokens for r in unlimited.new_requests] == [40, 40]


def test_the_limit_applies_while_the_waiting_tokens_fit_two_limited_steps() -> None:
    config = SchedulerConfig(prefill_tokens_beside_decodes=40)
    _, fits = _step_with_a_decode(config, prompts=1, prompt_len=80)  # this step's 40 and the next one's 40
    assert [r.num_scheduled_tokens for r in fits.new_requests] == [40]
    _, backlog = _step_with_a_decode(config, prompts=1, prompt_len=81)
    assert [r.num_scheduled_tokens for r in backlog.new_requests] == [81]
    _, three = _step_with_a_decode(config, prompts=3, prompt_len=30)  # 90 tokens: all in this step
    assert [r.num_scheduled_tokens for r in three.new_requests] == [30, 30, 30]


def test_the_backlog_tokens_set_how_much_waiting_the_limit_still_holds_back() -> None:
    # Limit 20: by default 40 waiting tokens (this step's 20 and the next one's) keep it; 60 are a backlog.
    _, lifted = _step_with_a_decode(
        SchedulerConfig(prefill_tokens_beside_decodes=20), prompts=3, prompt_len=20
    )
    assert [r.num_scheduled_tokens for r in lifted.new_requests] == [20, 20, 20]
    config = SchedulerConfig(prefill_tokens_beside_decodes=20, prefill_backlog_tokens=40)
    run, held = _step_with_a_decode(config, prompts=3, prompt_len=20)  # 60 <= 20 + 40: still held
    assert [(r.request_id, r.num_scheduled_tokens) for r in held.new_requests] == [("p0", 20)]
    run.record(run.scheduler.update(held, run.backend.execute(held)))
    drive(run)
    assert all(isinstance(run.terminal(rid), Done) for rid in ("a", "p0", "p1", "p2"))
    _, backlog = _step_with_a_decode(config, prompts=4, prompt_len=20)  # 80 > 60: a backlog
    assert [r.num_scheduled_tokens for r in backlog.new_requests] == [20, 20, 20, 20]
    # Fewer than the limit tightens it: 40 waiting tokens, which the default holds, are a backlog past 20 + 10.
    _, default = _step_with_a_decode(
        SchedulerConfig(prefill_tokens_beside_decodes=20), prompts=2, prompt_len=20
    )
    assert [r.num_scheduled_tokens for r in default.new_requests] == [20]
    tight = SchedulerConfig(prefill_tokens_beside_decodes=20, prefill_backlog_tokens=10)
    _, lifted = _step_with_a_decode(tight, prompts=2, prompt_len=20)
    assert [r.num_scheduled_tokens for r in lifted.new_requests] == [20, 20]


def test_the_limit_cuts_only_a_long_prompts_first_chunk() -> None:
    config = SchedulerConfig(prefill_tokens_beside_decodes=24)
    run, step = _step_with_a_decode(config, prompts=1, prompt_len=48)
    assert [(r.request_id, r.num_scheduled_tokens) for r in step.new_requests] == [("p0", 24)]
    run.record(run.scheduler.update(step, run.backend.execute(step)))
    run.scheduler.add_request(request("q", _prompt(20, base=3), max_tokens=2))
    following = run.scheduler.schedule()
    assert following is not None
    # p0's rest runs as a running request's chunk (not cut); it leaves no room for q under the limit
    assert ("p0", 24) in [(r.request_id, r.num_scheduled_tokens) for r in following.running_requests]
    assert following.new_requests == []
    run.record(run.scheduler.update(following, run.backend.execute(following)))
    drive(run)
    assert all(isinstance(run.terminal(rid), Done) for rid in ("a", "p0", "q"))


def test_a_prompt_held_back_once_goes_beyond_the_limit_in_the_next_step() -> None:
    config = SchedulerConfig(prefill_tokens_beside_decodes=24)
    run, step = _step_with_a_decode(config, prompts=2, prompt_len=24)
    assert [(r.request_id, r.num_scheduled_tokens) for r in step.new_requests] == [("p0", 24)]  # p1 held
    run.record(run.scheduler.update(step, run.backend.execute(step)))
    run.scheduler.add_request(request("q", _prompt(20, base=3), max_tokens=2))
    following = run.scheduler.schedule()
    assert following is not None
    # p1 goes outside the limit, q (new) within it: 44 prompt tokens beside the decodes
    assert [(r.request_id, r.num_scheduled_tokens) for r in following.new_requests] == [("p1", 24), ("q", 20)]
    run.record(run.scheduler.update(following, run.backend.execute(following)))
    drive(run)
    assert all(isinstance(run.terminal(rid), Done) for rid in ("a", "p0", "p1", "q"))


def test_the_held_prompt_goes_beyond_the_limit_even_behind_a_higher_priority_arrival() -> None:
    config = SchedulerConfig(prefill_tokens_beside_decodes=24)
    # p0 (40) and p1 (8): 48 tokens, this step's 24 and the next one's: p0 gets a 24-token chunk, p1 is held.
    run, step = _step_with_a_decode(config, prompts=2, shapes=((40, 0), (8, 11)))
    assert [(r.request_id, r.num_scheduled_tokens) for r in step.new_requests] == [("p0", 24)]
    run.record(run.scheduler.update(step, run.backend.execute(step)))
    rt = request("rt", _prompt(20, base=5), max_tokens=2)
    rt.priority = Priority.REALTIME  # ahead of p1 in the queue
    run.scheduler.add_request(rt)
    following = run.scheduler.schedule()
    assert following is not None
    # p0's last 16 tokens leave 8 of the limit: rt (never held) gets those 8, p1 (held) its 8 beyond them.
    assert ("p0", 16) in [(r.request_id, r.num_scheduled_tokens) for r in following.running_requests]
    assert [(r.request_id, r.num_scheduled_tokens) for r in following.new_requests] == [("rt", 8), ("p1", 8)]
    assert not run.scheduler.requests["p1"].held_by_prefill_limit  # admitted: the mark is gone
    run.record(run.scheduler.update(following, run.backend.execute(following)))
    drive(run)
    assert all(isinstance(run.terminal(rid), Done) for rid in ("a", "p0", "p1", "rt"))


def test_more_waiting_requests_than_free_running_slots_is_a_backlog() -> None:
    # Prompts of 50 and 30 tokens (80: two steps' worth under the limit) wait for the one slot "a" leaves.
    two_waiting = ((50, 50), (30, 7))
    # (backlog_admission_slots off: with its default the one free slot would wait for a second.)
    config = SchedulerConfig(
        prefill_tokens_beside_decodes=40, max_running_requests=2, backlog_admission_slots=0
    )
    run, step = _step_with_a_decode(config, prompts=2, shapes=two_waiting)
    assert [(r.request_id, r.num_scheduled_tokens) for r in step.new_requests] == [("p0", 50)]
    run.record(run.scheduler.update(step, run.backend.execute(step)))
    drive(run)
    assert all(isinstance(run.terminal(rid), Done) for rid in ("a", "p0", "p1"))
    config = SchedulerConfig(prefill_tokens_beside_decodes=40, max_running_requests=3)
    _, fits = _step_with_a_decode(config, prompts=2, shapes=two_waiting)  # a slot for each: the limit holds
    assert [(r.request_id, r.num_scheduled_tokens) for r in fits.new_requests] == [("p0", 40)]


def test_the_default_limit_holds_prompts_beside_decodes_to_1024_tokens() -> None:
    run = make(FakeConfig(max_batch_tokens=4096, kv_block_size=16, kv_num_blocks=512), SchedulerConfig())
    s = run.scheduler
    s.add_request(request("a", _prompt(8), max_tokens=20))
    first = s.schedule()
    assert first is not None
    run.record(s.update(first, run.backend.execute(first)))
    for i in range(2):  # 2,000 waiting tokens: within this step's 1,024 and the next one's
        s.add_request(request(f"p{i}", _prompt(1000, base=i * 11), max_tokens=2))
    step = s.schedule()
    assert step is not None
    assert [(r.request_id, r.num_scheduled_tokens) for r in step.new_requests] == [("p0", 1000), ("p1", 24)]
    run.record(s.update(step, run.backend.execute(step)))
    drive(run)
    assert all(isinstance(run.terminal(rid), Done) for rid in ("a", "p0", "p1"))


def test_a_step_that_carries_decodes_takes_at_most_its_own_budget() -> None:
    config = SchedulerConfig(
        prefill_tokens_beside_decodes=0, max_batch_tokens_with_decodes=48, max_running_requests=16
    )
    run, step = _step_with_a_decode(config, prompts=1, prompt_len=200)  # no prefill limit: the budget alone
    assert [r.num_scheduled_tokens for r in step.running_requests] == [1]
    assert [(r.request_id, r.num_scheduled_tokens) for r in step.new_requests] == [("p0", 47)]
    run.record(run.scheduler.update(step, run.backend.execute(step)))
    following = run.scheduler.schedule()
    assert following is not None  # the prompt's later chunk, as a running request's, keeps to it too
    assert following.num_scheduled_tokens == 48
    run.record(run.scheduler.update(following, run.backend.execute(following)))
    drive(run)
    assert all(isinstance(run.terminal(rid), Done) for rid in ("a", "p0"))
    # Without decodes a step keeps max_batch_tokens (128).
    alone = make(FakeConfig(max_batch_tokens=128, kv_block_size=4, kv_num_blocks=256), config)
    alone.scheduler.add_request(request("p", _prompt(200), max_tokens=2))
    first = alone.scheduler.schedule()
    assert first is not None and first.num_scheduled_tokens == 128
    # Without chunked prefill a prompt longer than it could never go beside a decode: the budget stays.
    whole = SchedulerConfig(
        max_batch_tokens_with_decodes=48, max_running_requests=16, enable_chunked_prefill=False
    )
    _, unchunked = _step_with_a_decode(whole, prompts=1, prompt_len=60)
    assert [(r.request_id, r.num_scheduled_tokens) for r in unchunked.new_requests] == [("p0", 60)]


def test_the_budget_with_decodes_is_at_least_the_running_slots_and_at_most_the_budget() -> None:
    config = SchedulerConfig(
        prefill_tokens_beside_decodes=0, max_batch_tokens_with_decodes=4, max_running_requests=8
    )
    run = make(FakeConfig(max_batch_tokens=128, kv_block_size=4, kv_num_blocks=256), config)
    s = run.scheduler
    assert s.max_batch_tokens_with_decodes == 8  # raised to max_running_requests
    for i in range(7):
        s.add_request(request(f"d{i}", _prompt(8, base=i * 5), max_tokens=6))
    first = s.schedule()
    assert first is not None
    run.record(s.update(first, run.backend.execute(first)))
    s.add_request(request("p", _prompt(200, base=90), max_tokens=2))
    step = s.schedule()
    assert step is not None
    assert sorted(r.request_id for r in step.running_requests) == [f"d{i}" for i in range(7)]
    assert [(r.request_id, r.num_scheduled_tokens) for r in step.new_requests] == [("p", 1)]
    run.record(s.update(step, run.backend.execute(step)))
    drive(run)
    assert all(isinstance(run.terminal(rid), Done) for rid in [*(f"d{i}" for i in range(7)), "p"])
    # The default (4,096) is capped by the worker's budget; 0 means the budget; the budget wins over the slots.
    default = make(FakeConfig(max_batch_tokens=128), SchedulerConfig()).scheduler
    assert default.max_batch_tokens_with_decodes == 128
    whole = SchedulerConfig(max_batch_tokens_with_decodes=0, max_running_requests=8)
    assert make(FakeConfig(max_batch_tokens=128), whole).scheduler.max_batch_tokens_with_decodes == 128
    few = SchedulerConfig(max_batch_tokens_with_decodes=4)
    capped = make(FakeConfig(max_batch_tokens=16, max_running_requests=64), few).scheduler
    assert (capped.max_running_requests, capped.max_batch_tokens_with_decodes) == (64, 16)


def test_a_decode_whose_sample_cannot_be_used_does_not_shrink_the_budget() -> None:
    config = SchedulerConfig(
        prefill_tokens_beside_decodes=0, max_batch_tokens_with_decodes=48, max_running_requests=16
    )
    run = make(FakeConfig(max_batch_tokens=128, kv_block_size=4, kv_num_blocks=256), config)
    s = run.scheduler
    s.add_request(request("a", _prompt(8), max_tokens=1))
    first = s.schedule()  # a's prompt; its one token is in flight, so a has nothing left to decode
    assert first is not None
    s.add_request(request("p", _prompt(200, base=3), max_tokens=2))
    second = s.schedule()
    assert second is not None and second.running_requests == []
    assert [(r.request_id, r.num_scheduled_tokens) for r in second.new_requests] == [("p", 128)]
    run.record(s.update(first, run.backend.execute(first)))
    run.record(s.update(second, run.backend.execute(second)))
    drive(run)
    assert all(isinstance(run.terminal(rid), Done) for rid in ("a", "p"))


def test_without_chunked_prefill_the_limit_is_off() -> None:
    # A prompt longer than the limit could never be admitted whole while anything decodes.
    config = SchedulerConfig(prefill_tokens_beside_decodes=24, enable_chunked_prefill=False)
    _, step = _step_with_a_decode(config, prompts=1, prompt_len=60)
    assert [(r.request_id, r.num_scheduled_tokens) for r in step.new_requests] == [("p0", 60)]


def _tokens_of_all(run: Run, n: int) -> dict[str, list[int]]:
    return {f"r{i}": run.tokens(f"r{i}") for i in range(n)}


def test_overlap_gives_the_same_tokens_as_no_overlap() -> None:
    results = []
    for inflight in (1, 2, 3):
        run = make(FakeConfig(max_batch_tokens=40, kv_block_size=4, kv_num_blocks=48))
        for i in range(10):
            run.scheduler.add_request(request(f"r{i}", _prompt(12 + 3 * i, base=i), max_tokens=12, seed=i))
        drive(run, max_inflight=inflight)
        results.append(_tokens_of_all(run, 10))
    assert results[0] == results[1] == results[2]
    assert all(len(t) == 12 for t in results[0].values())


def test_preemption_and_resume_reproduce_the_unpreempted_tokens() -> None:
    big = make(FakeConfig(kv_num_blocks=512, kv_block_size=4))
    small = make(FakeConfig(kv_num_blocks=24, kv_block_size=4))
    for run in (big, small):
        for i in range(8):
            run.scheduler.add_request(
                request(f"r{i}", _prompt(10 + i, base=3 * i), max_tokens=20, seed=100 + i)
            )
        drive(run)
    assert big.scheduler.counters.preemptions == 0
    assert small.scheduler.counters.preemptions > 0
    assert _tokens_of_all(small, 8) == _tokens_of_all(big, 8)
    for i in range(8):  # prefill reported once, even after preemptions
        assert sum(isinstance(e, PrefillDone) for e in small.events[f"r{i}"]) == 1


def test_victim_is_lowest_priority_then_latest_arrival() -> None:
    run = make(FakeConfig(kv_num_blocks=12, kv_block_size=4, max_batch_tokens=64))
    s = run.scheduler
    for rid, prio, base in (
        ("batch-old", Priority.BATCH, 10),
        ("inter", Priority.INTERACTIVE, 60),
        ("batch-new", Priority.BATCH, 120),
    ):
        req = request(rid, _prompt(8, base), max_tokens=30)
        req.priority = prio
        s.add_request(req)
    first_victim: list[str] = []

    def watch(r: Run) -> None:
        plan = r.scheduler.last_plan
        if plan and plan.preempted_request_ids and not first_victim:
            first_victim.extend(plan.preempted_request_ids)

    drive(run, max_inflight=1, on_step=watch)
    assert first_victim[:1] == ["batch-new"]
    assert s.counters.preemptions >= 1


def test_priority_classes_are_admitted_in_order_then_fcfs() -> None:
    run = make(FakeConfig(max_running_requests=1, kv_block_size=4))
    s = run.scheduler
    for rid, prio in (
        ("b1", Priority.BATCH),
        ("i1", Priority.INTERACTIVE),
        ("b2", Priority.BATCH),
        ("rt", Priority.REALTIME),
        ("i2", Priority.INTERACTIVE),
    ):
        req = request(rid, _prompt(6), max_tokens=2)
        req.priority = prio
        s.add_request(req)
    drive(run)
    admitted = [r.request_id for st in run.steps for r in st.new_requests]
    assert admitted == ["rt", "i1", "i2", "b1", "b2"]


def test_a_waiting_realtime_request_displaces_a_running_batch_request() -> None:
    run = make(FakeConfig(kv_num_blocks=10, kv_block_size=4, max_batch_tokens=64))
    s = run.scheduler
    low = request("low", _prompt(20), max_tokens=16)
    low.priority = Priority.BATCH
    s.add_request(low)
    step = s.schedule()
    assert step is not None
    run.record(s.update(step, run.backend.execute(step)))
    rt = request("rt", _prompt(20, 70), max_tokens=8)
    rt.priority = Priority.REALTIME
    s.add_request(rt)
    step = s.schedule()
    assert step is not None
    assert [r.request_id for r in step.new_requests] == ["rt"]
    assert "low" in step.finished_request_ids
    assert s.requests["low"].num_preemptions == 1
    run.record(s.update(step, run.backend.execute(step)))
    drive(run)
    assert isinstance(run.terminal("low"), Done) and isinstance(run.terminal("rt"), Done)


def test_admission_rejections_say_why() -> None:
    run = make(FakeConfig(kv_num_blocks=4, kv_block_size=4, max_model_len=64, vocab_size=100))
    s = run.scheduler
    with pytest.raises(OminixError) as e:
        s.add_request(request("kv", _prompt(10), max_tokens=10))
    assert e.value.kind == RuntimeErrorKind.KV_CAPACITY_EXCEEDED
    cases = {
        "empty": (request("e", [], max_tokens=1), "empty"),
        "vocab": (request("v", [5, 100], max_tokens=1), "vocabulary"),
        "prompt": (request("p", _prompt(65), max_tokens=1), "prompt has 65 tokens"),
        "sum": (request("s", _prompt(60), max_tokens=10), "prompt (60 tokens) + max_tokens (10)"),
    }
    for req, needle in cases.values():
        with pytest.raises(OminixError) as e:
            s.add_request(req)
        assert e.value.kind == RuntimeErrorKind.INVALID_ARGUMENT
        assert needle in e.value.message
    assert s.counters.rejected == 5 and not s.requests


def _long_finish_step(max_bypass_steps: int) -> tuple[int | None, int]:
    """Steps until a long request finishes while one short request arrives every step."""
    run = make(
        FakeConfig(kv_num_blocks=32, kv_block_size=4, max_batch_tokens=64),
        SchedulerConfig(max_bypass_steps=max_bypass_steps),
    )
    s = run.scheduler
    count = {"n": 0}

    def add_short() -> None:
        n = count["n"]
        s.add_request(request(f"s{n}", _prompt(8, 200 + n), max_tokens=8))
        count["n"] += 1

    for _ in range(4):
        add_short()
    for _ in range(2):  # the shorts hold most of the KV when the long one arrives
        step = s.schedule()
        assert step is not None
        run.record(s.update(step, run.backend.execute(step)))
    s.add_request(request("long", _prompt(100), max_tokens=8))  # its first chunk needs 16 of 32 blocks
    finished_at: list[int] = []

    def on_step(r: Run) -> bool:
        if count["n"] < 300:
            add_short()
        if not finished_at and "long" in r.events and isinstance(r.events["long"][-1], Done):
            finished_at.append(len(r.steps))
        return count["n"] < 300  # still feeding

    drive(run, on_step=on_step, max_steps=20_000)
    return (finished_at[0] if finished_at else None), len(run.steps)


def test_a_long_request_is_not_starved_by_a_stream_of_short_ones() -> None:
    with_rule, _ = _long_finish_step(max_bypass_steps=8)
    without_rule, total = _long_finish_step(max_bypass_steps=10**9)
    assert with_rule is not None and with_rule < 120
    # Without the rule the same stream keeps it waiting until the stream dries up.
    assert without_rule is not None and without_rule > 0.8 * total > 5 * with_rule


@pytest.mark.parametrize("whole_hits", [False, True])
def test_prefix_hit_skips_computed_tokens_but_recomputes_the_last_prompt_token(whole_hits: bool) -> None:
    run = make(FakeConfig(kv_block_size=4, kv_num_blocks=64, supports_whole_prompt_hits=whole_hits))
    s = run.scheduler
    prompt = _prompt(16)  # 4 full blocks
    s.add_request(request("a", prompt, max_tokens=2))
    drive(run)
    s.add_request(request("b", prompt, max_tokens=2))
    s.add_request(request("c", prompt + [7, 8], max_tokens=2))
    step = s.schedule()
    assert step is not None
    by_id = {r.request_id: r for r in step.new_requests}
    a_blocks = run.scheduler.registry.find_prefix(prompt).kv_block_ids
    if whole_hits:  # every block shared; the last token alone is computed, its KV not written
        assert (by_id["b"].num_computed_tokens, by_id["b"].num_scheduled_tokens) == (15, 1)
        assert by_id["b"].num_cached_kv_tokens == 16 and by_id["b"].kv_block_ids == list(a_blocks)
    else:  # the last block is computed again, into a block of its own
        assert (by_id["b"].num_computed_tokens, by_id["b"].num_scheduled_tokens) == (12, 4)
        assert by_id["b"].num_cached_kv_tokens == 0 and by_id["b"].kv_block_ids[:3] == list(a_blocks[:3])
    assert by_id["c"].num_computed_tokens == 16 and by_id["c"].num_scheduled_tokens == 2
    assert by_id["c"].num_cached_kv_tokens == 0
    # The fake checks the hit blocks' content and that no step writes a block another live request holds.
    run.record(s.update(step, run.backend.execute(step)))
    drive(run)
    usage_b = next(e for e in run.events["b"] if isinstance(e, Usage))
    assert usage_b.cached_tokens == (15 if whole_hits else 12)
    assert run.tokens("b") == run.tokens("a")  # same prompt, same seed
    assert run.backend.violations == []
    s.registry.check_integrity()
    s.registry.check_quiescent()  # every lease freed, every block reusable


def test_a_whole_prompt_hit_shares_its_last_block_and_the_next_token_takes_a_new_one() -> None:
    run = make(FakeConfig(kv_block_size=4, kv_num_blocks=64))
    s = run.scheduler
    prompt = _prompt(8)  # 2 full blocks
    s.add_request(request("a", prompt, max_tokens=1))
    drive(run)
    hit = s.registry.find_prefix(prompt)
    assert hit.whole and (hit.num_tokens, hit.num_kv_tokens) == (7, 8)
    assert s.registry.find_prefix(prompt[:7]).num_tokens == 4  # not whole blocks: capped as before
    s.add_request(request("b", prompt, max_tokens=3))
    s.add_request(request("c", prompt, max_tokens=3))
    step = s.schedule()
    assert step is not None and step.num_scheduled_tokens == 2  # one token each, both on the shared blocks
    run.record(s.update(step, run.backend.execute(step)))
    assert s.registry.lease("b") is not None and s.registry.lease("c") is not None
    shared = list(hit.kv_block_ids)
    for rid in ("b", "c"):
        lease = s.registry.lease(rid)
        assert lease is not None and lease.block_tables[0] == shared
    step = s.schedule()  # the first output token (position 8) needs a block of each request's own
    assert step is not None
    grown = {r.request_id: r.new_kv_block_ids for r in step.running_requests}
    assert len(grown["b"]) == 1 and len(grown["c"]) == 1 and grown["b"] != grown["c"]
    assert not set(grown["b"] + grown["c"]) & set(shared)
    run.record(s.update(step, run.backend.execute(step)))
    drive(run)
    assert run.tokens("b") == run.tokens("c") and run.tokens("b")[:1] == run.tokens("a")
    assert run.backend.violations == []
    s.registry.check_quiescent()


def _one_token_result(
    step: DecodeStep, token: int | None = None, error: RuntimeErrorKind | None = None
) -> StepResult:
    outs = [
        RequestOutput(rid, sampled_token_id=token, error_kind=error, error_message="boom" if error else "")
        for rid in step.scheduled_request_ids
    ]
    return StepResult(step.step_id, outs)


def _started(
    max_tokens: int = 8, ignore_eos: bool = True, min_tokens: int = 0, stop_token_ids: list[int] | None = None
) -> Run:
    run = make(FakeConfig(kv_block_size=4, vocab_size=50, eos_token_ids=(2,), max_model_len=64))
    req = request(
        "r",
        [5, 6, 7],
        max_tokens,
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        stop_token_ids=stop_token_ids,
    )
    run.scheduler.add_request(req)
    return run


def _feed(run: Run, tokens: list[int]) -> list[WorkerEvent]:
    events: list[WorkerEvent] = []
    for t in tokens:
        step = run.scheduler.schedule()
        assert step is not None
        events += run.scheduler.update(step, _one_token_result(step, t))
    return events


def test_eos_stops_unless_ignored_and_honours_min_tokens() -> None:
    run = _started(ignore_eos=False, min_tokens=2)
    events = _feed(run, [2, 9, 2])  # eos before min_tokens does not stop
    assert isinstance(events[-1], Done) and events[-1].finish_reason == FinishReason.STOP
    assert [t for e in events if isinstance(e, Token) for t in e.token_ids] == [2, 9, 2]
    assert isinstance(events[-2], Usage) and events[-2].completion_tokens == 3
    run = _started(max_tokens=3, ignore_eos=True)
    events = _feed(run, [2, 2, 2])
    assert events[-1].finish_reason == FinishReason.LENGTH


def test_stop_token_ids_and_max_model_len() -> None:
    run = _started(stop_token_ids=[9])
    assert _feed(run, [4, 9])[-1].finish_reason == FinishReason.STOP
    run = make(FakeConfig(kv_block_size=4, vocab_size=50, max_model_len=6))
    run.scheduler.add_request(request("r", [5, 6, 7], max_tokens=3))
    run.scheduler.max_model_len = 5  # the backstop: the context fills before max_tokens
    events = _feed(run, [4, 4])
    assert isinstance(events[-1], Done) and events[-1].finish_reason == FinishReason.LENGTH
    assert run.scheduler.schedule() is not None  # only the finished id for the worker
    assert run.scheduler.schedule() is None


def test_the_token_event_says_which_token_ended_the_request_as_a_stop_token() -> None:
    """The front leaves the text of a stop_token_ids entry that ends the request out: the Token event that
    carries it says so, and for an eos that ends it too. Not for one before min_tokens (it does not end the
    request)."""
    run = _started(stop_token_ids=[9], min_tokens=2)
    events = _feed(run, [9, 4, 9])
    tokens = [e for e in events if isinstance(e, Token)]
    assert [(e.token_ids, e.ended_by_stop_token) for e in tokens] == [([9], False), ([4], False), ([9], True)]
    assert isinstance(events[-1], Done) and events[-1].finish_reason == FinishReason.STOP
    assert isinstance(events[-2], Usage) and events[-2].completion_tokens == 3  # it is still an output token
    run = _started(ignore_eos=False, stop_token_ids=[9])
    events = _feed(run, [4, 2])
    assert isinstance(events[-1], Done) and events[-1].finish_reason == FinishReason.STOP
    assert [e.ended_by_stop_token for e in events if isinstance(e, Token)] == [False, True]
    run = _started(ignore_eos=False, stop_token_ids=[2])  # the eos listed as a stop token too
    assert [e.ended_by_stop_token for e in _feed(run, [4, 2]) if isinstance(e, Token)] == [False, True]


def test_per_request_error_and_missing_output_fail_only_that_request() -> None:
    run = _started()
    run.scheduler.add_request(request("q", [5, 6], max_tokens=4))
    step = run.scheduler.schedule()
    assert step is not None
    result = StepResult(
        step.step_id, [RequestOutput("r", error_kind=RuntimeErrorKind.INTERNAL, error_message="nan")]
    )
    events = run.scheduler.update(step, result)
    errors = {e.request_id: e for e in events if isinstance(e, Error)}
    assert errors["r"].message == "nan" and errors["q"].kind == RuntimeErrorKind.INTERNAL
    assert run.scheduler.registry.num_leased_blocks == 0


def test_abort_frees_kv_at_once_and_discards_in_flight_outputs() -> None:
    run = make(FakeConfig(kv_block_size=4))
    s = run.scheduler
    s.add_request(request("a", _prompt(10), max_tokens=10))
    s.add_request(request("b", _prompt(10, 90), max_tokens=10))
    step1 = s.schedule()
    assert step1 is not None
    result1 = run.backend.execute(step1)
    events = s.abort_request("a")
    assert [type(e) for e in events] == [Usage, Done] and events[1].finish_reason == FinishReason.ABORT
    assert s.registry.lease("a") is None
    assert s.abort_request("a") == []  # exactly one terminal event
    later = s.update(step1, result1)
    assert all(e.request_id == "b" for e in later)
    assert s.counters.discarded_outputs == 1
    step2 = s.schedule()
    assert step2 is not None and step2.finished_request_ids == ["a"]
    run.record(later + s.update(step2, run.backend.execute(step2)))
    drive(run)


def test_abort_with_error_kinds_maps_to_states() -> None:
    run = make()
    s = run.scheduler
    for rid in ("t", "f", "c"):
        s.add_request(request(rid, [1, 2, 3]))
    t = s.requests["t"]
    ev = s.abort_request("t", error=(RuntimeErrorKind.TIMEOUT, "deadline"))
    assert isinstance(ev[-1], Error) and ev[-1].kind == RuntimeErrorKind.TIMEOUT
    assert t.state == RequestState.FAILED  # a passed deadline is a failure, as GetStats documents
    f = s.requests["f"]
    s.abort_request("f", FinishReason.ERROR, (RuntimeErrorKind.BACKEND_UNAVAILABLE, "gone"))
    assert f.state == RequestState.FAILED
    c = s.requests["c"]
    s.abort_request("c", error=(RuntimeErrorKind.CANCELLED, "client went away"))
    assert c.state == RequestState.ABORTED
    assert s.counters.aborted == 1 and s.counters.failed == 2


def test_a_preempted_request_is_not_rescheduled_while_its_step_is_in_flight() -> None:
    run = make(FakeConfig(kv_num_blocks=6, kv_block_size=4, max_batch_tokens=64))
    s = run.scheduler
    s.add_request(request("a", _prompt(9), max_tokens=12, seed=1))
    s.add_request(request("b", _prompt(9, 80), max_tokens=12, seed=2))
    inflight = []
    saw_preempted_in_flight = False
    for _ in range(200):
        while len(inflight) < 2:
            step = s.schedule()
            if step is None:
                break
            for nr in step.new_requests:
                assert s.requests[nr.request_id].num_inflight_steps == 1  # only this step
            inflight.append(step)
        if not inflight:
            break
        for r in s.requests.values():
            if r.state == RequestState.PREEMPTED:
                saw_preempted_in_flight = True
                assert r.num_inflight_steps > 0
        step = inflight.pop(0)
        run.record(s.update(step, run.backend.execute(step)))
        assert not run.backend.violations
    assert not s.requests
    assert saw_preempted_in_flight
    assert len(run.tokens("a")) == 12 and len(run.tokens("b")) == 12


def test_finish_request_from_a_stop_string() -> None:
    run = _started()
    _feed(run, [4])
    events = run.scheduler.finish_request("r", FinishReason.STOP, matched_stop="###")
    assert isinstance(events[-1], Done) and events[-1].matched_stop == "###"
    assert run.scheduler.finish_request("r") == []


def test_a_request_is_queued_from_its_arrival_and_scheduled_in_admission_order() -> None:
    """A request's queue time (run reports: queue, TTFT, E2E) starts at its arrival_time, stamped on the
    scheduler's clock when the front received it; one stamped after the clock's reading (another clock's) is
    not used. The order of service stays the order of admission."""
    now = [100.0]
    backend = FakeStepBackend(FakeConfig())
    run = Run(Scheduler(backend.capability(), clock=lambda: now[0], seed=1), backend)
    first, second = request("first", _prompt(8), max_tokens=2), request("second", _prompt(8), max_tokens=2)
    first.arrival_time, second.arrival_time = 99.75, 99.5  # the second was tokenized faster
    late = request("late", _prompt(8), max_tokens=2)
    late.arrival_time = 5000.0
    for req in (first, second, late):
        run.scheduler.add_request(req)
    queued = {rid: r.queued_time for rid, r in run.scheduler.requests.items()}
    assert queued == {"first": 99.75, "second": 99.5, "late": 100.0}
    step = run.scheduler.schedule()
    assert step is not None and [r.request_id for r in step.new_requests] == ["first", "second", "late"]
    run.record(run.scheduler.update(step, backend.execute(step)))
    drive(run)
    assert all(isinstance(run.terminal(rid), Done) for rid in queued)


def test_a_request_pauses_instead_of_preempting_itself_when_only_protected_requests_follow() -> None:
    run = make(FakeConfig(kv_num_blocks=4, kv_block_size=4, max_batch_tokens=64))
    s = run.scheduler
    for rid in "abcd":
        s.add_request(request(rid, _prompt(4, 10 * (ord(rid) - 96)), max_tokens=8))
    step = s.schedule()
    assert step is not None and len(step.new_requests) == 4  # one block each: the cache is full
    run.record(s.update(step, run.backend.execute(step)))
    for rid in "bcd":  # as if just resumed after a preemption
        s.requests[rid].protected_until_step = 100
    step = s.schedule()
    assert step is not None
    assert [r.request_id for r in step.running_requests] == ["b"]
    assert s.last_plan is not None and s.last_plan.preempted_request_ids == ["d", "c"]
    a = s.requests["a"]
    assert a.num_preemptions == 0 and s.registry.lease("a") is not None  # paused, KV kept
    run.record(s.update(step, run.backend.execute(step)))
    drive(run)
    assert all(len(run.tokens(rid)) == 8 for rid in "abcd")


def test_no_priority_displacement_when_it_could_not_make_room() -> None:
    run = make(FakeConfig(kv_num_blocks=10, kv_block_size=4, max_batch_tokens=64))
    s = run.scheduler
    for rid, prio, n, max_tokens in (("rt1", Priority.REALTIME, 30, 4), ("low", Priority.BATCH, 3, 30)):
        req = request(rid, _prompt(n, 7 * n), max_tokens=max_tokens)
        req.priority = prio
        s.add_request(req)
    step = s.schedule()
    assert step is not None and len(step.new_requests) == 2  # 8 + 1 of 10 blocks
    run.record(s.update(step, run.backend.execute(step)))
    rt2 = request("rt2", _prompt(20, 90), max_tokens=4)  # needs 5 blocks; only 1 free + 1 reclaimable
    rt2.priority = Priority.REALTIME
    s.add_request(rt2)
    step = s.schedule()
    assert step is not None and "low" not in step.finished_request_ids
    assert s.requests["low"].num_preemptions == 0
    run.record(s.update(step, run.backend.execute(step)))
    drive(run)
    assert all(isinstance(run.terminal(rid), Done) for rid in ("rt1", "low", "rt2"))


def test_a_request_resumed_after_preemption_may_find_its_tokens_whole() -> None:
    """Prompt and outputs that fill whole blocks another request computed: the resumed request shares them all
    and computes its last token alone, and samples what it would have without the preemption."""
    run = make(FakeConfig(kv_block_size=4, kv_num_blocks=64))
    s = run.scheduler
    prompt = [11, 12, 13, 14, 15, 16]
    s.add_request(request("a", prompt, max_tokens=4))  # computes positions 0 - 8: two whole blocks cached
    drive(run)
    s.add_request(request("b", prompt, max_tokens=4))
    resumed = []
    while s.has_work():
        b = s.requests.get("b")
        settled = b is not None and b.request_id in s.running and b.num_inflight_steps == 0
        if not resumed and settled and b is not None and len(b.all_token_ids) == 8:
            s._preempt(b)  # what KV pressure would do, at the point where its tokens fill two blocks
        step = s.schedule()
        assert step is not None
        resumed += [n for n in step.new_requests if n.request_id == "b" and n.output_token_ids]
        run.record(s.update(step, run.backend.execute(step)))
        s.check_integrity()
    assert len(resumed) == 1
    assert (resumed[0].num_computed_tokens, resumed[0].num_scheduled_tokens) == (7, 1)
    assert resumed[0].num_cached_kv_tokens == 8 and len(resumed[0].output_token_ids) == 2
    assert run.tokens("b") == run.tokens("a") and run.backend.violations == []
    s.registry.check_quiescent()


def test_without_chunked_prefill_a_prompt_over_the_step_budget_is_refused() -> None:
    """Unchunked, a prompt is computed in one step: one longer than max_batch_tokens is refused at admission,
    naming the budget, while one that fits it (or any prompt with chunked prefill) is accepted."""
    fake = FakeConfig(max_batch_tokens=64, max_model_len=4096)
    s = make(fake, SchedulerConfig(enable_chunked_prefill=False)).scheduler
    with pytest.raises(OminixError) as e:
        s.add_request(request("long", _prompt(65), max_tokens=4))
    assert e.value.kind == RuntimeErrorKind.INVALID_ARGUMENT
    assert "65 tokens" in e.value.message and "64 tokens per step (max_batch_tokens)" in e.value.message
    assert s.counters.rejected == 1 and not s.requests
    s.add_request(request("fits", _prompt(64), max_tokens=4))
    chunked = make(fake, SchedulerConfig(enable_chunked_prefill=True)).scheduler
    chunked.add_request(request("long", _prompt(65), max_tokens=4))
    assert set(s.requests) == {"fits"} and set(chunked.requests) == {"long"}


def test_without_chunked_prefill_a_preempted_request_too_long_to_recompute_ends_and_unblocks_the_queue() -> (
    None
):
    """Unchunked, a request preempted once its prompt + outputs exceed max_batch_tokens could never be
    recomputed: it ends with one Error naming the budget (its KV freed) instead of waiting forever and, past
    max_bypass_steps, holding back every request queued behind it; the others all finish."""
    run = make(
        FakeConfig(max_batch_tokens=64, kv_block_size=4, kv_num_blocks=32),
        SchedulerConfig(enable_chunked_prefill=False, enable_prefix_caching=False, max_bypass_steps=2),
    )
    s = run.scheduler
    s.add_request(request("first", _prompt(40), max_tokens=40))
    # Arrives later, so it is the victim once the two outgrow the 128 tokens of KV (each past ~14 outputs,
    # when it holds 74 tokens or more).
    s.add_request(request("long", _prompt(60, base=100), max_tokens=30))
    added = 0

    def feed(r: Run) -> bool:
        nonlocal added
        if added < 6 and "long" in r.events:  # queued behind the long request
            s.add_request(request(f"short{added}", _prompt(3, base=300 + added), max_tokens=4))
            added += 1
        return added < 6

    drive(run, on_step=feed, max_steps=2000)
    end = run.terminal("long")
    assert isinstance(end, Error) and end.kind == RuntimeErrorKind.KV_CAPACITY_EXCEEDED
    assert "64 per step (max_batch_tokens)" in end.message
    assert len(run.tokens("long")) > 64 - 60  # preempted after its prompt + outputs outgrew the budget
    assert all(isinstance(run.terminal(rid), Done) for rid in ["first"] + [f"short{i}" for i in range(6)])
    assert s.counters.failed == 1 and s.counters.preemptions >= 1
    s.registry.check_quiescent()
