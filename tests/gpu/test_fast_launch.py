"""The fast Triton launch (ominix_worker.ops.launch) on the GPU: the norm, SiLU·mul, RoPE and greedy ops give
bit-identical outputs with the fast path off and on, over views whose start address, row count and row stride
put the launches under different keys; the MoE and FP8 kernels (routing, align, grouped GEMM, FP8 quantization,
the block-scaled and weight-streaming GEMMs, the clamped SwiGLU) likewise over token counts that take each path.
The repeat launches take the fast path, and every one picks the kernel Triton itself would launch
(CHECK_AGAINST_TRITON, set by conftest for the GPU and worker tests). The attention kernels are checked the same
way by the attention and runner GPU tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@contextmanager
def _fast(enabled: bool) -> Iterator[None]:
    from ominix_worker.ops import launch

    saved = [k.enabled for k in launch.KERNELS]
    for kernel, was in zip(launch.KERNELS, saved, strict=True):
        kernel.enabled = enabled and was
    try:
        yield
    finally:
        for kernel, was in zip(launch.KERNELS, saved, strict=True):
            kernel.enabled = was


# (rows, offset in elements of the view's start, padding of each row): 1 row and several; views that start 2, 4
# or 6 bytes off a 16-byte boundary; row strides that are and are not multiples of 16 elements. Each changes
# what Triton specializes the launch on (an address's alignment, an int that is 1 or a multiple of 16).
CASES = [(1, 0, 0), (16, 0, 0), (17, 1, 0), (33, 3, 1), (64, 0, 7), (257, 2, 0)]


def _view(rows: int, width: int, offset: int, pad: int, dtype: torch.dtype) -> torch.Tensor:
    """A fresh (rows, width) view, the same values each call: ``offset`` elements into its storage, rows
    ``width + pad`` apart."""
    gen = torch.Generator(device="cuda").manual_seed(rows * 131 + offset)
    flat = torch.randn(offset + rows * (width + pad), device="cuda", generator=gen).to(dtype)
    return flat[offset:].view(rows, width + pad)[:, :width]


def _compare(
    op: Callable[[torch.Tensor], torch.Tensor], width: int, dtype: torch.dtype = torch.bfloat16
) -> None:
    for rows, offset, pad in CASES:
        with _fast(False):
            slow = op(_view(rows, width, offset, pad, dtype))
        for _ in range(3):  # the first launch of a key is Triton's own, the next ones the fast path's
            fast = op(_view(rows, width, offset, pad, dtype))
            assert torch.equal(fast, slow), (rows, offset, pad)


def test_fused_ops_match_with_and_without_the_fast_launch() -> None:
    from ominix_worker.ops import fused, launch
    from ominix_worker.ops.greedy import greedy_argmax

    hidden = 4096
    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    residual_base = torch.randn(300, hidden, device="cuda", dtype=torch.bfloat16)

    def add_norm(x: torch.Tensor) -> torch.Tensor:
        residual = residual_base[: x.shape[0]].clone()
        out = fused.fused_add_rms_norm(x, residual, weight, 1e-5)
        return torch.cat([out, residual])

    _compare(lambda x: fused.rms_norm(x, weight, 1e-5), hidden)
    _compare(add_norm, hidden)
    _compare(lambda x: fused.silu_and_mul(x), 2 * 1792)
    positions_all = torch.arange(300, device="cuda") * 7 % 2048
    table = torch.randn(2, 2048, 128, device="cuda", dtype=torch.float32)

    def rotary(x: torch.Tensor) -> torch.Tensor:
        heads = x.view(x.shape[0], -1, 128)
        fused.rotary_in_place(heads, positions_all[: x.shape[0]], table)
        return heads

    _compare(rotary, 8 * 128)

    def greedy(x: torch.Tensor) -> torch.Tensor:
        ids, bad = greedy_argmax(x)
        return torch.cat([ids.float(), bad.float()])

    _compare(greedy, 32000, torch.float32)
    names = {"_rms_norm_kernel", "_silu_and_mul_kernel", "_rotary_kernel", "_greedy_kernel"}
    used = [k for k in launch.KERNELS if k.fn.__name__ in names]
    assert len(used) == 4
    for kernel in used:  # the fast path served launches, under several keys
        assert kernel.enabled and kernel.num_fast_launches > 0 and kernel.num_variants >= 3, (
            kernel.fn.__name__
        )


FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
MOE_KERNELS = {
    "_select_experts_kernel", "_moe_sum_kernel", "_moe_align_kernel", "_align_count_kernel", "_align_scan_kernel",
    "_align_scatter_kernel", "_grouped_gemm_kernel", "_quant_fp8_group_kernel", "_quant_fp8_row_kernel",
    "_silu_and_mul_quant_fp8_kernel", "_w8a8_block_kernel", "_clamped_swiglu_kernel", "_weight_stream_kernel",
}  # fmt: skip


@pytest.mark.skipif(not FP8_GPU, reason="needs an FP8 GPU (compute capability 8.9+)")
def test_moe_and_fp8_ops_match_with_and_without_the_fast_launch() -> None:
    from ominix_worker.ops import launch
    from ominix_worker.ops.biased_moe import clamped_swiglu_cuda, fused_experts_biased
    from ominix_worker.ops.fp8_gemm import fp8_linear, fp8_linear_gated
    from ominix_worker.ops.fused_moe import fused_experts, select_experts
    from ominix_worker.quant.fp8 import quantize_fp8_blocks

    gen = torch.Generator(device="cuda").manual_seed(7)
    experts, hidden, inter, top_k = 16, 256, 128, 4

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    w13 = randn(experts, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, scale=inter**-0.5)
    b13, b2 = randn(experts, 2 * inter), randn(experts, hidden)
    q13, s13 = quantize_fp8_blocks(w13, (128, 128))
    q2, s2 = quantize_fp8_blocks(w2, (128, 128))
    # per channel: the down projection's input goes to e4m3 in the SiLU·mul kernel
    c13, c13s = quantize_fp8_blocks(w13, (1, hidden))
    c2, c2s = quantize_fp8_blocks(w2, (1, inter))
    per_channel_experts = {
        "w13_scale": c13s,
        "w2_scale": c2s,
        "w13_block": (1, hidden),
        "w2_block": (1, inter),
    }
    dense, dense_scale = quantize_fp8_blocks(randn(384, hidden, scale=hidden**-0.5), (128, 128))
    per_channel, per_channel_scale = quantize_fp8_blocks(randn(384, hidden, scale=hidden**-0.5), (1, hidden))
    gated, gated_scale = quantize_fp8_blocks(randn(384, inter, scale=inter**-0.5), (1, inter))
    logits = {tokens: randn(tokens, experts) for tokens in (1, 8, 17, 600)}  # 600 x 4: the parallel align
    inputs = {tokens: randn(tokens, hidden) for tokens in logits}
    gate_ups = {tokens: randn(tokens, 2 * inter) for tokens in logits}

    def run_all() -> list[torch.Tensor]:
        outs: list[torch.Tensor] = []
        for tokens, x in inputs.items():
            weights, ids = select_experts(logits[tokens], top_k, renormalize=True)
            outs += [weights, ids.float()]
            outs.append(fused_experts(x, w13, w2, weights, ids))
            outs.append(fused_experts(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2))
            outs.append(fused_experts(x, c13, c2, weights, ids, **per_channel_experts))
            swiglu = lambda gu: clamped_swiglu_cuda(gu, 1.702, 7.0)  # noqa: E731
            outs.append(fused_experts_biased(x, w13, w2, b13, b2, weights, ids, swiglu))
            # up to 16 tokens the weight-streaming GEMM (GEMV at 1), above it the block-scaled / per-row ones
            outs.append(fp8_linear(x, dense, dense_scale, (128, 128), None))
            outs.append(fp8_linear(x, per_channel, per_channel_scale, (1, hidden), None))
            outs.append(fp8_linear_gated(gate_ups[tokens], gated, gated_scale, (1, inter)))
        return outs

    with _fast(False):
        slow = run_all()
    for _ in range(3):  # the first launch of a key is Triton's own, the next ones the fast path's
        fast = run_all()
        for i, (got, want) in enumerate(zip(fast, slow, strict=True)):
            assert torch.equal(got, want), i
    served = {k.fn.__name__: k for k in launch.KERNELS if k.fn.__name__ in MOE_KERNELS}
    assert set(served) == MOE_KERNELS
    for name, kernel in served.items():
        assert kernel.enabled and kernel.num_fast_launches > 0, name
