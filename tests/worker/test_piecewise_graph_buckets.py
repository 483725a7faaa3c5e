"""The token buckets the eager steps' piecewise graphs are captured at (``piecewise_graph.token_buckets``)."""

from __future__ import annotations

import pytest

from ominix_worker.cuda_graph import padded_size
from ominix_worker.piecewise_graph import TOKEN_STEP, token_buckets


def test_buckets_step_up_to_the_budget_rounded_up() -> None:
    assert token_buckets(128, 32) == (32, 64, 96, 128)
    assert token_buckets(100, 32) == (32, 64, 96, 128)  # the budget's own step has a bucket
    assert token_buckets(1, 64) == (64,)
    assert token_buckets(0) == () and token_buckets(-5) == ()
    buckets = token_buckets(2048)
    assert buckets[0] == TOKEN_STEP and buckets[-1] == 2048 and len(buckets) == 2048 // TOKEN_STEP


@pytest.mark.parametrize("num_tokens", [1, 31, 32, 33, 1032, 2047, 2048])
def test_a_step_pads_fewer_rows_than_a_step(num_tokens: int) -> None:
    bucket = padded_size(num_tokens, token_buckets(2048))
    assert bucket is not None and 0 <= bucket - num_tokens < TOKEN_STEP


def test_a_step_past_the_top_bucket_has_none() -> None:
    assert padded_size(2049, token_buckets(2048)) is None
