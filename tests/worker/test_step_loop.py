"""The step loop without gRPC: order, failures, pipelined results, end of stream, and a real tiny runner."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ominix_runtime.contract import (
    DecodeStep,
    NewRequestData,
    RunningRequestData,
    SamplingParams,
    StepResult,
)
from ominix_worker.runner import build_runner
from ominix_worker.step_loop import StepFailure, StepLoop, StepOutcome

JOIN_TIMEOUT_S = 10.0


class ScriptedRunner:
    """A runner whose steps fail on request and, with ``pipelined``, finish one step late (like CUDA)."""

    def __init__(self, pipelined: bool = False, fail_steps: frozenset[int] = frozenset()) -> None:
        self.pipelined = pipelined
        self.fail_steps = fail_steps
        self.overlap_steps = False
        self.post_result: Callable[[StepResult], None] | None = None
        self.executed: list[int] = []
        self.announced: list[int] = []
        self.resets = 0
        self._pending: int | None = None
        self._ready_at = 0.0
        self._results: list[StepResult] = []

    def can_overlap(self) -> bool:
        return self.pipelined

    def announce(self, step: DecodeStep) -> None:
        self.announced.append(step.step_id)

    def execute_step(self, step: DecodeStep) -> StepResult | None:
        if step.step_id in self.fail_steps:
            raise RuntimeError(f"device fault in {step.step_id}")
        self.executed.append(step.step_id)
        if not self.overlap_steps:
            return StepResult(step.step_id)
        self.finish_pending()
        self._pending = step.step_id
        self._ready_at = time.monotonic() + 0.01  # ids "arrive" 10 ms after launch
        return None

    def has_pending(self) -> bool:
        return self._pending is not None

    def pending_ready(self) -> bool:
        return time.monotonic() >= self._ready_at

    def finish_pending(self) -> None:
        if self._pending is not None:
            self._results.append(StepResult(self._pending))
            self._pending = None

    def reset_pending(self) -> None:
        self._pending = None

    def take_results(self) -> list[StepResult]:
        results, self._results = self._results, []
        return results

    def reset(self) -> None:
        self.resets += 1


class Collector:
    """``emit`` target: records outcomes; ``wait_for(n)`` blocks until n have arrived."""

    def __init__(self) -> None:
        self.outcomes: list[StepOutcome | None] = []
        self._cond = threading.Condition()

    def __call__(self, outcome: StepOutcome | None) -> None:
        with self._cond:
            self.outcomes.append(outcome)
            self._cond.notify_all()

    def wait_for(self, n: int) -> list[StepOutcome | None]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.outcomes) >= n, JOIN_TIMEOUT_S), self.outcomes
            return list(self.outcomes)


def start(runner: ScriptedRunner | object) -> tuple[StepLoop, Collector, threading.Thread]:
    collector = Collector()
    loop = StepLoop(runner, collector)  # type: ignore[arg-type]  # ScriptedRunner satisfies StepRunner
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    return loop, collector, thread


def step_ids(outcomes: list[StepOutcome | None]) -> list[int | None]:
    return [o.step_id if o is not None else None for o in outcomes]


def test_results_leave_in_step_order_and_the_end_resets_state() -> None:
    runner = ScriptedRunner()
    loop, out, thread = start(runner)
    for step_id in (1, 2, 3):
        loop.submit(step_id, lambda step_id=step_id: DecodeStep(step_id))
    loop.close()
    thread.join(JOIN_TIMEOUT_S)
    assert not thread.is_alive()
    assert step_ids(out.outcomes) == [1, 2, 3, None]
    assert all(isinstance(o, StepResult) for o in out.outcomes[:3])
    assert runner.resets == 1


def test_out_of_order_ids_and_unbuildable_steps_fail_in_place() -> None:
    runner = ScriptedRunner()
    loop, out, thread = start(runner)
    loop.submit(2, lambda: DecodeStep(2))
    loop.submit(2, lambda: DecodeStep(2))  # does not follow 2
    loop.submit(3, lambda: (_ for _ in ()).throw(ValueError("bad field")))
    loop.submit(4, lambda: DecodeStep(4))
    loop.close()
    thread.join(JOIN_TIMEOUT_S)
    outcomes = out.outcomes
    assert step_ids(outcomes) == [2, 2, 3, 4, None]
    assert isinstance(outcomes[1], StepFailure) and "does not follow 2" in outcomes[1].message
    assert isinstance(outcomes[2], StepFailure) and "ValueError: bad field" in outcomes[2].message
    assert isinstance(outcomes[3], StepResult)
    assert runner.executed == [2, 4]
    assert runner.announced == [2, 4]  # only steps that will run are forwarded to a group's peers


def test_a_failing_step_is_reported_and_the_loop_lives_on() -> None:
    runner = ScriptedRunner(fail_steps=frozenset({2}))
    loop, out, thread = start(runner)
    for step_id in (1, 2, 3):
        loop.submit(step_id, lambda step_id=step_id: DecodeStep(step_id))
    loop.close()
    thread.join(JOIN_TIMEOUT_S)
    failure = out.outcomes[1]
    assert isinstance(failure, StepFailure)
    assert failure.message == "step 2 failed: RuntimeError: device fault in 2"
    assert step_ids(out.outcomes) == [1, 2, 3, None]


def test_a_pending_step_is_emitted_without_waiting_for_the_next() -> None:
    runner = ScriptedRunner(pipelined=True)
    loop, out, thread = start(runner)
    loop.submit(1, lambda: DecodeStep(1))
    # No step 2 follows: the poll must notice step 1's ids arrived and emit its result on its own.
    assert step_ids(out.wait_for(1)) == [1]
    assert runner.overlap_steps
    loop.submit(2, lambda: DecodeStep(2))
    loop.submit(3, lambda: DecodeStep(3))
    loop.close()
    thread.join(JOIN_TIMEOUT_S)
    assert step_ids(out.outcomes) == [1, 2, 3, None]


class EarlyPostingRunner(ScriptedRunner):
    """Pipelined, and posts the pending step's result itself while it "launches" the next step (as the CUDA
    runner does with early results on, the default), before ``execute_step`` returns."""

    def __init__(self) -> None:
        super().__init__(pipelined=True)
        self.posted_inside: list[int] = []
        self.post_result_after_run: object = "unset"

    def execute_step(self, step: DecodeStep) -> StepResult | None:
        if self._pending is not None and self.post_result is not None:
            pending, self._pending = self._pending, None
            self.posted_inside.append(pending)
            self.post_result(StepResult(pending))
        return super().execute_step(step)

    def reset(self) -> None:
        self.post_result_after_run = self.post_result
        super().reset()


def test_a_result_posted_during_a_launch_keeps_the_order() -> None:
    runner = EarlyPostingRunner()
    runner.pending_ready = lambda: False  # type: ignore[method-assign]  # only the early post finishes a step
    loop, out, thread = start(runner)
    for step_id in (1, 2, 3):
        loop.submit(step_id, lambda step_id=step_id: DecodeStep(step_id))
    loop.close()
    thread.join(JOIN_TIMEOUT_S)
    assert runner.posted_inside == [1, 2]  # 3 is finished by the loop at the end of the stream
    assert step_ids(out.outcomes) == [1, 2, 3, None]
    assert runner.post_result_after_run is None  # the loop takes its emit back before the runner resets


def test_a_failure_after_a_pending_step_keeps_the_order() -> None:
    runner = ScriptedRunner(pipelined=True, fail_steps=frozenset({2}))
    runner.pending_ready = lambda: False  # type: ignore[method-assign]  # ids never arrive by themselves
    loop, out, thread = start(runner)
    loop.submit(1, lambda: DecodeStep(1))
    loop.submit(2, lambda: DecodeStep(2))
    loop.close()
    thread.join(JOIN_TIMEOUT_S)
    assert step_ids(out.outcomes) == [1, 2, None]
    assert isinstance(out.outcomes[0], StepResult) and isinstance(out.outcomes[1], StepFailure)


DEVICE_FAULT = "CUDA error: an illegal memory access was encountered"


class FaultyPendingRunner(ScriptedRunner):
    """Pipelined; asking whether step ``fault_step``'s ids arrived (``in_poll``) or waiting for them raises once,
    as a sticky device error surfaces in the event query or synchronize of the step after it."""

    def __init__(self, fault_step: int, in_poll: bool, fail_steps: frozenset[int] = frozenset()) -> None:
        super().__init__(pipelined=True, fail_steps=fail_steps)
        self.fault_step = fault_step
        self.in_poll = in_poll

    def _fault(self) -> None:
        if self._pending == self.fault_step:
            self.fault_step = 0
            raise RuntimeError(DEVICE_FAULT)

    def pending_ready(self) -> bool:
        if self.in_poll:
            self._fault()
        return super().pending_ready()

    def finish_pending(self) -> None:
        if not self.in_poll:
            self._fault()
        super().finish_pending()


@pytest.mark.parametrize("in_poll", [True, False], ids=["polling", "finishing"])
def test_a_fault_on_a_pending_step_fails_it_at_once_and_the_loop_lives_on(in_poll: bool) -> None:
    """A device fault raised while the loop waits for a pending step's ids (its event query or its finish) is
    that step's failure, emitted at once with the cause, with the pending state dropped; the loop then answers
    the steps that follow, in order."""
    runner = FaultyPendingRunner(fault_step=1, in_poll=in_poll)
    loop, out, thread = start(runner)
    loop.submit(1, lambda: DecodeStep(1))  # no next step queued: the loop polls step 1 and meets the fault
    failure = out.wait_for(1)[0]
    assert isinstance(failure, StepFailure) and failure.step_id == 1
    assert failure.message == f"step 1 failed: RuntimeError: {DEVICE_FAULT}"
    assert not runner.has_pending()
    loop.submit(2, lambda: DecodeStep(2))
    loop.submit(3, lambda: DecodeStep(3))
    loop.close()
    thread.join(JOIN_TIMEOUT_S)
    assert not thread.is_alive()
    assert step_ids(out.outcomes) == [1, 2, 3, None]
    assert all(isinstance(o, StepResult) for o in out.outcomes[1:3])


def test_a_failing_step_after_a_faulty_pending_one_fails_both_in_order() -> None:
    """Step 2 raises while step 1 is pending and finishing step 1 raises too: step 1 fails with its own cause,
    then step 2 with its own, each once."""
    runner = FaultyPendingRunner(fault_step=1, in_poll=False, fail_steps=frozenset({2}))
    runner.pending_ready = lambda: False  # type: ignore[method-assign]  # only step 2's failure finishes step 1
    loop, out, thread = start(runner)
    loop.submit(1, lambda: DecodeStep(1))
    loop.submit(2, lambda: DecodeStep(2))
    loop.close()
    thread.join(JOIN_TIMEOUT_S)
    assert step_ids(out.outcomes) == [1, 2, None]
    assert [o.message for o in out.outcomes[:2]] == [  # type: ignore[union-attr]  # both are failures
        f"step 1 failed: RuntimeError: {DEVICE_FAULT}",
        "step 2 failed: RuntimeError: device fault in 2",
    ]


class LosingRunner(ScriptedRunner):
    """Pipelined; a failing step drops the pending step's ids before it raises (a launch that fails after it took
    them over)."""

    def execute_step(self, step: DecodeStep) -> StepResult | None:
        if step.step_id in self.fail_steps:
            self._pending = None
        return super().execute_step(step)


def test_a_step_lost_with_a_failing_one_fails_too() -> None:
    """A pending step whose result a failing step took down with it is answered with a failure (the failing
    step's cause) before that step's own, so every step gets one outcome, in order."""
    runner = LosingRunner(pipelined=True, fail_steps=frozenset({2}))
    runner.pending_ready = lambda: False  # type: ignore[method-assign]  # step 1 stays pending until step 2
    loop, out, thread = start(runner)
    loop.submit(1, lambda: DecodeStep(1))
    loop.submit(2, lambda: DecodeStep(2))
    loop.submit(3, lambda: DecodeStep(3))
    loop.close()
    thread.join(JOIN_TIMEOUT_S)
    assert step_ids(out.outcomes) == [1, 2, 3, None]
    assert [o.message for o in out.outcomes[:2]] == [  # type: ignore[union-attr]  # both are failures
        "step 1 failed: RuntimeError: device fault in 2",
        "step 2 failed: RuntimeError: device fault in 2",
    ]
    assert isinstance(out.outcomes[2], StepResult)


def test_the_end_is_emitted_however_the_loop_ends() -> None:
    """A loop that fails outside any step still drops the state and emits the end, so the transport is not left
    waiting for outcomes that will never come."""
    runner = ScriptedRunner()

    def broken() -> bool:
        raise RuntimeError("no device")

    runner.can_overlap = broken  # type: ignore[method-assign]
    out = Collector()
    with pytest.raises(RuntimeError, match="no device"):
        StepLoop(runner, out).run()  # type: ignore[arg-type]  # ScriptedRunner satisfies StepRunner
    assert out.outcomes == [None] and runner.resets == 1


def test_the_loop_drives_a_real_runner_like_direct_calls(tiny_model_dir: Callable[[str], Path]) -> None:
    runner = build_runner(str(tiny_model_dir("llama")), num_blocks=16, block_size=16)
    sampling = SamplingParams(temperature=0.7, seed=5)
    steps = [
        DecodeStep(1, new_requests=[NewRequestData("a", list(range(3, 20)), sampling, [0, 1], 0, 17, 0)])
    ]
    steps += [DecodeStep(i, running_requests=[RunningRequestData("a", [], 1)]) for i in range(2, 6)]
    direct = [runner.execute_step(step) for step in steps]
    runner.reset()

    loop, out, thread = start(runner)
    for step in steps:
        loop.submit(step.step_id, lambda step=step: step)
    loop.close()
    thread.join(JOIN_TIMEOUT_S)
    looped = out.outcomes
    assert looped[-1] is None and not runner.requests  # state dropped at the end of the stream
    assert [[o.sampled_token_id for o in r.outputs] for r in looped[:-1]] == [  # type: ignore[union-attr]  # every outcome here is a result
        [o.sampled_token_id for o in r.outputs]
        for r in direct  # type: ignore[union-attr]  # every outcome here is a result
    ]


@pytest.mark.parametrize("pipelined", [False, True])
def test_close_while_idle_ends_the_loop(pipelined: bool) -> None:
    runner = ScriptedRunner(pipelined=pipelined)
    loop, out, thread = start(runner)
    loop.close()
    thread.join(JOIN_TIMEOUT_S)
    assert not thread.is_alive() and out.outcomes == [None] and runner.resets == 1


def test_a_group_leader_hands_post_result_to_its_runner() -> None:
    from types import SimpleNamespace

    from ominix_worker.rank_group import GroupLeader

    runner = SimpleNamespace(post_result=None)
    leader = GroupLeader(runner, group=None, sender=object())  # type: ignore[arg-type]  # only the runner is used
    sink: list[StepOutcome | None] = []
    leader.post_result = sink.append
    assert runner.post_result == sink.append and leader.post_result == sink.append
    leader.post_result = None
    assert runner.post_result is None
