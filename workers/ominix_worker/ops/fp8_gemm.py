"""FP8 GEMMs for ``Fp8Linear`` on GPUs with FP8 tensor cores (compute capability 8.9+): W8A8, and W8A16 for
decode-sized batches.

- Per-channel weight scales (block (1, K)): activations are quantized per token in one kernel and
  ``torch._scaled_mm`` runs with row-wise scales (cuBLASLt), output in the activation dtype. Computing (W xᵀ)ᵀ
  instead for decode-sized batches was slower at every token count from 1 to 512 on an H100 (bench/RESULTS.md).
- Block scales (e.g. (128, 128)): activations are quantized per token and K-group of the weight's block width,
  and a Triton tile accumulates ``dot(a, b) · a_scale · b_scale`` per K block in float32.
- Decode-sized batches (at most ``SMALL_M`` tokens), either scaling: the GEMM only streams the weight, so
  ``ops.weight_stream`` reads the e4m3 weight once, widens it in registers and keeps the activations
  unquantized (W8A16). cuBLASLt's FP8 GEMM read the weight at half the card's bandwidth at one token
  (bench/RESULTS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ominix_worker.ops import cdiv
from ominix_worker.ops.fused import silu_and_mul
from ominix_worker.ops.fused_moe import (
    per_row_scales,
    quant_fp8_per_token,
    quant_fp8_per_token_group,
    silu_and_mul_quant_fp8,
)
from ominix_worker.ops.weight_stream import MAX_M, weight_stream_matmul


@triton.jit(do_not_specialize=["M"])  # M is the step's token count: no variant per value
def _w8a8_block_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    a_scale_ptr,
    b_scale_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_bsn,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        a_s = tl.load(a_scale_ptr + offs_m * stride_asm + k0 // BLOCK_K, mask=m_mask, other=0.0)
        b_s = tl.load(b_scale_ptr + (offs_n // GROUP_N) * stride_bsn + k0 // GROUP_K, mask=n_mask, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def w8a8_block_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """x (M, K) in bf16/fp16 @ (weight (N, K) e4m3 · block scales)ᵀ → (M, N) in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    block_k = min(128, block[1])
    while block[1] % block_k and block_k > 32:
        block_k //= 2
    if block[1] % block_k:
        raise ValueError(f"scale blocks of {block[1]} columns: the FP8 GEMM needs a multiple of 32")
    q, a_scale = quant_fp8_per_token_group(x, block_k)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64 if m <= 256 else 128
    block_n = 64 if m <= 16 else 128
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    _w8a8_block_kernel[grid](
        q, weight, out, a_scale, scale, m, n, k, q.stride(0), weight.stride(0), out.stride(0),
        a_scale.stride(0), scale.stride(0), GROUP_N=block[0], GROUP_K=block[1], BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4 if block_m <= 64 else 8, num_stages=3,
    )  # fmt: skip
    return out


def w8a8_per_channel_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ (weight (N, K) e4m3 · per-row scale (N, 1))ᵀ as x_q Wᵀ."""
    return _per_channel_scaled_mm(*quant_fp8_per_token(x), weight, scale, x.dtype)


def _per_channel_scaled_mm(
    q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """e4m3 rows ``q`` (M, K) with per-row scales (M, 1) @ (weight (N, K) · per-row scale (N, 1))ᵀ in ``dtype``."""
    return torch._scaled_mm(q, weight.t(), scale_a=q_scale, scale_b=scale.reshape(1, -1), out_dtype=dtype)


# Steps of up to one 16-row MMA tile take the weight-only kernel; larger ones the tensor-core FP8 GEMMs. At 16
# tokens the weight-only kernel was 20% faster per Llama-8B step on an H100; above 16 the two were not compared.
SMALL_M = MAX_M


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``F.linear`` with an FP8 weight: (..., K) → (..., N)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.shape[0] == 0:
        out = x2.new_empty((0, weight.shape[0]))
    elif x2.shape[0] <= SMALL_M:
        out = weight_stream_matmul(x2.contiguous(), weight, scale, block)
    elif per_row_scales(block, weight.shape[1]):
        out = w8a8_per_channel_matmul(x2.contiguous(), weight, scale)
    else:
        out = w8a8_block_matmul(x2.contiguous(), weight, scale, block)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], weight.shape[0])


def fp8_linear_gated(
    gate_up: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``fp8_linear(silu_and_mul(gate_up), ...)`` without a bias: (T, 2I) laid out [gate | up] → (T, N). With
    per-channel scales above ``SMALL_M`` tokens the product goes straight to e4m3 (``silu_and_mul_quant_fp8``):
    the down projection's input is read once, as two bf16 halves, instead of written and read again. Up to
    ``SMALL_M`` tokens the weight-streaming kernel forms the product as it loads its input."""
    if 0 < gate_up.shape[0] <= SMALL_M and gate_up.stride(-1) == 1:
        return weight_stream_matmul(gate_up, weight, scale, block, gated=True)
    if gate_up.shape[0] > SMALL_M and per_row_scales(block, weight.shape[1]):
        return _per_channel_scaled_mm(*silu_and_mul_quant_fp8(gate_up), weight, scale, gate_up.dtype)
    return fp8_linear(silu_and_mul(gate_up), weight, scale, block, None)
