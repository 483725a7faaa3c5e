"""FP8 checkpoints (e4m3, block-128 or per-channel scales, written here from tiny random models) in a TP=2 group
over NCCL on two GPUs: W8A8 GEMMs and the FP8 fused MoE run on each rank's shards. TP=2 logits against TP=1
(both bf16 activations) measured against the checkpoint's exact dequantized logits (float32 CPU reference),
decode graphs that capture the FP8 layers with their all-reduces, and greedy tokens through the service.

One command on a 2-GPU machine:
``NCCL_NVLS_ENABLE=0 python -m pytest -q tests/gpu/test_fp8_tensor_parallel_gpu.py``
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
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
        reason="W8A8 FP8 GEMMs need an FP8 GPU (compute capability 8.9+)",
    ),
]

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "worker"))
sys.path.insert(0, str(HERE.parent / "faults"))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

# head_dim 128 and every shard a multiple of 128 at TP=2 (q 256 rows, one KV head of 128, FFN 512, experts 128).
SHAPES = {
    "llama": dict(arch="llama", hidden_size=512, heads=4, kv_heads=2, intermediate_size=1024),
    "qwen3_moe": dict(
        arch="qwen3_moe",
        hidden_size=512,
        heads=4,
        kv_heads=2,
        intermediate_size=1024,
        num_layers=3,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from ominix_worker.testing import write_fp8_checkpoint, write_tiny_hf_model

    cache: dict[tuple[str, str], Path] = {}

    def get(name: str, granularity: str) -> Path:
        if (name, granularity) not in cache:
            root = tmp_path_factory.mktemp(f"fp8-tp-gpu-{name}-{granularity}")
            source = write_tiny_hf_model(root / "bf16", vocab_size=1001, **SHAPES[name])  # type: ignore[arg-type]
            cache[name, granularity] = write_fp8_checkpoint(source, root / "fp8", granularity, block=128)
        return cache[name, granularity]

    return get


CASES = [
    ("llama", "block", "tensor"),
    ("llama", "channel", "tensor"),
    ("qwen3_moe", "block", "tensor"),
    ("qwen3_moe", "block", "expert"),
]


@pytest.mark.parametrize(("name", "granularity", "moe"), CASES, ids=["-".join(c) for c in CASES])
def test_fp8_tp2_logits_match_tp1(name: str, granularity: str, moe: str, fp8_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from test_tensor_parallel import run_group
    from tp_logits import batch_logits, load_runner

    folder = fp8_dir(name, granularity)
    exact = batch_logits(load_runner(str(folder), "cpu", torch.float32))  # dequantized weights, float32
    single = batch_logits(load_runner(str(folder), "cuda:0", torch.bfloat16))
    sharded = run_group(folder, 2, tmp_path / "logits.pt", device="cuda", dtype="bfloat16", moe_parallel=moe)
    assert sharded.shape == single.shape == exact.shape
    # Activations are quantized per token (and 128-column group) on each rank's columns and sums are
    # reordered: that may add rounding, not more than TP=1's W8A8 GEMMs make against the exact logits.
    single_error = float((single - exact).abs().max())
    sharded_error = float((sharded - exact).abs().max())
    assert sharded_error <= 2 * single_error + 1e-2, (sharded_error, single_error)
    # The tiny random models' logits have near ties that FP8 rounding breaks either way, so TP=2 must pick
    # the exact model's top token about as often as TP=1 does, rather than TP=1's own picks.
    exact_top = exact.argmax(-1)
    single_agree = float((single.argmax(-1) == exact_top).float().mean())
    sharded_agree = float((sharded.argmax(-1) == exact_top).float().mean())
    assert sharded_agree >= single_agree - 0.1, (sharded_agree, single_agree)


@pytest.mark.parametrize(("name", "moe"), [("llama", "tensor"), ("qwen3_moe", "expert")])
def test_fp8_tp2_decode_graphs_capture_the_fp8_layers(name: str, moe: str, fp8_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from test_tensor_parallel import run_group

    result = run_group(
        fp8_dir(name, "block"), 2, tmp_path / "graphs.pt", device="cuda", dtype="bfloat16", check="graphs",
        moe_parallel=moe,
    )  # fmt: skip
    assert result["num_graphs"] == 3
    assert result["max_logit_diff"] < 5e-2, result["max_logit_diff"]
    assert result["pipelined"] == result["eager"]


def test_fp8_tp2_service_gives_tp1_greedy_tokens(fp8_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two ranks behind a real engine serve the block-scaled Qwen3-MoE (expert-parallel): every request ends
    once with its tokens, whose first token is a TP=1 GPU runner's greedy one. (Later tokens may part: the
    tiny random model's near ties break either way under FP8 rounding per rank; on an H100 x 2 one request
    parted at its third token. The logits tests bound the error.)"""
    from concurrent.futures import ThreadPoolExecutor

    from fault_procs import stream_one
    from test_tensor_parallel_service import greedy_reference, prompt
    from tp_procs import request, start_tp_engine

    from ominix_runtime.pb import engine_pb2

    folder = fp8_dir("qwen3_moe", "block")
    prompts = [prompt(i, 20 + 7 * i) for i in range(4)]
    reference = greedy_reference(folder, prompts, 16, device="cuda:0", dtype="bfloat16")
    worker_args = ("--gpu-memory-utilization", "0.3", "--max-model-len", "1024", "--moe-parallel", "expert")
    devices = ("cuda:0", "cuda:1")
    with start_tp_engine(str(folder), tmp_path, devices=devices, worker_args=worker_args) as (engine, _):
        (backend,) = engine.stub.ListBackends(engine_pb2.ListBackendsRequest(), timeout=5).backends
        assert backend.tensor_parallel_size == 2 and backend.weight_dtype == "float8_e4m3fn"
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(
                pool.map(
                    lambda i: stream_one(engine.stub, request(f"g{i}", prompts[i], 16), 120),
                    range(len(prompts)),
                )
            )
    for i, out in enumerate(outs):
        assert out.status is None and out.done is not None and len(out.tokens) == 16, out
        same = next((k for k, (a, b) in enumerate(zip(out.tokens, reference[i], strict=True)) if a != b), 16)
        assert same >= 1, (i, out.tokens, reference[i])
