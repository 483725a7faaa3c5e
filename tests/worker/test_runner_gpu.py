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
