"""The worker's warm-up compiles every attention-kernel variant a mixed step can take (decode rows in the
prefill kernel's launch, in the decode kernel unsplit, and split), so no request's step stalls for a compile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _compiled_variants() -> dict[str, int]:
    from ominix_worker.attention import triton_paged

    kernels = ("_decode_kernel", "_prefill_kernel", "_merge_splits_kernel")
    device = torch.cuda.current_device()
    # JITFunction.device_caches[device][0]: the compiled variants by specialization key.
    return {name: len(getattr(triton_paged, name).device_caches[device][0]) for name in kernels}


def test_warm_up_compiles_every_mixed_step_variant(tmp_path: Path) -> None:
    from ominix_worker.runner import build_runner

    config = tmp_path / "config.json"
    config.write_text(json.dumps(_CONFIG))
    runner = build_runner(
        f"dummy:{config}", device="cuda", dtype=torch.bfloat16, num_blocks=1024, max_model_len=8192
    )
    runner.warm_up(512)
    compiled = _compiled_variants()
    # After the warm-up, mixed steps of each plan: few short decode rows (in the prefill launch) beside a long
    # and a short prompt, many rows (their own launch, unsplit), long decode contexts (split), tiny prompts.
    cases = ((3, 60, 300), (3, 5, 12), (250, 40, 200), (2, 3000, 120), (1, 5000, 37), (9, 17, 2))
    for rows, context, prompt in cases:
        assert runner.mixed_forward(rows, context, prompt)
    torch.cuda.synchronize()
    assert _compiled_variants() == compiled
