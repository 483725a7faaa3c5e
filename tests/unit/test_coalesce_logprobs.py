"""How queued Token events are merged for a reader that fell behind (engine/core.py ``_coalesce``): logprobs are
per token, so a merged event must still pair each logprob with its own token id."""

from __future__ import annotations

from ominix_runtime.contract import Done, FinishReason, SampledLogprobs, Token, TokenLogprob, WorkerEvent
from ominix_runtime.engine.core import _coalesce


def _lp(token_id: int) -> SampledLogprobs:
    return SampledLogprobs(TokenLogprob(token_id, -float(token_id) / 100), [])


def _aligned(events: list[WorkerEvent]) -> bool:
    return all(
        not e.logprobs or [lp.sampled.token_id for lp in e.logprobs] == e.token_ids
        for e in events
        if isinstance(e, Token)
    )


def test_tokens_without_logprobs_merge_into_one() -> None:
    """The common path: consecutive tokens become one event, text in order; other events stay apart."""
    events: list[WorkerEvent] = [
        Token("r", [1], text="a"),
        Token("r", [2, 3], text="bc"),
        Done("r", FinishReason.STOP),
    ]
    out = _coalesce(events)
    assert len(out) == 2 and isinstance(out[0], Token) and isinstance(out[1], Done)
    assert (out[0].token_ids, out[0].text, out[0].logprobs) == ([1, 2, 3], "abc", [])


def test_tokens_with_one_logprob_each_merge_in_order() -> None:
    """Each event with one logprob per token id: merged, logprobs in token order."""
    out = _coalesce(
        [Token("r", [1], [_lp(1)]), Token("r", [2, 3], [_lp(2), _lp(3)]), Token("r", [4], [_lp(4)])]
    )
    assert len(out) == 1 and isinstance(out[0], Token)
    assert out[0].token_ids == [1, 2, 3, 4] and _aligned(out)


def test_a_token_without_its_logprobs_is_not_merged_with_its_neighbours() -> None:
    """A backend that could not read one chunk's logprobs sends it without them: merging it would shift the
    later logprobs onto earlier tokens, so it stays a separate event and every event keeps its alignment."""
    events: list[WorkerEvent] = [
        Token("r", [10], [_lp(10)]),
        Token("r", [11], []),
        Token("r", [12], [_lp(12)]),
        Token("r", [13], [_lp(13)]),
    ]
    out = _coalesce(events)
    assert _aligned(out)
    assert [t for e in out if isinstance(e, Token) for t in e.token_ids] == [10, 11, 12, 13]
    assert [e.token_ids for e in out if isinstance(e, Token)] == [[10], [11], [12, 13]]


def test_a_merged_event_keeps_the_stop_token_mark_of_its_last_token() -> None:
    """The request's last token ended it as a stop token: the merged event still says so (the front leaves
    that token's text out), and a merge of ordinary tokens does not."""
    out = _coalesce(
        [Token("r", [1]), Token("r", [2], ended_by_stop_token=True), Done("r", FinishReason.STOP)]
    )
    assert isinstance(out[0], Token) and (out[0].token_ids, out[0].ended_by_stop_token) == ([1, 2], True)
    out = _coalesce([Token("r", [1]), Token("r", [2])])
    assert isinstance(out[0], Token) and not out[0].ended_by_stop_token
