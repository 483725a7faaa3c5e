"""Our runner's logits against Hugging Face transformers on tiny random models (CPU, float32), dense and
mixture-of-experts (Qwen3-MoE, Mixtral, Qwen2-MoE).

Every scenario drives the runner with DecodeSteps exactly as the engine would (non-contiguous block ids,
mixed prefill and decode rows) and compares each sampled row's logits with a full-sequence HF forward.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData, SamplingParams, StepResult
from ominix_worker.runner import ModelRunner, build_runner

REL_TOL = 1e-4
GREEDY = SamplingParams(temperature=0.0)


class LogitsRecorder:
    """Wraps compute_logits to keep the rows of the last step, keyed by request id."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.rows: torch.Tensor | None = None
        original = runner.model.compute_logits

        def record(hidden: torch.Tensor) -> torch.Tensor:
            self.rows = original(hidden)
            return self.rows

        runner.model.compute_logits = record  # type: ignore[method-assign]  # records the logits

    def step(self, step: DecodeStep) -> tuple[StepResult, dict[str, torch.Tensor]]:
        self.rows = None
        result = self.runner.execute_step(step)
        sampled = [o.request_id for o in result.outputs if o.sampled_token_id is not None]
        # The runner computes logits only for rows that sample, in the order of the outputs that carry them.
        assert self.rows is not None or not sampled
        logits = {} if self.rows is None else {rid: self.rows[i] for i, rid in enumerate(sampled)}
        assert self.rows is None or self.rows.shape[0] == len(sampled), (self.rows.shape, sampled)
        assert len(logits) == len(sampled)
        return result, logits


class Reference:
    """HF transformers' float32 model of ``folder``; ``overrides`` go to ``from_pretrained`` (e.g. the
    attention implementation, or config fields)."""

    def __init__(self, folder: Path, **overrides: object) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, **overrides
        ).eval()

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([token_ids])).logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < REL_TOL, f"relative error {rel:.2e}"


def prompt(seed: int, length: int, vocab: int = 320) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def tokens_by_id(result: StepResult) -> dict[str, int]:
    return {o.request_id: o.sampled_token_id for o in result.outputs if o.sampled_token_id is not None}


@pytest.fixture(
    scope="module", params=["llama", "qwen2", "qwen3", "llama31", "qwen3_moe", "mixtral", "qwen2_moe"]
)
def pair(
    request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]
) -> tuple[LogitsRecorder, Reference]:
    folder = tiny_model_dir(request.param)
    runner = build_runner(str(folder), num_blocks=48, block_size=16)
    return LogitsRecorder(runner), Reference(folder)


def test_prefill_then_decode(pair: tuple[LogitsRecorder, Reference]) -> None:
    rec, ref = pair
    rec.runner.reset()
    tokens = prompt(1, 37)  # three blocks, the last one partial
    result, logits = rec.step(
        DecodeStep(
            1,
            new_requests=[NewRequestData("a", tokens, GREEDY, [9, 2, 30], 0, len(tokens), effective_seed=1)],
        )
    )
    ours = [logits["a"]]
    tokens.append(tokens_by_id(result)["a"])
    for step_id in range(2, 16):  # crosses into a fourth block at position 48
        new_blocks = [17] if len(tokens) == 48 else []
        result, logits = rec.step(
            DecodeStep(step_id, running_requests=[RunningRequestData("a", new_blocks, 1)])
        )
        ours.append(logits["a"])
        tokens.append(tokens_by_id(result)["a"])
    assert rec.runner.requests["a"].output_token_ids == tokens[37:]
    # Causal: one forward over the final sequence gives the reference for every step.
    reference = ref.logits(tokens[:-1])
    for i, row in enumerate(ours):
        assert_close(row, reference[36 + i])


def test_chunked_prefill_mixed_with_decode(pair: tuple[LogitsRecorder, Reference]) -> None:
    rec, ref = pair
    rec.runner.reset()
    short = prompt(2, 5)
    long = prompt(3, 40)
    result, logits = rec.step(
        DecodeStep(
            1,
            new_requests=[
                NewRequestData("short", short, GREEDY, [4], 0, 5, effective_seed=2),
                NewRequestData("long", long, GREEDY, [11, 5], 0, 13, effective_seed=3),
            ],
        )
    )
    assert set(logits) == {"short"}, "a chunked prefill must not sample"
    assert_close(logits["short"], ref.logits(short)[-1])
    short.append(tokens_by_id(result)["short"])
    # Chunks that do not end on block boundaries: 13, then 19 beside a decode row, then the last 8 (samples).
    result, logits = rec.step(
        DecodeStep(
            2, running_requests=[RunningRequestData("short", [], 1), RunningRequestData("long", [], 19)]
        )
    )
    assert set(logits) == {"short"}
    short.append(tokens_by_id(result)["short"])
    result, logits = rec.step(
        DecodeStep(
            3, running_requests=[RunningRequestData("long", [6], 8), RunningRequestData("short", [], 1)]
        )
    )
    assert [o.request_id for o in result.outputs] == ["long", "short"]
    assert_close(logits["long"], ref.logits(long)[-1])
    assert_close(logits["short"], ref.logits(short)[-1])
    long.append(tokens_by_id(result)["long"])
    result, logits = rec.step(
        DecodeStep(4, running_requests=[RunningRequestData("long", [], 1)], finished_request_ids=["short"])
    )
    assert_close(logits["long"], ref.logits(long)[-1])
    assert "short" not in rec.runner.requests


def test_prefix_hit_reuses_blocks(pair: tuple[LogitsRecorder, Reference]) -> None:
    rec, ref = pair
    rec.runner.reset()
    shared = prompt(4, 32)  # two full blocks
    first = shared + prompt(5, 7)
    rec.step(
        DecodeStep(1, new_requests=[NewRequestData("first", first, GREEDY, [20, 21, 22], 0, len(first), 4)])
    )
    # The second request finds the two shared blocks in the prefix cache and computes only its tail.
    second = shared + prompt(6, 10)
    result, logits = rec.step(
        DecodeStep(
            2,
            finished_request_ids=["first"],
            new_requests=[NewRequestData("second", second, GREEDY, [20, 21, 40], 32, len(second) - 32, 5)],
        )
    )
    assert result.num_tokens == len(second) - 32
    assert_close(logits["second"], ref.logits(second)[-1])
    second.append(tokens_by_id(result)["second"])
    _, logits = rec.step(DecodeStep(3, running_requests=[RunningRequestData("second", [], 1)]))
    assert_close(logits["second"], ref.logits(second)[-1])


def test_resumed_request_continues_from_its_output(pair: tuple[LogitsRecorder, Reference]) -> None:
    """After preemption the engine resends prompt + earlier output; the worker recomputes both."""
    rec, ref = pair
    rec.runner.reset()
    tokens = prompt(7, 12)
    earlier_output = prompt(8, 3)
    result, logits = rec.step(
        DecodeStep(
            1,
            new_requests=[
                NewRequestData(
                    "r", tokens, GREEDY, [1], 0, 15, effective_seed=6, output_token_ids=earlier_output
                )
            ],
        )
    )
    assert_close(logits["r"], ref.logits(tokens + earlier_output)[-1])
    assert rec.runner.requests["r"].output_token_ids == [*earlier_output, tokens_by_id(result)["r"]]


def test_batched_decode_of_different_lengths(pair: tuple[LogitsRecorder, Reference]) -> None:
    rec, ref = pair
    rec.runner.reset()
    seqs = {"x": prompt(9, 3), "y": prompt(10, 17), "z": prompt(11, 33)}
    blocks = {"x": [44], "y": [12, 13], "z": [25, 26, 27]}
    result, _ = rec.step(
        DecodeStep(
            1,
            new_requests=[
                NewRequestData(rid, list(toks), GREEDY, blocks[rid], 0, len(toks), 0)
                for rid, toks in seqs.items()
            ],
        )
    )
    for rid, token in tokens_by_id(result).items():
        seqs[rid].append(token)
    for step_id in range(2, 5):
        result, logits = rec.step(
            DecodeStep(step_id, running_requests=[RunningRequestData(rid, [], 1) for rid in seqs])
        )
        for rid, row in logits.items():
            assert_close(row, ref.logits(seqs[rid])[-1])
        for rid, token in tokens_by_id(result).items():
            seqs[rid].append(token)
