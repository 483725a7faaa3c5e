"""gpt-oss's experts on CUDA (fused MoE align + grouped GEMMs with biases and the clamped SwiGLU between,
``ops/biased_moe.py``) vs the torch reference in float64, with ragged loads and empty experts; the gpt-oss
MoE block on CUDA vs the same block on the CPU; a CUDA-graph replay of the block under new routings.

Runs on CUDA; ``TRITON_INTERPRET=1`` runs the kernels on the CPU (slowly: small shapes only)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from triton_target import INTERPRET, triton_device  # noqa: E402

DEVICE = triton_device()

from ominix_worker.config import config_from_hf_dict  # noqa: E402
from ominix_worker.models.gpt_oss import GptOssMoeBlock  # noqa: E402
from ominix_worker.ops.biased_moe import fused_experts_biased  # noqa: E402
from ominix_worker.ops.moe_ref import clamped_swiglu, fused_experts_ref, select_experts  # noqa: E402

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-5}
DTYPE = torch.float32 if INTERPRET else torch.bfloat16
SWIGLU = partial(clamped_swiglu, alpha=1.702, limit=7.0)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return ((got.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


SHAPES = [  # (tokens, experts, top_k, experts used, hidden, intermediate)
    (1, 8, 2, 8, 64, 32),
    (33, 8, 2, 3, 64, 48),  # 5 empty experts
    (20, 32, 4, 32, 64, 64),
]
if not INTERPRET:  # gpt-oss-20b's experts: 32 of 2880 → 2880, top-4
    SHAPES += [(1, 32, 4, 32, 2880, 2880), (256, 32, 4, 32, 2880, 2880), (2048, 32, 4, 9, 2880, 2880)]


@pytest.mark.parametrize(("tokens", "experts", "top_k", "used", "hidden", "inter"), SHAPES)
def test_biased_experts_match_the_reference(
    tokens: int, experts: int, top_k: int, used: int, hidden: int, inter: int
) -> None:
    gen = torch.Generator().manual_seed(tokens * 17 + experts)
    logits = torch.randn((tokens, experts), generator=gen)
    logits[:, used:] -= 100.0  # experts past ``used`` get no token
    weights, ids = select_experts(logits, top_k, renormalize=True)
    w13 = torch.randn((experts, 2 * inter, hidden), generator=gen) * (4.0 / hidden**0.5)  # clamps engage
    w2 = torch.randn((experts, hidden, inter), generator=gen) / inter**0.5
    b13 = torch.randn((experts, 2 * inter), generator=gen)
    b2 = torch.randn((experts, hidden), generator=gen)
    x = torch.randn((tokens, hidden), generator=gen)
    x, w13, w2, b13, b2 = (t.to(DTYPE) for t in (x, w13, w2, b13, b2))
    ref = fused_experts_ref(
        x.double(),
        lambda e: (w13[e].double(), w2[e].double()),
        experts,
        weights.double(),
        ids,
        SWIGLU,
        lambda e: (b13[e].double(), b2[e].double()),
    )
    dev = [t.to(DEVICE) for t in (x, w13, w2, b13, b2, weights, ids)]
    got = fused_experts_biased(*dev, SWIGLU)
    assert got.shape == (tokens, hidden) and got.dtype == DTYPE
    assert _rel(got, ref) < TOLERANCE[DTYPE]


def _block(num_experts: int, top_k: int, hidden: int, inter: int, seed: int) -> GptOssMoeBlock:
    raw = {
        "model_type": "gpt_oss", "vocab_size": 300, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_local_experts": num_experts,
        "num_experts_per_tok": top_k,
    }  # fmt: skip
    block = GptOssMoeBlock(config_from_hf_dict(raw))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / (param.shape[-1] ** 0.5))
    return block.to(DTYPE)


def _expected(block: GptOssMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The block's output in float64 on the CPU for the routing its own (device, run dtype) router picks: a
    near tie between the k-th and next expert must not flip between the two computations."""
    weights, ids = select_experts(block.gate(x), block.top_k, renormalize=True)
    e = block.experts
    w13, w2, b13, b2 = (t.detach().double().cpu() for t in (e.w13_weight, e.w2_weight, e.w13_bias, e.w2_bias))
    return fused_experts_ref(
        x.double().cpu(), lambda i: (w13[i], w2[i]), e.num_experts, weights.double().cpu(), ids.cpu(), SWIGLU,
        lambda i: (b13[i], b2[i]),
    )  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the block picks its CUDA path on CUDA tensors")
def test_the_block_on_cuda_matches_the_reference() -> None:
    block = _block(32, 4, 256, 192, seed=1).cuda()
    x = torch.randn((77, 256), generator=torch.Generator().manual_seed(2)).to(DTYPE).cuda()
    with torch.no_grad():
        got = block(x)
        assert _rel(got, _expected(block, x)) < TOLERANCE[DTYPE]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_captured_block_replays_new_routings() -> None:
    block = _block(32, 4, 256, 192, seed=3).cuda()
    gen = torch.Generator().manual_seed(4)
    x_static = torch.randn((16, 256), generator=gen).to(DTYPE).cuda()
    with torch.no_grad():
        block(x_static)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_static = block(x_static)
        for trial in range(3):
            x_static.copy_(torch.randn((16, 256), generator=gen).to(DTYPE))
            graph.replay()
            assert _rel(out_static, _expected(block, x_static)) < TOLERANCE[DTYPE], f"replay {trial}"


@pytest.mark.parametrize(("rows", "inter"), [(1, 32), (37, 48), (5, 2880)])
def test_clamped_swiglu_kernel_matches_torch(rows: int, inter: int) -> None:
    from ominix_worker.ops.biased_moe import clamped_swiglu_cuda

    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn((rows, 2 * inter), generator=gen) * 6.0).to(DTYPE)  # both clamps engage
    ref = clamped_swiglu(gate_up.double(), 1.702, 7.0)
    got = clamped_swiglu_cuda(gate_up.to(DEVICE), 1.702, 7.0)
    assert got.shape == (rows, inter) and got.dtype == DTYPE
    assert _rel(got, ref) < TOLERANCE[DTYPE]
