"""The whole runner on CUDA in bfloat16 against transformers in float32 (tiny random model).

Uses the Triton paged attention backend when it imports, the torch reference otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

REL_TOL = 2e-2  # bfloat16 keeps 8 bits of mantissa


def test_runner_matches_transformers_in_bf16(tiny_model_dir: Callable[[str], Path]) -> None:
    import transformers

    from ominix_worker.runner import build_runner

    folder = tiny_model_dir("qwen3")
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = build_runner(
        str(folder), device="cuda:0", dtype=torch.bfloat16, num_blocks=64, attention="triton"
    )
    recorded: list[torch.Tensor] = []
    compute_logits = runner.model.compute_logits

    def record(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        recorded.append(logits.float().cpu())
        return logits

    runner.model.compute_logits = record  # type: ignore[method-assign]  # records the logits
    greedy = SamplingParams(temperature=0.0)
    long = list(range(3, 70))
    short = list(range(100, 109))
    sequences = {"long": list(long), "short": list(short)}
    steps = [
        DecodeStep(
            1,
            new_requests=[
                NewRequestData("long", long, greedy, [5, 9, 1, 30, 2], 0, 40, 0),
                NewRequestData("short", short, greedy, [7], 0, 9, 0),
            ],
        )
    ]
    steps.append(
        DecodeStep(
            2, running_requests=[RunningRequestData("long", [], 27), RunningRequestData("short", [], 1)]
        )
    )
    steps += [
        DecodeStep(
            i, running_requests=[RunningRequestData("long", [], 1), RunningRequestData("short", [], 1)]
        )
        for i in range(3, 8)
    ]
    for step in steps:
        recorded.clear()
        result = runner.execute_step(step)
        sampled = [o for o in result.outputs if o.sampled_token_id is not None]
        assert recorded and len(sampled) == recorded[0].shape[0]
        for row, output in enumerate(sampled):
            with torch.no_grad():
                want = reference(torch.tensor([sequences[output.request_id]])).logits[0, -1].float()
            got = recorded[0][row]
            rel = ((got - want).abs().max() / want.abs().max()).item()
            assert rel < REL_TOL, f"step {step.step_id} {output.request_id}: relative error {rel:.3e}"
            sequences[output.request_id].append(output.sampled_token_id)
    assert runner.backend.name in ("triton-paged", "torch-sdpa")


def test_early_results_on_cuda_match_the_synchronous_ones(tiny_model_dir: Callable[[str], Path]) -> None:
    """Overlapped eager steps on CUDA with ``post_result`` set: a step's result leaves between the layers of
    the next step's launch once its ids are on the host (a real event here; the test waits for the device
    before each launch, so that is at the first layer). Every result leaves once, in step order, with the
    tokens of the run that posts nothing early (greedy)."""
    from ominix_runtime.contract import StepResult
    from ominix_worker.runner import build_runner

    runner = build_runner(
        str(tiny_model_dir("llama")), device="cuda:0", dtype=torch.bfloat16, num_blocks=64, attention="triton"
    )
    greedy = SamplingParams(temperature=0.0)

    def prompt(stride: int) -> list[int]:  # 290 tokens inside the tiny vocabulary (320)
        return [(stride * i) % 300 + 10 for i in range(290)]

    steps = [
        DecodeStep(1, new_requests=[NewRequestData("a", prompt(7), greedy, list(range(19)), 0, 290, 0)]),
        DecodeStep(
            2,
            new_requests=[NewRequestData("b", prompt(11), greedy, list(range(19, 38)), 0, 290, 0)],
            running_requests=[RunningRequestData("a", [], 1)],
        ),
        *[
            DecodeStep(s, running_requests=[RunningRequestData("a", [], 1), RunningRequestData("b", [], 1)])
            for s in range(3, 9)
        ],
    ]

    def run(early: bool) -> tuple[list[StepResult], list[int]]:
        runner.reset()
        posted: list[StepResult] = []
        runner.overlap_steps = runner.pipeline_eager = runner.early_results = True
        runner.post_result = posted.append if early else None
        results: list[StepResult] = []
        left_early: list[int] = []
        for step in steps:
            before = len(posted)
            if early:
                torch.cuda.synchronize()  # the pending step is done before this launch starts
            out = runner.execute_step(step)
            left_early += [r.step_id for r in posted[before:]]
            results += posted[before:] + ([out] if out is not None else []) + runner.take_results()
        runner.finish_pending()
        return results + runner.take_results(), left_early

    def tokens(results: list[StepResult]) -> list[tuple[int, list[tuple[str, int | None]]]]:
        return [(r.step_id, [(o.request_id, o.sampled_token_id) for o in r.outputs]) for r in results]

    late, none_early = run(early=False)
    early, left_early = run(early=True)
    runner.reset()
    assert none_early == []
    assert [r.step_id for r in early] == list(range(1, 9))
    assert tokens(early) == tokens(late)
    assert left_early == list(range(1, 8))  # each during the launch of the step after it; 8 at the end
