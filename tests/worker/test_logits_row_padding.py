"""An eager step's LM head padded up to the captured row counts (``ModelRunner.logits_row_sizes``): the LM head
sees the padded count, the sampled tokens are those of the unpadded step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData, SamplingParams
from ominix_worker.runner import ModelRunner, build_runner


def _steps(sampling: SamplingParams) -> list[DecodeStep]:
    """Three 17-token prompts in one step (three sampled rows), then two decode steps of all three."""
    new = [
        NewRequestData(name, list(range(3 + i, 20 + i)), sampling, [2 * i, 2 * i + 1], 0, 17, 7 + i)
        for i, name in enumerate("abc")
    ]
    steps = [DecodeStep(1, new_requests=new)]
    running = [RunningRequestData(name, [], 1) for name in "abc"]
    steps += [DecodeStep(i, running_requests=running) for i in (2, 3)]
    return steps


def _run(
    runner: ModelRunner, steps: list[DecodeStep], overlap: bool = False
) -> tuple[list[list[int | None]], list[int]]:
    """The sampled ids of every step, and the row count each LM head call saw; with ``overlap``, every step is
    launched before the previous one's ids are read (the pipelined eager path) and the results come out of
    ``take_results``."""
    seen: list[int] = []
    compute_logits = runner.model.compute_logits

    def counting(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.shape[0])
        return compute_logits(hidden)

    runner.model.compute_logits = counting  # type: ignore[method-assign]  # counts the rows in place
    runner.overlap_steps = overlap
    try:
        results = []
        for step in steps:
            result = runner.execute_step(step)
            assert (result is None) == overlap
            results += [result] if result is not None else runner.take_results()
        runner.finish_pending()
        results += runner.take_results()
    finally:
        runner.model.compute_logits = compute_logits  # type: ignore[method-assign]
        runner.overlap_steps = False
        runner.reset()
    assert [r.step_id for r in results] == [s.step_id for s in steps]
    return [[o.sampled_token_id for o in r.outputs] for r in results], seen


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_padded_lm_head_samples_what_the_unpadded_one_does(
    tiny_model_dir: Callable[[str], Path], temperature: float
) -> None:
    runner = build_runner(str(tiny_model_dir("llama")), num_blocks=16, block_size=16)
    steps = _steps(SamplingParams(temperature=temperature))
    plain, plain_rows = _run(runner, steps)
    assert plain_rows == [3, 3, 3]
    runner.logits_row_sizes = (1, 2, 4, 8)
    padded, padded_rows = _run(runner, steps)
    assert padded_rows == [4, 4, 4]  # three sampled rows run as the captured size four
    assert padded == plain and all(len(ids) == 3 for ids in padded)
    runner.logits_row_sizes = (1, 2)  # no captured size holds three rows: no padding
    _, beyond_rows = _run(runner, steps)
    assert beyond_rows == [3, 3, 3]
    runner.logits_row_sizes, runner.pad_logits = (1, 2, 4, 8), False  # OMINIX_PAD_LOGITS=0
    _, off_rows = _run(runner, steps)
    assert off_rows == [3, 3, 3]


def test_padded_lm_head_in_overlapped_eager_steps(tiny_model_dir: Callable[[str], Path]) -> None:
    """Pipelined eager steps (each launched before the previous one's ids are read) pad and sample alike."""
    runner = build_runner(str(tiny_model_dir("llama")), num_blocks=16, block_size=16)
    steps = _steps(SamplingParams(temperature=0.0))
    plain, _ = _run(runner, steps)
    runner.logits_row_sizes = (1, 2, 4, 8)
    overlapped, rows = _run(runner, steps, overlap=True)
    assert rows == [4, 4, 4] and overlapped == plain
