"""Mixture-of-experts layers in a tensor-parallel group over NCCL (the Triton fused MoE on every rank):
TP=2 logits against TP=1 in bf16 for tensor-parallel experts and expert parallelism, and decode graphs that
capture the expert-parallel layer with its all-reduce (pipelined graph decode gives the eager tokens).

One command on a 2-GPU machine: ``NCCL_NVLS_ENABLE=0 python -m pytest -q tests/gpu/test_moe_tensor_parallel_gpu.py``
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "worker"))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE: 16 experts top-4 (8 per rank under expert parallelism), a dense layer among sparse ones."""
    from ominix_worker.testing import write_tiny_hf_model

    return write_tiny_hf_model(
        tmp_path_factory.mktemp("moe-tp-gpu") / "qwen3_moe",
        arch="qwen3_moe",
        vocab_size=1001,
        hidden_size=256,
        num_layers=3,
        heads=8,
        kv_heads=2,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=128,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        with_tokenizer=False,
    )


@pytest.mark.parametrize("moe", ["tensor", "expert"])
def test_moe_tp2_logits_match_tp1_in_bf16(moe: str, model_dir: Path, tmp_path: Path) -> None:
    from test_tensor_parallel import run_group
    from tp_logits import batch_logits, load_runner

    torch.backends.cuda.matmul.allow_tf32 = False
    exact = batch_logits(load_runner(str(model_dir), "cuda:0", torch.float32))
    single = batch_logits(load_runner(str(model_dir), "cuda:0", torch.bfloat16))
    sharded = run_group(
        model_dir, 2, tmp_path / "logits.pt", device="cuda", dtype="bfloat16", moe_parallel=moe
    )
    assert sharded.shape == single.shape == exact.shape
    # Splitting reorders bf16 sums (partials, then the all-reduce): it may add rounding, not more than bf16
    # itself makes against float32.
    single_error = float((single - exact).abs().max())
    sharded_error = float((sharded - exact).abs().max())
    assert sharded_error <= 2 * single_error + 1e-2, (sharded_error, single_error)
    agree = float((sharded.argmax(-1) == single.argmax(-1)).float().mean())
    assert agree >= 0.9, agree


@pytest.mark.parametrize("moe", ["tensor", "expert"])
def test_moe_tp2_decode_graphs_capture_the_layer(moe: str, model_dir: Path, tmp_path: Path) -> None:
    from test_tensor_parallel import run_group

    result = run_group(
        model_dir, 2, tmp_path / "graphs.pt", device="cuda", dtype="float32", check="graphs", moe_parallel=moe
    )
    assert result["num_graphs"] == 3
    assert result["max_logit_diff"] < 1e-3, result["max_logit_diff"]
    assert result["pipelined"] == result["eager"]
    assert all(len(tokens) == 12 for tokens in result["pipelined"].values())
