"""FP8 GEMMs for ``Fp8Linear`` on GPUs with FP8 tensor cores (compute capability 8.9+): W8A8, and W8A16 for
decode-sized batches.

- Per-channel weight scales (block (1, K)): activations are quantized per token in one kernel and
  ``torch._scaled_mm`` runs with row-wise scales (cuBLASLt), output in the activation dtype. Computing (W xᵀ)ᵀ
  instead for decode-sized batches was slower at every token count from 1 to 512 on an H100 (bench/RESULTS.md).
- Block scales (e.g. (128, 128)): activations are quantized per token and K-group of the weight's block width,
  and a Triton tile accumulates ``dot(a, b) · a_scale · b_scale`` per K block in float32.
- Decode-sized batches (at most ``SMALL_M`` tokens), either scaling: the GEMM only streams the weight, so a
  Triton kernel reads the e4m3 weight once, widens it in registers and keeps the activations unquantized
  (W8A16). Narrow N tiles give every SM its own slice of the weight; cuBLASLt's FP8 GEMM read the weight at
  half the card's bandwidth at one token (bench/RESULTS.md). Up to ``GEMV_M`` tokens the products are summed on
  the CUDA cores in float32 (a matrix-vector product per token), above that a 16-row tensor-core tile does it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ominix_worker.devices import sm_count
from ominix_worker.ops.fused import silu_and_mul
from ominix_worker.ops.fused_moe import (
    per_row_scales,
    quant_fp8_per_token,
    quant_fp8_per_token_group,
    silu_and_mul_quant_fp8,
)


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
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
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
SMALL_M = 16
# Output columns per program of the weight-only kernel, with 256-column K blocks: the fastest tile for every
# Llama-8B projection at 1 and 16 tokens on an H100 (bench/fp8_linear.py --sweep, bench/RESULTS.md).
_SMALL_M_BLOCK_N = 32
# Up to this many tokens the weight-only kernel sums on the CUDA cores (one float32 FMA per weight element and
# token) instead of in a 16-row MMA tile of which all but M rows are padding. At 1 token that read a Llama-8B
# layer's weights in 87 µs against 98 µs for the best MMA tiles; at 2 tokens the two were even, at 4 the CUDA
# cores were 1.6× slower (H100, bench/fp8_linear.py --sweep, bench/RESULTS.md).
GEMV_M = 1
# The CUDA-core variant's tile at 1 token: 512-wide K blocks, 8 warps (same sweep).
_GEMV_BLOCK_K = 512
_GEMV_WARPS = 8


@triton.jit(do_not_specialize=["M"])
def _w8a16_small_m_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    partial_ptr,
    arrivals_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_sn,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (n, s): BLOCK_N output columns over the s-th of SPLIT_K slices of K. Block scales multiply each K
    block's products, per-channel scales the slice's sum. USE_DOT: a BLOCK_M-row tensor-core dot per K block;
    otherwise each of the BLOCK_M tokens is multiplied into the float32 weight tile and summed over K. With
    SPLIT_K > 1 each program stores its float32 partial sum; the last of a column tile's programs to arrive (a
    counter per tile, reset by that program) adds them and writes the output, so the reduction needs no second
    kernel."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    x_row_ptrs = x_ptr + offs_k  # token 0's K block; token m's is m * stride_xm further
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = offs_k < k_end - k0 + k_start
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if USE_DOT:
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            part = tl.dot(x, w.to(x.dtype))
        else:
            wf = w.to(tl.float32)
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for m in tl.static_range(BLOCK_M):
                xm = tl.load(x_row_ptrs + m * stride_xm, mask=k_mask & (offs_k * 0 + m < M), other=0.0)
                row = tl.sum(wf * xm.to(tl.float32)[:, None], axis=0)
                part = tl.where(offs_m[:, None] == m, row[None, :], part)
        if PER_CHANNEL:
            acc += part
        else:
            w_s = tl.load(s_ptr + (offs_n // GROUP_N) * stride_sn + k0 // GROUP_K, mask=n_mask, other=0.0)
            acc += part * w_s[None, :]
        x_ptrs += BLOCK_K
        x_row_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if PER_CHANNEL:
        acc *= tl.load(s_ptr + offs_n * stride_sn, mask=n_mask, other=0.0)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(partial_ptr + pid_k * BLOCK_M * N + tile, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is stored before the arrival is counted (release below)
        arrived = tl.atomic_add(arrivals_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for split in range(SPLIT_K):  # L2 reads (.cg): other SMs wrote these
                total += tl.load(
                    partial_ptr + split * BLOCK_M * N + tile, mask=out_mask, other=0.0, cache_modifier=".cg"
                )
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(arrivals_ptr + pid_n, 0)  # ready for the next call (and the next graph replay)


class _SplitKScratch:
    """Per device: float32 partial sums and one arrival counter per column tile (zero between calls), grown on
    demand. The worker runs its forward passes on one stream, whose kernels run one after another, so every call
    shares them. A CUDA graph holds the addresses it captured, so a replaced buffer is kept, never freed, and none
    may be replaced during capture."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}

    def get(self, device: torch.device, partial: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._at_least(device, torch.float32, partial), self._at_least(device, torch.int32, tiles)

    def _at_least(self, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
        held = self._buffers.setdefault((device, dtype), [])
        if not held or held[-1].numel() < numel:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the FP8 split-K scratch grew during CUDA graph capture; run once before")
            held.append(torch.zeros(max(numel, 1 << 16), dtype=dtype, device=device))
        return held[-1]


_SCRATCH = _SplitKScratch()


def w8a16_small_m_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    block_n: int = _SMALL_M_BLOCK_N,
    block_k: int = 0,
    split_k: int = 0,
    num_stages: int = 3,
    num_warps: int = 0,
    use_dot: bool | None = None,
) -> torch.Tensor:
    """x (M ≤ SMALL_M, K) @ (weight (N, K) e4m3 · scales)ᵀ with x unquantized. ``block`` is the scale block:
    (1, K) per channel. ``use_dot`` None takes the tensor cores above ``GEMV_M`` tokens; ``block_k``,
    ``split_k`` and ``num_warps`` 0 are chosen from that, the shape and the SM count."""
    m, k = x.shape
    n = weight.shape[0]
    if m > SMALL_M:
        raise ValueError(f"{m} tokens: the weight-only FP8 GEMM takes at most {SMALL_M}")
    if use_dot is None:
        use_dot = m > GEMV_M
    per_channel = per_row_scales(block, k)
    if not block_k:
        widest = 256 if use_dot else _GEMV_BLOCK_K
        block_k = widest if per_channel else min(widest, block[1])
    if not num_warps:
        num_warps = 4 if use_dot else _GEMV_WARPS
    if not per_channel and block[1] % block_k:
        raise ValueError(f"scale blocks of {block[1]} columns do not split into {block_k}-column tiles")
    tiles = triton.cdiv(n, block_n)
    if not split_k:
        split_k = _split_k_for(tiles, triton.cdiv(k, block_k), x.device)
    block_m = SMALL_M if use_dot else triton.next_power_of_2(m)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partial, arrivals = _SCRATCH.get(x.device, split_k * block_m * n if split_k > 1 else 0, tiles)
    _w8a16_small_m_kernel[(tiles, split_k)](
        x, weight, scale, out, partial, arrivals, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        scale.stride(0), GROUP_N=block[0], GROUP_K=block[1], PER_CHANNEL=per_channel, SPLIT_K=split_k,
        USE_DOT=use_dot, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out


def _split_k_for(tiles: int, k_blocks: int, device: torch.device) -> int:
    """Slices of K so that the programs fill every SM at least twice (each slice keeps 4+ K blocks)."""
    split = 1
    while tiles * split < 2 * sm_count(device) and k_blocks // (2 * split) >= 4:
        split *= 2
    return split


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
        out = w8a16_small_m_matmul(x2.contiguous(), weight, scale, block)
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
    the down projection's input is read once, as two bf16 halves, instead of written and read again."""
    if gate_up.shape[0] > SMALL_M and per_row_scales(block, weight.shape[1]):
        return _per_channel_scaled_mm(*silu_and_mul_quant_fp8(gate_up), weight, scale, gate_up.dtype)
    return fp8_linear(silu_and_mul(gate_up), weight, scale, block, None)
