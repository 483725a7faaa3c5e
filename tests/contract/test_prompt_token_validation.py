"""The prompt's token ids against the vocabulary: every id in [0, vocab), the first one outside named."""

from __future__ import annotations

import pytest

from ominix_runtime.contract import GenerateRequest, InvalidArgument, RequestLimits, validate_request

LIMITS = RequestLimits(vocab_size=1000, max_model_len=4096)


def _request(ids: list[int]) -> GenerateRequest:
    return GenerateRequest(request_id="r", prompt_token_ids=ids)


@pytest.mark.parametrize(
    ("ids", "bad"),
    [
        ([5, 1000, 7], 1000),  # one past the vocabulary
        ([5, 6, -1], -1),
        ([3, 2000, -4, 1001], 2000),  # the first offender, not the smallest or the largest
    ],
)
def test_an_id_outside_the_vocabulary_is_named(ids: list[int], bad: int) -> None:
    with pytest.raises(
        InvalidArgument, match=rf"prompt token id {bad} is outside the vocabulary \[0, 1000\)"
    ):
        validate_request(_request(ids), LIMITS)


def test_ids_at_both_ends_of_the_vocabulary_pass() -> None:
    validate_request(_request([0, 999] * 1500), LIMITS)


def test_an_unknown_vocabulary_checks_no_id() -> None:
    validate_request(_request([10**9, -3]), RequestLimits(max_model_len=4096))


def test_more_chat_turns_than_the_context_holds_are_refused_by_their_count() -> None:
    """Every turn renders at least one token: 4,097 turns can never fit 4,096 tokens."""
    from ominix_runtime.contract import ChatMessage

    turns = tuple(ChatMessage("user", "") for _ in range(4097))
    with pytest.raises(InvalidArgument, match="4097 chat messages"):
        validate_request(GenerateRequest("r", [], chat_messages=turns), LIMITS)
    validate_request(GenerateRequest("r", [], chat_messages=turns[:4096]), LIMITS)
