"""Request state transitions: random legal/illegal moves against contract/state.py's table."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ominix_runtime.contract import (
    ALLOWED_TRANSITIONS,
    TERMINAL_STATES,
    GenerateRequest,
    IllegalTransition,
    RequestState,
)
from ominix_runtime.engine.request import EngineRequest

states = st.sampled_from(list(RequestState))


def _record(state: RequestState) -> EngineRequest:
    rec = EngineRequest(GenerateRequest("r", [1]), arrival_seq=1, effective_seed=0)
    rec.state = state
    return rec


@given(src=states, dst=states)
def test_transition_matches_table(src: RequestState, dst: RequestState) -> None:
    rec = _record(src)
    if dst in ALLOWED_TRANSITIONS[src]:
        rec.transition(dst)
        assert rec.state == dst
    else:
        with pytest.raises(IllegalTransition):
            rec.transition(dst)
        assert rec.state == src


@settings(max_examples=200)
@given(moves=st.lists(states, max_size=30))
def test_random_walks_never_leave_a_terminal_state(moves: list[RequestState]) -> None:
    rec = _record(RequestState.WAITING)
    for dst in moves:
        before = rec.state
        try:
            rec.transition(dst)
        except IllegalTransition:
            assert dst not in ALLOWED_TRANSITIONS[before]
            continue
        assert before not in TERMINAL_STATES
    if rec.state in TERMINAL_STATES:
        assert not ALLOWED_TRANSITIONS[rec.state]


def test_every_live_state_can_end() -> None:
    for state in RequestState:
        if state not in TERMINAL_STATES:
            assert ALLOWED_TRANSITIONS[state] & {RequestState.ABORTED, RequestState.FAILED}
