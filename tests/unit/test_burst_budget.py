"""A burst's budget: a step with decodes takes up to max_batch_tokens_in_burst while every waiting request has a
free running slot, together they hold at least burst_backlog_tokens tokens, the free KV holds them, and no
running request is of a higher class than the first of them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from sched_helpers import Run, drive, make, request

from ominix_runtime.contract import BatchPlan, Done, FinishReason, Priority
from ominix_runtime.engine.config import SchedulerConfig
from ominix_runtime.testing.fake_backend import FakeConfig

WHOLE, WITH_DECODES, IN_BURST, THRESHOLD = 64, 16, 32, 48


@dataclass(frozen=True, slots=True)
class StepView:
    waiting: int  # requests waiting as the step was built
    waiting_tokens: int  # their tokens
    free_slots: int  # running slots free as the step was built
    plan: BatchPlan  # what the scheduler decided for the step

    @property
    def a_burst(self) -> bool:
        """A step with decodes while THRESHOLD or more prompt tokens wait, every waiting request with a free
        slot (KV is ample and every request of one class in these runs): the burst's budget, when the rule
        is on."""
        return (
            self.plan.num_decode_tokens > 0
            and self.waiting_tokens >= THRESHOLD
            and self.waiting <= self.free_slots
        )


def _config(
    max_running: int = 16, burst_tokens: int = THRESHOLD, in_burst: int = IN_BURST
) -> SchedulerConfig:
    # The limit on prompts beside decodes and the two-slot admission are off: only the budgets shape a step.
    return SchedulerConfig(
        max_running_requests=max_running,
        max_batch_tokens_with_decodes=WITH_DECODES,
        burst_backlog_tokens=burst_tokens,
        max_batch_tokens_in_burst=in_burst,
        prefill_tokens_beside_decodes=0,
        backlog_admission_slots=0,
    )


def _run(
    config: SchedulerConfig,
    running: int = 2,
    waiting: list[int] | None = None,
    running_max_tokens: int = 30,
    waiting_max_tokens: int = 4,
    kv_num_blocks: int = 512,
    running_priority: Priority = Priority.INTERACTIVE,
) -> tuple[Run, list[StepView]]:
    """``running`` requests r0.. (8-token prompts) decode after their first step, then requests w0.. with
    prompts of ``waiting`` tokens (eight of 12 by default) arrive together; one step in flight at a time
    until everything has ended. Returns the run and a view of every step after the first."""
    run = make(FakeConfig(max_batch_tokens=WHOLE, kv_block_size=4, kv_num_blocks=kv_num_blocks), config)
    s = run.scheduler
    for i in range(running):
        req = request(f"r{i}", [10 + i] * 8, max_tokens=running_max_tokens, seed=i)
        req.priority = running_priority
        s.add_request(req)
    first = s.schedule()
    assert first is not None and len(first.new_requests) == running
    run.record(s.update(first, run.backend.execute(first)))
    for i, n in enumerate([12] * 8 if waiting is None else waiting):
        s.add_request(
            request(f"w{i}", [100 + i + k % 3 for k in range(n)], max_tokens=waiting_max_tokens, seed=50 + i)
        )
    views: list[StepView] = []
    while s.requests:
        free = s.max_running_requests - s.num_running
        queued = s.waiting.num_waiting_tokens
        num_waiting = s.num_waiting
        step = s.schedule()
        assert step is not None
        plan = s.last_plan
        assert plan is not None and step.num_scheduled_tokens == plan.num_tokens <= plan.token_budget
        views.append(StepView(num_waiting, queued, free, plan))
        run.record(s.update(step, run.backend.execute(step)))
        s.check_integrity()
        assert not run.backend.violations, run.backend.violations
    assert s.registry.num_leased_blocks == 0
    return run, views


def _ids(running: int = 2, waiting: int = 8) -> list[str]:
    return [*(f"r{i}" for i in range(running)), *(f"w{i}" for i in range(waiting))]


def _prompts_done_at(views: list[StepView]) -> int:
    """The step that admitted the last waiting request."""
    return next(i for i, v in enumerate(views) if v.waiting == 0) - 1


def test_a_burst_beside_decodes_takes_the_burst_budget_until_fewer_tokens_wait_with_the_same_tokens() -> None:
    run, views = _run(_config())
    assert run.scheduler.max_batch_tokens_in_burst == IN_BURST
    # Eight 12-token prompts (96 tokens) beside two decodes, sixteen slots: a burst while 48 or more wait,
    # and those steps fill the burst's budget.
    burst = [v for v in views if v.a_burst]
    assert len(burst) == 2 and views[:2] == burst
    assert run.scheduler.counters.burst_budget_steps == 2  # what ominix_burst_budget_steps_total exports
    assert [(v.waiting_tokens, v.plan.token_budget, v.plan.num_tokens) for v in burst] == [
        (96, IN_BURST, IN_BURST),
        (60, IN_BURST, IN_BURST),
    ]
    # Then fewer than 48 wait (later none): the budget with decodes, prompts still going in beside them.
    rest = views[2:]
    assert all(
        v.plan.num_decode_tokens > 0 and v.waiting_tokens < THRESHOLD and v.plan.token_budget == WITH_DECODES
        for v in rest
    )
    assert rest[0].waiting_tokens > 0 and rest[0].plan.num_prefill_tokens > 0

    # The same workload with the rule off: the budget with decodes throughout, the prompts in later...
    off, off_views = _run(_config(burst_tokens=0))
    assert off.scheduler.max_batch_tokens_in_burst == WITH_DECODES
    assert [v.plan.token_budget for v in off_views] == [WITH_DECODES] * len(off_views)
    assert sum(v.a_burst for v in off_views) > 2  # the same conditions held for longer
    assert _prompts_done_at(views) < _prompts_done_at(off_views)
    # ...and the same tokens: every request runs to its max_tokens.
    for rid in _ids():
        end = run.terminal(rid)
        assert isinstance(end, Done) and end.finish_reason == FinishReason.LENGTH
        assert run.tokens(rid) == off.tokens(rid)
        assert len(run.tokens(rid)) == (30 if rid.startswith("r") else 4)


def test_a_queue_for_running_slots_keeps_the_budget_with_decodes() -> None:
    # Four long decodes of six slots: at most two free while 96 prompt tokens (eight requests) wait.
    run, views = _run(_config(max_running=6), running=4, running_max_tokens=40)
    queued = [v for v in views if v.plan.num_decode_tokens and v.waiting_tokens >= THRESHOLD]
    assert len(queued) >= 5 and all(v.waiting > v.free_slots for v in queued)
    assert all(v.plan.token_budget == WITH_DECODES for v in views)
    assert all(isinstance(run.terminal(rid), Done) for rid in _ids(running=4))


@pytest.mark.parametrize(
    ("max_running", "budget"),
    [
        pytest.param(9, WITH_DECODES, id="one-waiting-request-more-than-free-slots"),
        pytest.param(10, IN_BURST, id="as-many-free-slots-as-waiting-requests"),
    ],
)
def test_every_waiting_request_needs_a_free_slot_for_the_burst_budget(max_running: int, budget: int) -> None:
    _, views = _run(_config(max_running=max_running))
    first = views[0]
    # Eight requests (96 tokens) wait beside the two that decode.
    assert (first.waiting, first.free_slots, first.waiting_tokens) == (8, max_running - 2, 96)
    assert (
        first.plan.num_decode_tokens > 0
        and first.plan.token_budget == budget
        and first.plan.num_tokens == budget
    )


def _first_step_of_eight_waiting_takes(budget: int, run: Run, views: list[StepView]) -> None:
    """The first step after the burst arrives (eight 12-token prompts, a slot for each, beside two decodes)
    has ``budget``, and every request ends."""
    first = views[0]
    assert (
        first.plan.num_decode_tokens > 0 and first.waiting_tokens == 96 and first.waiting <= first.free_slots
    )
    assert first.plan.token_budget == budget
    assert all(isinstance(run.terminal(rid), Done) for rid in _ids())


@pytest.mark.parametrize(
    ("kv_num_blocks", "budget"),
    [
        # Two decoders hold 4 blocks (8 tokens + outputs); eight waiting prompts of 12 tokens need 24 more.
        pytest.param(27, WITH_DECODES, id="the-free-kv-cannot-hold-the-waiting-prompts"),
        pytest.param(40, IN_BURST, id="the-free-kv-holds-them"),
    ],
)
def test_a_burst_needs_free_kv_for_its_waiting_prompts(kv_num_blocks: int, budget: int) -> None:
    _first_step_of_eight_waiting_takes(budget, *_run(_config(), kv_num_blocks=kv_num_blocks))


@pytest.mark.parametrize(
    ("running_priority", "budget"),
    [
        pytest.param(Priority.REALTIME, WITH_DECODES, id="a-higher-class-decodes"),
        pytest.param(Priority.INTERACTIVE, IN_BURST, id="the-same-class-decodes"),
        pytest.param(Priority.BATCH, IN_BURST, id="a-lower-class-decodes"),
    ],
)
def test_streams_of_a_higher_class_than_the_burst_keep_the_budget_with_decodes(
    running_priority: Priority, budget: int
) -> None:
    _first_step_of_eight_waiting_takes(budget, *_run(_config(), running_priority=running_priority))


@pytest.mark.parametrize(
    ("waiting", "budget"),
    [
        pytest.param([12, 12, 12], WITH_DECODES, id="36-tokens"),
        pytest.param([12, 12, 12, 11], WITH_DECODES, id="47-tokens"),
        pytest.param([12, 12, 12, 12], IN_BURST, id="48-tokens"),
        pytest.param([40, 40], IN_BURST, id="80-tokens-in-two-requests"),
    ],
)
def test_the_burst_budget_needs_the_threshold_of_waiting_prompt_tokens(
    waiting: list[int], budget: int
) -> None:
    run, views = _run(_config(), waiting=waiting)
    assert views[0].waiting_tokens == sum(waiting) and views[0].plan.num_decode_tokens > 0
    assert views[0].plan.token_budget == budget and views[0].plan.num_tokens == budget
    if budget == WITH_DECODES:
        assert all(v.plan.token_budget == WITH_DECODES for v in views)
    assert all(isinstance(run.terminal(rid), Done) for rid in _ids(waiting=len(waiting)))


@pytest.mark.parametrize(
    ("burst_tokens", "in_burst"),
    [
        pytest.param(0, IN_BURST, id="no-threshold"),
        pytest.param(THRESHOLD, 0, id="no-burst-budget"),
        pytest.param(0, 0, id="both-0"),
    ],
)
def test_either_setting_0_turns_the_burst_budget_off(burst_tokens: int, in_burst: int) -> None:
    run, views = _run(_config(burst_tokens=burst_tokens, in_burst=in_burst))
    assert run.scheduler.max_batch_tokens_in_burst == WITH_DECODES
    assert any(v.a_burst for v in views)
    assert all(v.plan.token_budget == WITH_DECODES for v in views)
    assert run.scheduler.counters.burst_budget_steps == 0


def test_a_burst_budget_below_the_budget_with_decodes_never_lowers_it() -> None:
    run, views = _run(_config(in_burst=8))
    assert run.scheduler.max_batch_tokens_in_burst == WITH_DECODES
    assert (
        views[0].a_burst
        and views[0].plan.token_budget == WITH_DECODES
        and views[0].plan.num_tokens == WITH_DECODES
    )
    assert all(v.plan.token_budget == WITH_DECODES for v in views)


def test_a_burst_budget_above_max_batch_tokens_is_clamped_to_it() -> None:
    run, views = _run(_config(in_burst=1000))
    assert run.scheduler.max_batch_tokens_in_burst == WHOLE
    # 96 tokens wait beside two decodes: the whole budget, 62 of them admitted.
    assert views[0].a_burst and views[0].plan.token_budget == WHOLE and views[0].plan.num_tokens == WHOLE


def test_where_the_budget_with_decodes_is_the_whole_budget_a_burst_changes_nothing() -> None:
    # As on the CPU profile (2,048 tokens a step, below the budget with decodes): one budget for every step.
    run = make(FakeConfig(max_batch_tokens=WITH_DECODES, kv_block_size=4, kv_num_blocks=512), _config())
    s = run.scheduler
    assert (
        s.max_batch_tokens == s.max_batch_tokens_with_decodes == s.max_batch_tokens_in_burst == WITH_DECODES
    )
    s.add_request(request("r0", [10] * 8, max_tokens=12, seed=1))
    for i in range(8):
        s.add_request(request(f"w{i}", [100 + i] * 12, max_tokens=4, seed=50 + i))
    budgets: set[int] = set()
    while s.requests:
        step = s.schedule()
        assert step is not None and s.last_plan is not None
        budgets.add(s.last_plan.token_budget)
        run.record(s.update(step, run.backend.execute(step)))
        s.check_integrity()
    assert budgets == {WITH_DECODES} and s.registry.num_leased_blocks == 0


def test_a_step_without_decodes_keeps_max_batch_tokens_whatever_waits() -> None:
    run = make(FakeConfig(max_batch_tokens=WHOLE, kv_block_size=4, kv_num_blocks=512), _config())
    s = run.scheduler
    for i in range(8):
        s.add_request(request(f"w{i}", [100 + i] * 12, max_tokens=4, seed=i))
    step = s.schedule()
    plan = s.last_plan
    assert step is not None and plan is not None
    # A burst of 96 tokens with slots for all, but nothing decodes yet: the whole budget, not the burst's.
    assert plan.num_decode_tokens == 0 and plan.token_budget == WHOLE and plan.num_prefill_tokens == WHOLE
    run.record(s.update(step, run.backend.execute(step)))
    # Then decodes beside the 24 tokens still waiting (fewer than the threshold): the budget with decodes.
    assert sum(len(r.all_token_ids) for r in s.waiting) == 24
    step = s.schedule()
    plan = s.last_plan
    assert step is not None and plan is not None
    assert plan.num_decode_tokens > 0 and plan.token_budget == WITH_DECODES
    run.record(s.update(step, run.backend.execute(step)))
    s.check_integrity()
    drive(run, max_inflight=1)  # the rest, integrity and the fake worker's checks after every step
    assert s.registry.num_leased_blocks == 0
    assert all(isinstance(run.terminal(f"w{i}"), Done) for i in range(8))


def test_a_sliding_window_group_counts_a_waiting_prompt_as_its_window_and_one_chunk() -> None:
    # One sliding-window group of 40 blocks of 4 (a window of 8 tokens): two waiting 200-token prompts would
    # take 100 blocks whole, but such a group only ever holds the window and a chunk of each.
    fake = FakeConfig(max_batch_tokens=WHOLE, kv_block_size=4, kv_num_blocks=40, sliding_window=8)
    run = make(fake, _config())
    s = run.scheduler
    s.add_request(request("r0", [10] * 8, max_tokens=30, seed=1))
    first = s.schedule()
    assert first is not None
    run.record(s.update(first, run.backend.execute(first)))
    for i in range(2):
        s.add_request(request(f"w{i}", [100 + i + k % 5 for k in range(200)], max_tokens=4, seed=50 + i))
    step = s.schedule()
    assert step is not None and s.last_plan is not None
    assert s.last_plan.num_decode_tokens == 1 and s.last_plan.token_budget == IN_BURST
    run.record(s.update(step, run.backend.execute(step)))
    drive(run, max_inflight=1)  # the rest, integrity and the fake worker's checks after every step
    assert s.registry.num_leased_blocks == 0 and s.counters.preemptions == 0
    assert all(isinstance(run.terminal(rid), Done) for rid in ("r0", "w0", "w1"))
