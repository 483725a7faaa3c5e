"""Models with per-head Q/K norms through the CUDA ops path: Qwen3 takes the fused norm + RoPE kernel, Gemma 3
(whose norms scale by 1 + weight in float32) keeps its own norms; both give the logits of the CPU path.

On CUDA the runner is built on the GPU (float32, TF32 off); with ``TRITON_INTERPRET=1`` the Triton ops run on
the CPU through the interpreter, the model taking them as it would on CUDA."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from triton_target import triton_device  # noqa: E402

CUDA = triton_device() == "cuda"

from ominix_runtime.contract import DecodeStep, NewRequestData, SamplingParams  # noqa: E402
from ominix_worker.models import llama  # noqa: E402
from ominix_worker.ops import fused  # noqa: E402
from ominix_worker.runner import build_runner  # noqa: E402
from ominix_worker.testing import write_tiny_hf_model  # noqa: E402

pytestmark = pytest.mark.gpu

PROMPT = [(11 * i + 5) % 300 + 3 for i in range(23)]


def _prefill_logits(folder: Path, device: str) -> torch.Tensor:
    runner = build_runner(str(folder), device=device, num_blocks=8)
    rows: list[torch.Tensor] = []
    compute = runner.model.compute_logits
    runner.model.compute_logits = lambda h: rows.append(compute(h)) or rows[-1]  # type: ignore[method-assign]  # records the logits
    step = NewRequestData("a", PROMPT, SamplingParams(temperature=0.0), [0, 1], 0, len(PROMPT), 1)
    runner.execute_step(DecodeStep(1, new_requests=[step]))
    return rows[0].float().cpu()


@pytest.mark.parametrize(("arch", "fused_calls"), [("qwen3", 2), ("gemma3_text", 0)])
def test_qk_norm_models_match_the_cpu_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, fused_calls: int
) -> None:
    folder = write_tiny_hf_model(tmp_path / arch, arch=arch, with_tokenizer=False)
    reference = _prefill_logits(folder, "cpu")
    calls: list[int] = []
    original: Callable[..., None] = fused.qk_norm_rotary_in_place

    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        original(*args, **kwargs)

    monkeypatch.setattr(fused, "qk_norm_rotary_in_place", counted)
    if CUDA:
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        got = _prefill_logits(folder, "cuda")
    else:
        monkeypatch.setattr(llama, "cuda_ops", lambda x: fused)
        got = _prefill_logits(folder, "cpu")
    assert len(calls) == fused_calls  # one per layer (two layers)
    rel = ((got - reference).abs().max() / reference.abs().max()).item()
    assert rel < 1e-4, rel
