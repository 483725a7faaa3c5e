"""The worker's step loop: steps run back to back on one thread, their results leave in step order.

The transport (the gRPC servicer) reads steps as they arrive and hands them over with ``submit``; a device
thread runs ``StepLoop.run``, which executes them in order and hands every outcome to ``emit``: a
``StepResult``, a ``StepFailure`` in place of a step that could not run, and ``None`` once, at the end. The
loop knows nothing of gRPC or protobuf, so it is tested with a bare runner.

Pipelined decode (CUDA): the runner may launch step N+1 before step N's sampled ids reach the host. While
such a step is pending and no next step is queued, the loop polls every ``PENDING_POLL_S`` whether its ids
arrived, so its result is emitted without waiting for the next step; while a long eager step launches, the
runner itself hands step N's result to ``post_result`` as soon as its ids are in. A device fault seen while
waiting for those ids fails step N (and any other step run but not answered) at once, like a step that raised.
"""

from __future__ import annotations

import collections
import logging
import queue
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ominix_runtime.contract import DecodeStep, StepResult

log = logging.getLogger(__name__)

# While a launched step's sampled ids are in flight and no next step is queued, how often the device thread
# checks whether they arrived (so the result is posted without waiting for the next step).
PENDING_POLL_S = 0.0002


class StepRunner(Protocol):
    """What the loop needs of a model runner (ominix_worker.runner.ModelRunner)."""

    overlap_steps: bool
    # Set by the loop while it runs: a result that may leave before ``execute_step`` returns (the step before
    # a long eager launch, once its ids are on the host) goes here, ahead of every later one.
    post_result: Callable[[StepResult], None] | None

    def can_overlap(self) -> bool: ...

    def announce(self, step: DecodeStep) -> None:
        """Called as soon as ``step`` is built, in step order, before it is queued to run (a group leader
        forwards it to its peers here, so they start on it as soon as they are free)."""

    def execute_step(self, step: DecodeStep) -> StepResult | None: ...

    def has_pending(self) -> bool: ...

    def pending_ready(self) -> bool: ...

    def finish_pending(self) -> None: ...

    def reset_pending(self) -> None: ...

    def take_results(self) -> list[StepResult]: ...

    def reset(self) -> None: ...


@dataclass(frozen=True, slots=True)
class StepFailure:
    """A step that did not run (or failed while running); the engine fails the requests it held."""

    step_id: int
    message: str


StepOutcome = StepResult | StepFailure


@dataclass(frozen=True, slots=True)
class _Arrival:
    """A step read from the transport: ready to run, or the failure to report in its place."""

    step_id: int
    step: DecodeStep | None
    error: str = ""


_END_OF_STEPS = _Arrival(0, None, "the engine closed its stream")


class StepLoop:
    """One engine stream's steps on one device thread.

    ``submit`` (transport side) checks that step ids increase and builds the step; ``run`` (device thread)
    executes steps until ``close``; ``emit`` receives each outcome in step order and ``None`` at the end.
    ``emit`` is called on the device thread and must only hand the outcome over (e.g. to an event loop).
    """

    def __init__(
        self,
        runner: StepRunner,
        emit: Callable[[StepOutcome | None], None],
        poll_s: float = PENDING_POLL_S,
    ) -> None:
        self._runner = runner
        self._emit = emit
        self._poll_s = poll_s
        self._steps: queue.SimpleQueue[_Arrival] = queue.SimpleQueue()
        self._last_step_id = 0
        # Steps handed to the runner whose result or failure has not been emitted yet, oldest first: when the
        # device fails, each of them is answered with a failure rather than never.
        self._unanswered: collections.deque[int] = collections.deque()

    # ---- transport side ----------------------------------------------------------------------------

    def submit(self, step_id: int, build: Callable[[], DecodeStep]) -> None:
        """Queue step ``step_id``, built by ``build`` here (on the caller's thread, while the device computes).

        A step id that does not follow the last one, or a step that cannot be built, is queued as a failure
        so it is reported in order.
        """
        if step_id <= self._last_step_id:
            self._steps.put(
                _Arrival(step_id, None, f"step_id {step_id} does not follow {self._last_step_id}")
            )
            return
        self._last_step_id = step_id
        try:
            step = build()
        except Exception as exc:  # noqa: BLE001 - reported to the engine, the worker lives on
            log.error("step %d failed:\n%s", step_id, traceback.format_exc())
            self._steps.put(_Arrival(step_id, None, f"step {step_id} failed: {type(exc).__name__}: {exc}"))
            return
        self._runner.announce(step)
        self._steps.put(_Arrival(step_id, step))

    def close(self) -> None:
        """No more steps: ``run`` finishes the step it may be running (and any pending one) and returns."""
        self._steps.put(_END_OF_STEPS)

    # ---- device thread -----------------------------------------------------------------------------

    def run(self) -> None:
        """Execute steps until ``close``; then drop every request's state (the stream is over)."""
        runner = self._runner
        try:
            runner.overlap_steps = runner.can_overlap()
            runner.post_result = self._emit_result
            while True:
                arrival = self._next_arrival()
                if arrival is _END_OF_STEPS:
                    self._finish_pending()
                    return
                if arrival.step is None:
                    self._finish_pending()
                    self._emit(StepFailure(arrival.step_id, arrival.error))
                    continue
                self._execute(arrival.step_id, arrival.step)
        finally:
            runner.post_result = None
            try:
                runner.reset()
            finally:
                self._emit(None)  # the transport must hear the end however the loop ended

    def _execute(self, step_id: int, step: DecodeStep) -> None:
        self._unanswered.append(step_id)
        try:
            result = self._runner.execute_step(step)
        except Exception as exc:  # noqa: BLE001 - reported to the engine, the worker lives on
            log.error("step %d failed:\n%s", step_id, traceback.format_exc())
            self._finish_pending(before=step_id)  # an earlier pending step: its own result or cause first
            self._fail_unanswered(f"{type(exc).__name__}: {exc}")  # this step, and any lost with it
            return
        if result is not None:
            self._emit_result(result)
        self._emit_results()

    def _next_arrival(self) -> _Arrival:
        while self._runner.has_pending():
            try:
                return self._steps.get(timeout=self._poll_s)
            except queue.Empty:
                if self._pending_ready():
                    self._finish_pending()
        return self._steps.get()

    def _pending_ready(self) -> bool:
        """Whether the pending step's ids arrived; a device fault seen while asking fails it at once (no
        answer would ever come, and the engine would learn the cause only from its step timeout)."""
        try:
            return self._runner.pending_ready()
        except Exception as exc:  # noqa: BLE001 - reported to the engine, the worker lives on
            self._pending_failed(exc)
            return False

    def _finish_pending(self, before: int | None = None) -> None:
        """Emit the pending step's result (and any queued before it), or if the device failed, a failure with
        the cause for each step run but not answered (only those before step ``before``, when given)."""
        try:
            self._runner.finish_pending()
        except Exception as exc:  # noqa: BLE001 - reported to the engine, the worker lives on
            self._pending_failed(exc, before)
            return
        self._emit_results()

    def _pending_failed(self, exc: Exception, before: int | None = None) -> None:
        log.error("pending step failed:\n%s", traceback.format_exc())
        self._runner.reset_pending()
        self._emit_results()
        self._fail_unanswered(f"{type(exc).__name__}: {exc}", before)

    def _fail_unanswered(self, cause: str, before: int | None = None) -> None:
        """Each step run but not answered (before step ``before``, when given) fails with ``cause``, in order."""
        unanswered = self._unanswered
        while unanswered and (before is None or unanswered[0] < before):
            step_id = unanswered.popleft()
            self._emit(StepFailure(step_id, f"step {step_id} failed: {cause}"))

    def _emit_results(self) -> None:
        for result in self._runner.take_results():
            self._emit_result(result)

    def _emit_result(self, result: StepResult) -> None:
        """Emit ``result``, after a failure for each earlier step that will never have one (lost when the
        device failed between them), so outcomes stay one per step and in step order."""
        unanswered = self._unanswered
        while unanswered and unanswered[0] < result.step_id:
            lost = unanswered.popleft()
            self._emit(StepFailure(lost, f"step {lost} failed: no result came back for it"))
        if unanswered and unanswered[0] == result.step_id:
            unanswered.popleft()
        self._emit(result)
