"""backlog_admission_slots: under a backlog, waiting requests go in once several running slots are free."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from sched_helpers import Run, drive, make, request

from ominix_runtime.contract import BatchPlan, Done, Priority
from ominix_runtime.engine.config import SchedulerConfig
from ominix_runtime.testing.fake_backend import FakeConfig


@dataclass(frozen=True, slots=True)
class StepView:
    free_slots: int  # running slots free as the step was built
    admitted: tuple[str, ...]
    held: bool


def _run(config: SchedulerConfig, running_tokens: list[int], waiting: int) -> tuple[Run, list[StepView]]:
    """Requests r0.. that run (each with its max_tokens) beside a queue of ``waiting`` more (w0..), one step
    in flight at a time, until everything has ended."""
    run = make(FakeConfig(max_batch_tokens=256, kv_block_size=4, kv_num_blocks=512), config)
    s = run.scheduler
    for i, max_tokens in enumerate(running_tokens):
        s.add_request(request(f"r{i}", [10 + i] * 8, max_tokens=max_tokens))
    first = s.schedule()
    assert first is not None and len(first.new_requests) == len(running_tokens)
    run.record(s.update(first, run.backend.execute(first)))
    for i in range(waiting):
        s.add_request(request(f"w{i}", [60 + i] * 12, max_tokens=2))
    views: list[StepView] = []
    while s.requests:
        free = s.max_running_requests - s.num_running
        held_before = s.counters.admission_held_steps
        step = s.schedule()
        assert step is not None
        held = s.counters.admission_held_steps > held_before
        views.append(StepView(free, tuple(r.request_id for r in step.new_requests), held))
        run.record(s.update(step, run.backend.execute(step)))
        s.check_integrity()
    assert s.registry.num_leased_blocks == 0
    return run, views


def _first_admission(views: list[StepView]) -> int:
    return next(i for i, v in enumerate(views) if v.admitted)


def test_a_backlog_waits_for_two_free_slots_and_they_fill_in_one_step() -> None:
    config = SchedulerConfig(
        max_running_requests=4, backlog_admission_slots=2, prefill_tokens_beside_decodes=0
    )
    # r0 ends two steps before r1: one slot is free for two steps, then two.
    run, views = _run(config, running_tokens=[3, 5, 30, 30], waiting=3)
    first = _first_admission(views)
    held = [v for v in views[:first] if v.held]
    assert len(held) == 2 and all(v.free_slots == 1 for v in held)
    assert run.scheduler.counters.admission_held_steps == sum(v.held for v in views) >= 2
    assert views[first].free_slots == 2 and views[first].admitted == ("w0", "w1")
    assert all(
        isinstance(run.terminal(rid), Done) for rid in [*(f"r{i}" for i in range(4)), "w0", "w1", "w2"]
    )


@pytest.mark.parametrize(
    ("slots", "max_wait_steps", "max_running", "running_tokens", "waiting"),
    [
        pytest.param(0, 4, 4, [3, 5, 30, 30], 3, id="setting-off"),
        pytest.param(2, 0, 4, [3, 5, 30, 30], 3, id="no-wait-steps"),
        pytest.param(2, 4, 4, [3, 30, 30, 30], 1, id="no-backlog"),  # one waiting for the one free slot
        # Two slots of two are only free with nothing decoding: the setting is capped at one, i.e. off.
        pytest.param(2, 4, 2, [3, 30], 3, id="capped"),
    ],
)
def test_the_first_free_slot_is_filled_at_once(
    slots: int, max_wait_steps: int, max_running: int, running_tokens: list[int], waiting: int
) -> None:
    config = SchedulerConfig(
        max_running_requests=max_running,
        backlog_admission_slots=slots,
        backlog_admission_max_wait_steps=max_wait_steps,
        prefill_tokens_beside_decodes=0,
    )
    _, views = _run(config, running_tokens=running_tokens, waiting=waiting)
    first = _first_admission(views)
    assert views[first].free_slots == 1 and views[first].admitted == ("w0",)
    assert not any(v.held for v in views)


def test_admission_waits_at_most_the_wait_steps() -> None:
    config = SchedulerConfig(
        max_running_requests=4,
        backlog_admission_slots=2,
        backlog_admission_max_wait_steps=1,
        prefill_tokens_beside_decodes=0,
    )
    # r0 ends long before anything else: after one held step its slot is filled alone.
    _, views = _run(config, running_tokens=[3, 20, 30, 30], waiting=3)
    first = _first_admission(views)
    assert [v.held for v in views[:first]].count(True) == 1
    assert views[first].free_slots == 1 and views[first].admitted == ("w0",)
    # The count starts again for the next slot.
    second = next(i for i, v in enumerate(views) if i > first and v.admitted)
    assert views[second - 1].held and views[second].admitted == ("w1",)


def _three_slots(running: list[tuple[int, Priority]]) -> Run:
    """Slots for three, two at a time under a backlog; requests r0.. (max_tokens, class) after their first
    step."""
    config = SchedulerConfig(
        max_running_requests=3, backlog_admission_slots=2, prefill_tokens_beside_decodes=0
    )
    run = make(FakeConfig(max_batch_tokens=256, kv_block_size=4, kv_num_blocks=512), config)
    for i, (max_tokens, priority) in enumerate(running):
        r = request(f"r{i}", [10 + i] * 8, max_tokens=max_tokens)
        r.priority = priority
        run.scheduler.add_request(r)
    first = run.scheduler.schedule()
    assert first is not None
    run.record(run.scheduler.update(first, run.backend.execute(first)))
    return run


def _add_waiting(run: Run, count: int, priority: Priority = Priority.INTERACTIVE) -> None:
    for i in range(count):
        w = request(f"w{i}", [60 + i] * 12, max_tokens=2)
        w.priority = priority
        run.scheduler.add_request(w)


def test_a_slot_freed_for_a_higher_class_is_filled_at_once() -> None:
    run = _three_slots([(20, Priority.BATCH)] * 3)
    s = run.scheduler
    _add_waiting(run, 1, Priority.BATCH)
    s.add_request(request("urgent", [50] * 8, max_tokens=2))  # INTERACTIVE, ahead of the BATCH class
    step = s.schedule()
    assert step is not None and s.last_plan is not None
    assert s.last_plan.preempted_request_ids == ["r2"]
    assert [r.request_id for r in step.new_requests] == ["urgent"]
    run.record(s.update(step, run.backend.execute(step)))
    drive(run)
    assert all(isinstance(run.terminal(rid), Done) for rid in ("r0", "r1", "r2", "w0", "urgent"))


def test_a_waiting_request_of_a_higher_class_than_a_running_one_is_not_held() -> None:
    def held_steps(running: Priority, waiting: Priority) -> int:
        """Steps held before w0 went in, the waiting requests added once r0 has ended (r1, r2 run on)."""
        run = _three_slots([(3, running), (30, running), (30, running)])
        s = run.scheduler
        while s.num_running > 2:  # until r0 has ended
            step = s.schedule()
            assert step is not None
            run.record(s.update(step, run.backend.execute(step)))
        _add_waiting(run, 2, waiting)  # with a slot free: no preemption for a higher class
        held_before = s.counters.admission_held_steps
        while True:
            step = s.schedule()
            assert step is not None
            run.record(s.update(step, run.backend.execute(step)))
            if step.new_requests:
                assert [r.request_id for r in step.new_requests] == ["w0"]
                return s.counters.admission_held_steps - held_before

    # A BATCH backlog behind INTERACTIVE running requests waits for a second slot, here in vain: the steps'
    # limit, then the one free slot...
    assert held_steps(Priority.INTERACTIVE, Priority.BATCH) == 4
    # ...an INTERACTIVE one behind BATCH running requests goes into the first free slot.
    assert held_steps(Priority.BATCH, Priority.INTERACTIVE) == 0


def test_the_wait_needs_decodes_and_budget_left_in_the_step() -> None:
    run = _three_slots([(30, Priority.INTERACTIVE)] * 2)
    s = run.scheduler
    _add_waiting(run, 2)  # a backlog for the one free slot
    # Each case asks the scheduler as schedule() would, with a plan of the step's running part.
    assert not s._hold_admission_this_step(100, BatchPlan(step_id=9, num_prefill_tokens=40))  # no decodes
    assert not s._hold_admission_this_step(0, BatchPlan(step_id=9, num_decode_tokens=2))  # no budget left
    assert s.counters.admission_held_steps == 0
    assert s._hold_admission_this_step(100, BatchPlan(step_id=9, num_decode_tokens=2))
    assert s.counters.admission_held_steps == 1


def test_a_preempted_request_with_results_in_flight_is_no_backlog() -> None:
    run = _three_slots([(30, Priority.INTERACTIVE)] * 2)
    s = run.scheduler
    _add_waiting(run, 2)
    # w0 stands for a request preempted while a step of it was still in flight: admission skips it until its
    # results are back, so w1 alone waits for the one free slot and is not held.
    s.requests["w0"].num_inflight_steps = 1
    assert not s._hold_admission_this_step(100, BatchPlan(step_id=9, num_decode_tokens=2))
    s.requests["w0"].num_inflight_steps = 0
    assert s._hold_admission_this_step(100, BatchPlan(step_id=9, num_decode_tokens=2))
