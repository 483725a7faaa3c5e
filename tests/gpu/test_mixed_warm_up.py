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
KERNELS = ("_decode_kernel", "_prefill_kernel", "_merge_splits_kernel")


def _compiled_variants() -> dict[str, int]:
    from ominix_worker.attention import triton_paged

    device = torch.cuda.current_device()
    # JITFunction.device_caches[device][0]: the compiled variants by specialization key (.fn: the kernels are
    # wrapped by ominix_worker.ops.launch.fast_kernel).
    return {name: len(getattr(triton_paged, name).fn.device_caches[device][0]) for name in KERNELS}


@pytest.mark.parametrize(
    ("block_size", "heads", "kv_heads"),
    [(16, 8, 2), (64, 8, 2), (16, 40, 40)],
    ids=["blocks-16", "blocks-64", "40-kv-heads"],  # 40 KV heads: 3 decode rows fill a 132-SM prefill launch
)
def test_warm_up_compiles_every_mixed_step_variant(
    tmp_path: Path, block_size: int, heads: int, kv_heads: int
) -> None:
    from ominix_worker.attention import triton_paged
    from ominix_worker.devices import sm_count
    from ominix_worker.runner import build_runner

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**_CONFIG, "num_attention_heads": heads, "num_key_value_heads": kv_heads}))
    runner = build_runner(
        f"dummy:{config}", device="cuda", dtype=torch.bfloat16, num_blocks=8192 // block_size * 4,
        block_size=block_size, max_model_len=8192,
    )  # fmt: skip
    for name in KERNELS:  # forget what earlier tests in this process compiled
        getattr(triton_paged, name).forget()
    runner.warm_up(512)
    compiled = _compiled_variants()
    # After the warm-up, mixed steps of each plan: a few short decode rows (in the prefill launch) beside a long
    # and a short prompt, more rows than the prefill launch takes (their own launch, unsplit), long decode
    # contexts (split), tiny prompts.
    fit = sm_count(torch.device("cuda")) // kv_heads
    few = min(3, fit)
    cases = [(few, 60, 300), (few, 5, 12), (fit + 5, 40, 200), (2, 3000, 120), (1, 5000, 37), (9, 17, 2)]
    for rows, context, prompt in cases:
        assert runner.mixed_forward(rows, context, prompt)
    torch.cuda.synchronize()
    assert _compiled_variants() == compiled
