"""The worker's warm-up compiles every attention-kernel variant a mixed step can take (decode rows in the
prefill kernel's launch, in the decode kernel unsplit, and split), so no request's step stalls for a compile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_decode_graphs import _CONFIG as DENSE_CONFIG

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# The decode-graph tests' tiny Llama, with room for the warm-up's 4,096-token decode context.
_CONFIG = {**DENSE_CONFIG, "max_position_embeddings": 8192}


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
