"""The weight-streaming GEMM on unscaled weights (``PackableLinear``'s one-token path on CUDA): its product
against float64, and which layers and inputs take it.

Needs CUDA; ``TRITON_INTERPRET=1`` runs the kernel on the CPU (float32 there, so the tests that route a layer
through it, which need CUDA tensors, skip)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_target import INTERPRET, triton_device  # noqa: E402

DEVICE = triton_device()
CUDA = DEVICE == "cuda"

from ominix_worker.ops.fused import silu_and_mul  # noqa: E402
from ominix_worker.ops.weight_stream import MAX_M, weight_stream_matmul  # noqa: E402
from ominix_worker.parallel import (  # noqa: E402
    ColumnParallelLinear,
    PackableLinear,
    ParallelLMHead,
    RowParallelLinear,
)

pytestmark = pytest.mark.gpu

DTYPE = torch.float32 if INTERPRET else torch.bfloat16
# float32 sums of exact products: the output's rounding to bf16 (2^-9 relative) and the sum order.
VS_FLOAT64 = 1e-5 if INTERPRET else 0.006


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return ((got.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


@pytest.mark.parametrize("m", [1, 3, MAX_M])
@pytest.mark.parametrize(("n", "k"), [(200, 384), (72, 1408)] + ([] if INTERPRET else [(28672, 4096)]))
def test_unscaled_weight_matches_float64(m: int, n: int, k: int) -> None:
    """N and K not multiples of the tile; 1 token on the CUDA cores, more on the tensor cores."""
    gen = torch.Generator().manual_seed(m * n + k)
    w = (torch.randn((n, k), generator=gen) / k**0.5).to(DTYPE)
    x = torch.randn((m, k), generator=gen).to(DTYPE)
    got = weight_stream_matmul(x.to(DEVICE), w.to(DEVICE))
    assert got.shape == (m, n) and got.dtype == DTYPE
    assert _rel(got, x.double() @ w.double().T) < VS_FLOAT64


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_unscaled_split_k_resets_between_calls(split_k: int) -> None:
    """K in uneven slices (11 blocks of 128); three calls on new inputs each start from clean counters."""
    n, k = 72, 1408
    gen = torch.Generator().manual_seed(split_k)
    w = (torch.randn((n, k), generator=gen) / k**0.5).to(DTYPE)
    for _ in range(3):
        x = torch.randn((1, k), generator=gen).to(DTYPE)
        got = weight_stream_matmul(x.to(DEVICE), w.to(DEVICE), block_n=16, block_k=128, split_k=split_k)
        assert _rel(got, x.double() @ w.double().T) < VS_FLOAT64


@pytest.mark.parametrize("m", [1, 3, MAX_M])
@pytest.mark.parametrize(("n", "k"), [(200, 384), (72, 1408)])
def test_gated_input_gives_the_bits_of_silu_and_mul_first(m: int, n: int, k: int) -> None:
    """[gate | up] in, silu(gate) · up formed in the loads: the same bits as the SiLU kernel's output fed in."""
    gen = torch.Generator().manual_seed(7 * m + n)
    w = (torch.randn((n, k), generator=gen) / k**0.5).to(DTYPE).to(DEVICE)
    gate_up = torch.randn((m, 2 * k), generator=gen).to(DTYPE).to(DEVICE)
    fused = weight_stream_matmul(gate_up, w, gated=True)
    assert fused.shape == (m, n)
    assert torch.equal(fused, weight_stream_matmul(silu_and_mul(gate_up), w))


def test_gated_input_of_the_wrong_width_is_refused() -> None:
    w = torch.zeros((8, 64), dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="gated=True"):
        weight_stream_matmul(torch.zeros((1, 64), dtype=DTYPE, device=DEVICE), w, gated=True)


needs_cuda = pytest.mark.skipif(not CUDA, reason="layers route CUDA tensors only")


@needs_cuda
def test_one_token_down_projection_takes_the_gated_kernel() -> None:
    """The MLP's down projection at one token: the gated kernel, bit for bit the SiLU kernel then the GEMM; more
    tokens and a turned-off stream keep the two kernels."""
    torch.manual_seed(2)
    layer = RowParallelLinear(384, 256, bias=False).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
    one = torch.randn((1, 768), device="cuda", dtype=torch.bfloat16)
    fused = layer.forward_gated(one, silu_and_mul)
    torch.testing.assert_close(fused, weight_stream_matmul(one, layer.weight, gated=True), rtol=0, atol=0)
    torch.testing.assert_close(fused, layer(silu_and_mul(one)), rtol=0, atol=0)
    two = torch.randn((2, 768), device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(
        layer.forward_gated(two, silu_and_mul), layer(silu_and_mul(two)), rtol=0, atol=0
    )
    try:
        PackableLinear.stream_single_token = False
        unfused = layer.forward_gated(one, silu_and_mul)
        torch.testing.assert_close(unfused, F.linear(silu_and_mul(one), layer.weight), rtol=0, atol=0)
    finally:
        PackableLinear.stream_single_token = True


@needs_cuda
@pytest.mark.parametrize("bias", [False, True])
def test_one_token_takes_the_kernel_and_more_take_cublas(bias: bool) -> None:
    torch.manual_seed(0)
    layer = ColumnParallelLinear.split_evenly(512, [384], bias=bias).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
        if layer.bias is not None:
            layer.bias.normal_()
    one = torch.randn((1, 512), device="cuda", dtype=torch.bfloat16)
    expected = weight_stream_matmul(one, layer.weight)
    if layer.bias is not None:
        expected = expected + layer.bias
    torch.testing.assert_close(layer(one), expected, rtol=0, atol=0)
    torch.testing.assert_close(layer(one), F.linear(one, layer.weight, layer.bias), rtol=0.02, atol=0.02)
    two = torch.randn((2, 512), device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(layer(two), F.linear(two, layer.weight, layer.bias), rtol=0, atol=0)
    try:
        PackableLinear.stream_single_token = False
        torch.testing.assert_close(layer(one), F.linear(one, layer.weight, layer.bias), rtol=0, atol=0)
    finally:
        PackableLinear.stream_single_token = True


@needs_cuda
def test_lm_head_streams_one_position() -> None:
    torch.manual_seed(1)
    head = ParallelLMHead(1000, 256).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.normal_(0, 0.05)
    hidden = torch.randn((1, 256), device="cuda", dtype=torch.bfloat16)
    logits = head.logits(hidden)
    assert logits.shape == (1, head.weight.shape[0])
    torch.testing.assert_close(logits, weight_stream_matmul(hidden, head.weight), rtol=0, atol=0)


@needs_cuda
def test_float32_layers_stay_on_cublas() -> None:
    torch.manual_seed(2)
    layer = ColumnParallelLinear.split_evenly(256, [128], bias=False).to(device="cuda", dtype=torch.float32)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
    x = torch.randn((1, 256), device="cuda")
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=0, atol=0)
