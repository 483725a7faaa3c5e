"""The token buckets the eager steps' piecewise graphs are captured at (``piecewise_graph.token_buckets``), and
the bucket a step replays once the buckets are timed (``piecewise_graph.fastest_routes``)."""

from __future__ import annotations

import random

import pytest

from ominix_worker.cuda_graph import padded_size
from ominix_worker.piecewise_graph import FASTER_BY, TOKEN_STEP, fastest_routes, token_buckets


def test_buckets_step_up_to_the_budget_which_is_the_last() -> None:
    assert token_buckets(128, 32) == (32, 64, 96, 128)
    assert token_buckets(100, 32) == (32, 64, 96, 100)  # no step holds more than the budget
    assert token_buckets(1, 64) == (1,) and token_buckets(2048, 5000) == (2048,)
    assert token_buckets(0) == () and token_buckets(-5) == ()
    buckets = token_buckets(2048)
    assert buckets[0] == TOKEN_STEP and buckets[-1] == 2048 and len(buckets) == 2048 // TOKEN_STEP
    assert token_buckets(2048, 8) == tuple(range(8, 2049, 8))
    assert token_buckets(2048, 100)[-2:] == (2000, 2048)
    with pytest.raises(ValueError, match="at least 1"):
        token_buckets(2048, 0)


def test_the_configured_spacing_is_the_workers() -> None:
    from ominix_runtime.config import DebugConfig

    assert DebugConfig().piecewise_token_step == TOKEN_STEP


@pytest.mark.parametrize("num_tokens", [1, 31, 32, 33, 1032, 2047, 2048])
def test_a_step_pads_fewer_rows_than_a_step(num_tokens: int) -> None:
    bucket = padded_size(num_tokens, token_buckets(2048))
    assert bucket is not None and 0 <= bucket - num_tokens < TOKEN_STEP


def test_a_step_past_the_top_bucket_has_none() -> None:
    assert padded_size(2049, token_buckets(2048)) is None


def test_a_bucket_routes_to_a_larger_one_only_when_it_ran_faster_by_the_margin() -> None:
    assert fastest_routes({32: 1.0, 64: 2.0, 96: 3.0}) == {32: 32, 64: 64, 96: 96}
    # 64 is slower than 96 and 128; 128 is the fastest of them.
    assert fastest_routes({32: 1.0, 64: 5.0, 96: 4.0, 128: 3.0}) == {32: 32, 64: 128, 96: 128, 128: 128}
    just_inside = 10.0 * (1 - FASTER_BY) + 1e-6
    assert fastest_routes({32: 10.0, 64: just_inside}) == {32: 32, 64: 64}
    assert fastest_routes({32: 10.0, 64: 9.0}) == {32: 64, 64: 64}
    assert fastest_routes({32: 4.0, 64: 4.0, 96: 4.0}) == {32: 32, 64: 64, 96: 96}  # a tie keeps the smaller
    assert fastest_routes({32: 9.0, 64: 4.0, 96: 4.0}) == {
        32: 64,
        64: 64,
        96: 96,
    }  # ... and goes to the smaller
    assert fastest_routes({}) == {}


def test_a_route_goes_up_to_the_fastest_bucket_above_which_routes_to_itself() -> None:
    rng = random.Random(11)
    for _ in range(200):
        buckets = token_buckets(rng.choice([64, 256, 1024]))
        times = {b: rng.uniform(1.0, 2.0) * b for b in buckets}
        if rng.random() < 0.5:  # some slow counts among the larger ones
            times = {b: t * rng.choice([1.0, 0.7]) for b, t in times.items()}
        routes = fastest_routes(times)
        assert set(routes) == set(buckets)
        for bucket, target in routes.items():
            assert target >= bucket and routes[target] == target
            fastest = min(times[b] for b in buckets if b >= bucket)
            if target != bucket:
                assert times[target] == fastest < times[bucket] * (1 - FASTER_BY)
            else:
                assert fastest >= times[bucket] * (1 - FASTER_BY)
