"""Sampler: seeded determinism, truncation masks, penalties, min_tokens and logprobs."""

from __future__ import annotations

import pytest
import torch

from ominix_runtime.contract import SamplingParams
from ominix_runtime.contract.sampling import GREEDY_TEMPERATURE
from ominix_worker.sampler import SamplingTensors, apply_penalties, apply_truncation, sample, uniform_noise

VOCAB = 64


def tensors(batch: int, **overrides: object) -> SamplingTensors:
    t = SamplingTensors(
        temperature=torch.ones(batch),
        top_k=torch.full((batch,), VOCAB, dtype=torch.int64),
        top_p=torch.ones(batch),
        min_p=torch.zeros(batch),
        seeds=torch.arange(batch, dtype=torch.int64) + 1000,
        output_positions=torch.zeros(batch, dtype=torch.int64),
    )
    for name, value in overrides.items():
        setattr(t, name, value)
    return t


def random_logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def test_noise_is_uniform_and_depends_only_on_seed_position_token() -> None:
    seeds = torch.tensor([7, 7, 8, -5], dtype=torch.int64)
    positions = torch.tensor([0, 1, 0, 0], dtype=torch.int64)
    noise = uniform_noise(seeds, positions, 4096)
    assert noise.min() > 0 and noise.max() < 1
    assert abs(noise.mean().item() - 0.5) < 0.02
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    alone = uniform_noise(seeds[2:3], positions[2:3], 4096)
    assert torch.equal(alone[0], noise[2])


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    logits = random_logits(5)
    seeds = torch.tensor([11, 12, 13, 14, 15], dtype=torch.int64)
    positions = torch.tensor([0, 3, 9, 2, 4], dtype=torch.int64)
    batch = sample(logits, tensors(5, seeds=seeds, output_positions=positions)).token_ids
    # Row 2 alone, and row 2 placed among different neighbours, draws the same token.
    alone = sample(logits[2:3], tensors(1, seeds=seeds[2:3], output_positions=positions[2:3])).token_ids
    shuffled = [2, 0, 4]
    mixed = sample(logits[shuffled], tensors(3, seeds=seeds[shuffled], output_positions=positions[shuffled]))
    assert alone[0] == batch[2] == mixed.token_ids[0]
    assert mixed.token_ids[1] == batch[0] and mixed.token_ids[2] == batch[4]


def test_seeded_draws_follow_the_softmax_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (VOCAB - 4)])
    draws = 4000
    positions = torch.arange(draws, dtype=torch.int64)
    t = tensors(draws, seeds=torch.full((draws,), 42, dtype=torch.int64), output_positions=positions)
    tokens = sample(logits.expand(draws, -1).contiguous(), t).token_ids
    freq = torch.bincount(tokens, minlength=VOCAB)[:4].float() / draws
    expected = logits[0, :4].softmax(-1)
    assert (freq - expected).abs().max() < 0.03, (freq, expected)


def test_greedy_rows_take_the_argmax_in_a_mixed_batch() -> None:
    logits = random_logits(3, seed=1)
    t = tensors(3, temperature=torch.tensor([0.0, 1.0, 0.0]))
    out = sample(logits, t).token_ids
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_top_k_top_p_min_p_masks() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05] + [1e-9] * (VOCAB - 5)]))
    kept = lambda t: torch.isfinite(apply_truncation(logits.clone(), t))[0, :6].tolist()  # noqa: E731
    assert kept(tensors(1, top_k=torch.tensor([2]), needs_top_k=True)) == [
        True,
        True,
        False,
        False,
        False,
        False,
    ]
    # top_p 0.8: 0.5 + 0.2 = 0.7 < 0.8, so the third token (reaching 0.85) is the last one kept.
    assert kept(tensors(1, top_p=torch.tensor([0.8]), needs_top_p=True)) == [
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    # min_p 0.25: keep p >= 0.125.
    assert kept(tensors(1, min_p=torch.tensor([0.25]), needs_min_p=True)) == [
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    # Even an extreme top_p keeps the best token.
    assert kept(tensors(1, top_p=torch.tensor([1e-6]), needs_top_p=True))[0]
    # Sampled tokens always come from the kept set.
    many = 256
    t = tensors(
        many, top_k=torch.full((many,), 2), needs_top_k=True, seeds=torch.arange(many, dtype=torch.int64)
    )
    tokens = sample(logits.expand(many, -1).contiguous(), t).token_ids
    assert set(tokens.tolist()) == {0, 1}


def test_penalties() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0] + [0.0] * (VOCAB - 4)])
    counts = torch.zeros(1, VOCAB)
    counts[0, 2] = 3.0
    prompt_mask = torch.zeros(1, VOCAB, dtype=torch.bool)
    prompt_mask[0, :2] = True
    t = tensors(
        1,
        output_counts=counts,
        prompt_mask=prompt_mask,
        repetition_penalty=torch.tensor([2.0]),
        frequency_penalty=torch.tensor([0.5]),
        presence_penalty=torch.tensor([0.25]),
    )
    out = apply_penalties(logits, t)[0, :4].tolist()
    # token 0 (prompt, positive) halves; token 1 (prompt, negative) doubles; token 2 (output ×3):
    # 1.0 / 2 - 0.5 * 3 - 0.25; token 3 untouched.
    assert out == [1.0, -4.0, 0.5 - 1.5 - 0.25, 1.0]


def test_min_tokens_mask_bans_eos() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 10.0  # eos would win
    banned = torch.zeros(1, VOCAB, dtype=torch.bool)
    banned[0, 2] = True
    out = sample(logits, tensors(1, temperature=torch.zeros(1), all_greedy=True, banned_mask=banned))
    assert out.token_ids[0] != 2


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = random_logits(2, seed=3)
    t = tensors(2, temperature=torch.tensor([0.5, 0.0]), num_logprobs=3)
    out = sample(logits, t)
    expected = logits.log_softmax(-1)
    assert out.sampled_logprobs is not None and out.top_logprobs is not None and out.top_token_ids is not None
    assert torch.allclose(out.sampled_logprobs, expected.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    top_values, top_ids = expected.topk(3, dim=-1)
    assert torch.equal(out.top_token_ids, top_ids) and torch.allclose(out.top_logprobs, top_values)


def test_nan_rows_are_flagged() -> None:
    logits = random_logits(2)
    logits[1, 5] = float("nan")
    assert sample(logits, tensors(2)).bad_rows.tolist() == [False, True]


@pytest.mark.parametrize("temperature", [1e-38, 1e-39, 1e-44, 9e-6])
@pytest.mark.parametrize(
    "row", [[5.0, 6.0, 30.0, 4.0, -1.0, 0.0, 7.0, 2.0], [-5.0, -6.0, -0.5, -4.0, -9.0, -7.0, -8.0, -3.0]]
)
def test_a_temperature_below_the_greedy_threshold_takes_the_argmax(
    temperature: float, row: list[float]
) -> None:
    """A valid temperature (any in [0, 100]) below ``GREEDY_TEMPERATURE`` takes the argmax, also beside a sampled
    row: dividing these logits by it would overflow them to equal infinities, among which the draw cannot find
    the maximum."""
    assert SamplingParams(temperature=temperature).validate(vocab_size=8).is_greedy
    logits = torch.tensor([row, row])
    t = tensors(
        2,
        temperature=torch.tensor([temperature, 1.0]),
        top_k=torch.full((2,), 8, dtype=torch.int64),
        seeds=torch.tensor([1, 2], dtype=torch.int64),
    )
    assert int(sample(logits, t).token_ids[0]) == 2


def test_the_greedy_threshold_is_where_sampling_starts() -> None:
    """At ``GREEDY_TEMPERATURE`` a row samples (the seeded noise outweighs a tiny lead of token 0); at half of
    it, the row takes the first maximum whatever its seed."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 0] = 1e-6

    def first_row_tokens(temperature: float) -> list[int]:
        return [
            int(
                sample(
                    logits,
                    tensors(2, temperature=torch.tensor([temperature, 1.0]), seeds=torch.tensor([s, 0])),
                ).token_ids[0]
            )
            for s in range(8)
        ]

    assert first_row_tokens(GREEDY_TEMPERATURE) != [0] * 8
    assert first_row_tokens(GREEDY_TEMPERATURE / 2) == [0] * 8


def test_no_draw_reaches_one_whose_gumbel_noise_would_be_infinite() -> None:
    """A uniform draw of exactly 1 has Gumbel noise +inf: that token would win whatever its logit, its top-k /
    top-p / min-p mask (-inf + inf is NaN, which argmax takes too) or a min_tokens ban. With 24 random bits the
    top value rounded to 1 in float32, about once in 2^24 draws: ~0.8% of the tokens a 128K-vocabulary model
    sampled (these 1,024 rows held ten such draws)."""
    for start in range(0, 1024, 128):
        seeds = torch.arange(start, start + 128, dtype=torch.int64)
        noise = uniform_noise(seeds, torch.zeros(128, dtype=torch.int64), 128_256)
        assert float(noise.max()) < 1.0 and float(noise.min()) > 0.0


def test_min_p_filters_before_top_p_measures_the_nucleus() -> None:
    """vLLM's order: min-p first, then top-k / top-p over what it kept (renormalised). Probabilities .5, .3,
    .1, .1 with min_p .5 keep token 0 alone (.3 < .5 × .5); top_p .6 then has nothing more to add. Measured on
    the unfiltered row, the nucleus would have kept token 1 too."""
    logits = torch.tensor([[0.5, 0.3, 0.1, 0.1]]).log()
    t = tensors(
        1,
        top_k=torch.tensor([4]),
        top_p=torch.tensor([0.6]),
        min_p=torch.tensor([0.5]),
        needs_top_p=True,
        needs_min_p=True,
    )
    kept = torch.isfinite(apply_truncation(logits, t))[0].tolist()
    assert kept == [True, False, False, False]


def test_a_top_p_of_one_keeps_the_whole_tail_beside_a_row_that_truncates() -> None:
    """Top-p runs for the whole batch once a row asks for it; a row of top_p 1 keeps every token even where
    its float32 cumulative mass reaches 1 before the tail ends (a peaked row over a long vocabulary)."""
    logits = torch.full((2, 50_000), -30.0)
    logits[:, 0] = 30.0
    t = tensors(
        2,
        top_k=torch.full((2,), 50_000, dtype=torch.int64),
        top_p=torch.tensor([1.0, 0.5]),
        needs_top_p=True,
    )
    kept = torch.isfinite(apply_truncation(logits, t))
    assert bool(kept[0].all())
    assert int(kept[1].sum()) == 1


@pytest.mark.parametrize(
    ("temperature", "sampled_at"),
    [(0.0, 0.0), (GREEDY_TEMPERATURE / 2, 0.0), (1e-3, 0.01), (0.01, 0.01), (0.7, 0.7)],
)
def test_a_sampled_temperature_below_a_hundredth_samples_at_a_hundredth(
    temperature: float, sampled_at: float
) -> None:
    """As vLLM does: between the greedy threshold and 0.01 a row samples at 0.01, not at a sharper temperature
    that is greedy in all but name."""
    assert SamplingParams(temperature=temperature).validate(vocab_size=8).sampling_temperature == sampled_at
