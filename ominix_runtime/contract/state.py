"""Request lifecycle: states, the allowed-transitions table and finish reasons."""

from __future__ import annotations

from enum import IntEnum


class RequestState(IntEnum):
    WAITING = 0  # admitted, holds no KV
    PREFILL = 1  # prompt being computed (possibly over several chunked steps)
    DECODE = 2  # generating one token per step
    DRAINING = 3  # a stop condition fired; in-flight steps still being collected
    PREEMPTED = 4  # KV taken back; goes to WAITING and is recomputed
    FINISHED = 5  # stop or length
    ABORTED = 6  # client or operator abort, deadline
    FAILED = 7  # backend error


class FinishReason(IntEnum):
    """Values match ``ominix.runtime.v1.FinishReason``."""

    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4


TERMINAL_STATES: frozenset[RequestState] = frozenset(
    {RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED}
)

S = RequestState
ALLOWED_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.WAITING: frozenset({S.PREFILL, S.DECODE, S.FINISHED, S.ABORTED, S.FAILED}),
    S.PREFILL: frozenset({S.PREFILL, S.DECODE, S.DRAINING, S.PREEMPTED, S.FINISHED, S.ABORTED, S.FAILED}),
    S.DECODE: frozenset({S.DRAINING, S.PREEMPTED, S.FINISHED, S.ABORTED, S.FAILED}),
    S.DRAINING: frozenset({S.FINISHED, S.ABORTED, S.FAILED}),
    S.PREEMPTED: frozenset({S.WAITING, S.FINISHED, S.ABORTED, S.FAILED}),
    S.FINISHED: frozenset(),
    S.ABORTED: frozenset(),
    S.FAILED: frozenset(),
}
"""WAITING → DECODE is legal: a resumed request whose prompt is fully cached starts decoding at once.
PREEMPTED/WAITING → FINISHED is legal: a token that was in flight when the request was preempted, or a stop
string found in output produced before the preemption, ends a request that is waiting to be resumed."""
del S

FINISH_REASON_OF_STATE: dict[RequestState, tuple[FinishReason, ...]] = {
    RequestState.FINISHED: (FinishReason.STOP, FinishReason.LENGTH),
    RequestState.ABORTED: (FinishReason.ABORT,),
    RequestState.FAILED: (FinishReason.ERROR,),
}


class IllegalTransition(ValueError):
    """Raised when code tries a transition the table does not allow."""


def check_transition(src: RequestState, dst: RequestState) -> RequestState:
    """Return ``dst`` when ``src → dst`` is allowed; raise :class:`IllegalTransition` otherwise."""
    if dst not in ALLOWED_TRANSITIONS[src]:
        raise IllegalTransition(f"illegal request state transition {src.name} -> {dst.name}")
    return dst


def terminal_state_for(reason: FinishReason) -> RequestState:
    if reason in (FinishReason.STOP, FinishReason.LENGTH):
        return RequestState.FINISHED
    if reason == FinishReason.ABORT:
        return RequestState.ABORTED
    return RequestState.FAILED
