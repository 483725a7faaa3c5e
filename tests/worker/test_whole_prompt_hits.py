"""A prompt found whole in the prefix cache: the worker computes its last token alone, over the shared blocks,
writes no KV there, and samples what computing the whole prompt sampled. CPU runner (torch reference
attention); the CUDA paths (Triton store, decode graphs) are in tests/gpu/test_decode_graphs.py."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ominix_runtime.contract import (
    DecodeStep,
    NewRequestData,
    RequestOutput,
    RunningRequestData,
    RuntimeErrorKind,
    SamplingParams,
)
from ominix_worker.runner import ModelRunner, build_runner

PROMPT_BLOCKS = [3, 4]  # two blocks of 16: a 32-token prompt fills them


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Callable[[str], Path]) -> ModelRunner:
    return build_runner(str(tiny_model_dir("llama")), num_blocks=32, block_size=16)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, logprobs=5)


def _whole_hit(rid: str, prompt: list[int], outputs: tuple[int, ...] = ()) -> NewRequestData:
    """``prompt`` (and earlier ``outputs``) found whole in PROMPT_BLOCKS: the last token computed alone."""
    n = len(prompt) + len(outputs)
    return NewRequestData(
        rid,
        prompt,
        _greedy(),
        PROMPT_BLOCKS,
        n - 1,
        1,
        0,
        output_token_ids=list(outputs),
        num_cached_kv_tokens=n,
    )


def _computed_whole(runner: ModelRunner, tokens: list[int]) -> RequestOutput:
    """Step 1 of a reset runner: ``tokens`` computed into PROMPT_BLOCKS, the first token sampled."""
    runner.reset()
    step = DecodeStep(1, new_requests=[NewRequestData("a", tokens, _greedy(), PROMPT_BLOCKS, 0, 32, 0)])
    return runner.execute_step(step).outputs[0]


def _first_output(runner: ModelRunner, step_id: int, new: NewRequestData, finished: str) -> RequestOutput:
    step = DecodeStep(step_id, new_requests=[new], finished_request_ids=[finished])
    return runner.execute_step(step).outputs[0]


def _blocks(runner: ModelRunner, ids: list[int]) -> list[torch.Tensor]:
    return [cache[:, ids].clone() for cache in runner.kv_caches]


def _assert_same_sample(got: RequestOutput, want: RequestOutput) -> None:
    assert got.error_kind is None, got.error_message
    assert got.sampled_token_id == want.sampled_token_id
    assert got.logprobs is not None and want.logprobs is not None
    assert [t.token_id for t in got.logprobs.top] == [t.token_id for t in want.logprobs.top]
    for g, w in zip(got.logprobs.top, want.logprobs.top, strict=True):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)


def test_a_whole_hit_samples_what_the_whole_prompt_did_and_leaves_the_shared_blocks_alone(
    runner: ModelRunner,
) -> None:
    assert runner.supports_whole_prompt_hits
    gen = random.Random(11)
    prompt = [gen.randrange(3, runner.vocab_size) for _ in range(32)]
    other = [gen.randrange(3, runner.vocab_size) for _ in range(20)]
    first = _computed_whole(runner, prompt)
    cached = _blocks(runner, PROMPT_BLOCKS)
    # Beside a fresh prompt (a prefill step), then alone (a step of one-token rows, the decode path).
    mixed = runner.execute_step(
        DecodeStep(
            2,
            new_requests=[_whole_hit("b", prompt), NewRequestData("c", other, _greedy(), [5, 6], 0, 20, 0)],
            finished_request_ids=["a"],
        )
    )
    alone = runner.execute_step(
        DecodeStep(3, new_requests=[_whole_hit("d", prompt)], finished_request_ids=["c"])
    )
    _assert_same_sample(mixed.outputs[0], first)
    _assert_same_sample(alone.outputs[0], first)
    assert mixed.num_tokens == 21 and alone.num_tokens == 1
    for before, after in zip(cached, _blocks(runner, PROMPT_BLOCKS), strict=True):
        assert torch.equal(before, after)  # the shared blocks were read, never written
    # Both continue on blocks of their own, in step with each other.
    tokens: dict[str, list[int | None]] = {"b": [], "d": []}
    for step_id in range(4, 8):
        new_blocks = {"b": [7], "d": [8]} if step_id == 4 else {"b": [], "d": []}  # position 32 on
        step = DecodeStep(
            step_id, running_requests=[RunningRequestData(rid, new_blocks[rid], 1) for rid in ("b", "d")]
        )
        for out in runner.execute_step(step).outputs:
            assert out.error_kind is None, out.error_message
            tokens[out.request_id].append(out.sampled_token_id)
    assert tokens["b"] == tokens["d"]
    for before, after in zip(cached, _blocks(runner, PROMPT_BLOCKS), strict=True):
        assert torch.equal(before, after)


@pytest.mark.parametrize(
    ("computed", "cached", "scheduled"),
    [(30, 32, 2), (31, 31 + 16, 1), (15, 16, 1)],
    ids=["two-tokens-short", "beyond-the-prompt", "not-the-whole-prompt"],
)
def test_cached_kv_tokens_that_are_not_a_whole_prompt_hit_are_refused(
    runner: ModelRunner, computed: int, cached: int, scheduled: int
) -> None:
    runner.reset()
    prompt = list(range(3, 35))
    bad = NewRequestData(
        "bad", prompt, _greedy(), PROMPT_BLOCKS + [9], computed, scheduled, 0, num_cached_kv_tokens=cached
    )
    good = NewRequestData("good", [5, 6, 7], _greedy(), [10], 0, 3, 0)
    by_id = {o.request_id: o for o in runner.execute_step(DecodeStep(1, new_requests=[bad, good])).outputs}
    assert by_id["bad"].error_kind == RuntimeErrorKind.INTERNAL
    assert "whole-prompt hit" in by_id["bad"].error_message
    assert by_id["good"].error_kind is None and by_id["good"].sampled_token_id is not None
    assert set(runner.requests) == {"good"}


def test_the_shared_slot_is_read_not_written(runner: ModelRunner) -> None:
    """The cached last token's KV is what attention reads and what stays: a sentinel put in its slot of every
    layer is still there, bit for bit, after the whole-prompt hit's step, and changed what it sampled."""
    prompt = list(range(3, 35))
    _computed_whole(runner, prompt)
    block, offset = PROMPT_BLOCKS[-1], 15  # position 31
    honest = _first_output(runner, 2, _whole_hit("b", prompt), finished="a")
    for cache in runner.kv_caches:
        cache[:, block, offset] = 3.0
    tampered = _first_output(runner, 3, _whole_hit("c", prompt), finished="b")
    assert all(bool((cache[:, block, offset] == 3.0).all()) for cache in runner.kv_caches)
    assert tampered.logprobs is not None and honest.logprobs is not None
    assert tampered.logprobs.top[0].logprob != pytest.approx(honest.logprobs.top[0].logprob, abs=1e-6)


def test_a_resumed_request_found_whole_samples_as_the_whole_sequence(runner: ModelRunner) -> None:
    """Prompt and earlier outputs (a request resumed after preemption) that fill whole blocks."""
    prompt, outputs = list(range(3, 33)), (40, 41)  # 30 + 2 = 32 tokens
    full = _computed_whole(runner, prompt + list(outputs))
    _assert_same_sample(_first_output(runner, 2, _whole_hit("b", prompt, outputs), finished="a"), full)


def test_a_worker_whose_store_cannot_skip_a_slot_refuses_a_whole_hit(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner.reset()
    monkeypatch.setattr(runner.backend, "skips_unset_slots", False)
    assert not runner.supports_whole_prompt_hits
    out = runner.execute_step(DecodeStep(1, new_requests=[_whole_hit("b", list(range(3, 35)))])).outputs[0]
    assert out.error_kind == RuntimeErrorKind.INTERNAL and "whole-prompt hit" in out.error_message
    assert not runner.requests
