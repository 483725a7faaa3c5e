"""Attention's fused kernels through the CUDA ops path: Qwen3 (per-head Q/K norms) takes the fused norm + RoPE
kernel, Gemma 3 (whose norms scale by 1 + weight in float32) keeps its own norms, and Llama (no Q/K norms) takes
the one launch of RoPE and the KV store when its backend does (the Triton one on CUDA); each gives the logits of
the CPU path.

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


# Per architecture, the calls of each fused attention op in one prefill (the tiny models have two layers).
FUSED_CALLS = {
    "qwen3": {"qk_norm_rotary_in_place": 2, "rotary_store_kv": 0},
    "gemma3_text": {"qk_norm_rotary_in_place": 0, "rotary_store_kv": 0},
    # The CPU runner's torch reference backend keeps its own store, so only CUDA takes the one launch.
    "llama": {"qk_norm_rotary_in_place": 0, "rotary_store_kv": 2 if CUDA else 0},
}


@pytest.mark.parametrize("arch", sorted(FUSED_CALLS))
def test_fused_attention_ops_match_the_cpu_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    folder = write_tiny_hf_model(tmp_path / arch, arch=arch, with_tokenizer=False)
    reference = _prefill_logits(folder, "cpu")
    calls = dict.fromkeys(FUSED_CALLS[arch], 0)
    for name in calls:
        original: Callable[..., None] = getattr(fused, name)

        def counted(
            *args: Any, _name: str = name, _original: Callable[..., None] = original, **kwargs: Any
        ) -> None:
            calls[_name] += 1
            _original(*args, **kwargs)

        monkeypatch.setattr(fused, name, counted)
    if CUDA:
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        got = _prefill_logits(folder, "cuda")
    else:
        monkeypatch.setattr(llama, "cuda_ops", lambda x: fused)
        got = _prefill_logits(folder, "cpu")
    assert calls == FUSED_CALLS[arch]
    rel = ((got - reference).abs().max() / reference.abs().max()).item()
    assert rel < 1e-4, rel
