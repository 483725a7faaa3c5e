"""GEMMs of decode-sized batches that stream the weight once: x (M ≤ ``MAX_M`` tokens, K) @ Wᵀ, W read from
memory exactly once and widened in registers, x kept in its own dtype.

At a few tokens a GEMM is a read of the weight; a tile shaped for large M leaves most of the card's bandwidth
unused. Narrow N tiles give every SM its own slice of the weight, and K is split across programs until every SM
has two. The weight is e4m3 with scales (``Fp8Linear`` up to ``fp8_gemm.SMALL_M`` tokens) or in the activation
dtype (``PackableLinear`` at one token). Up to ``GEMV_M`` tokens the products are summed on the CUDA cores in
float32 (a matrix-vector product per token), above that in a 16-row tensor-core tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ominix_worker.devices import sm_count
from ominix_worker.ops import cdiv, next_power_of_2
from ominix_worker.ops.fused import silu_times
from ominix_worker.ops.fused_moe import per_row_scales
from ominix_worker.ops.scratch import SCRATCH

# The largest token count the kernel takes: one 16-row MMA tile.
MAX_M = 16

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
# Unscaled bf16 weights at 1 token take 16 output columns per program: the fastest tile for all four Llama-8B
# projections on an H100, 4.6% faster a layer than cuBLAS (bench/fp8_linear.py --sweep --bf16, bench/RESULTS.md).
_UNSCALED_GEMV_BLOCK_N = 16


@triton.jit(do_not_specialize=["M"])
def _weight_stream_kernel(
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
    SCALED: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (n, s): BLOCK_N output columns over the s-th of SPLIT_K slices of K. With SCALED (an e4m3
    weight), block scales multiply each K block's products and per-channel scales the slice's sum; without it
    the weight is in the activation dtype. USE_DOT: a BLOCK_M-row tensor-core dot per K block; otherwise each of
    the BLOCK_M tokens is multiplied into the float32 weight tile and summed over K. With SPLIT_K > 1 each
    program stores its float32 partial sum; the last of a column tile's programs to arrive (a counter per tile,
    reset by that program) adds them and writes the output, so the reduction needs no second kernel. GATED: x
    is a gated MLP's [gate | up] (M, 2K) and the GEMM's input is silu(gate) · up, formed as it is loaded and
    rounded as ``ops.fused.silu_and_mul`` rounds it: a down projection without its own SiLU kernel."""
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
            if GATED:
                up = tl.load(x_ptrs + K, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                x = silu_times(x.to(tl.float32), up)
            part = tl.dot(x, w.to(x.dtype))
        else:
            wf = w.to(tl.float32)
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for m in tl.static_range(BLOCK_M):
                xm = tl.load(x_row_ptrs + m * stride_xm, mask=k_mask & (offs_k * 0 + m < M), other=0.0)
                if GATED:
                    up = tl.load(
                        x_row_ptrs + m * stride_xm + K, mask=k_mask & (offs_k * 0 + m < M), other=0.0
                    )
                    xm = silu_times(xm.to(tl.float32), up)
                row = tl.sum(wf * xm.to(tl.float32)[:, None], axis=0)
                part = tl.where(offs_m[:, None] == m, row[None, :], part)
        if PER_CHANNEL or not SCALED:
            acc += part
        else:
            w_s = tl.load(s_ptr + (offs_n // GROUP_N) * stride_sn + k0 // GROUP_K, mask=n_mask, other=0.0)
            acc += part * w_s[None, :]
        x_ptrs += BLOCK_K
        x_row_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if PER_CHANNEL and SCALED:
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


def weight_stream_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] = (1, 0),
    block_n: int = 0,
    block_k: int = 0,
    split_k: int = 0,
    num_stages: int = 3,
    num_warps: int = 0,
    use_dot: bool | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """x (M ≤ MAX_M, K) @ (weight (N, K) · scales)ᵀ in x's dtype. ``scale`` None: the weight is used as it is
    (``block`` unused); else ``block`` is its scale block, (1, K) per channel. ``use_dot`` None takes the tensor
    cores above ``GEMV_M`` tokens; ``block_n``, ``block_k``, ``split_k`` and ``num_warps`` 0 are chosen from
    that, the scaling, the shape and the SM count. ``gated``: x is (M, 2K) laid out [gate | up] and the product
    is ``silu_and_mul(x) @ (...)ᵀ``, without the intermediate written."""
    m, width = x.shape
    n, k = weight.shape
    if width != (2 * k if gated else k) or x.stride(-1) != 1:
        raise ValueError(
            f"input {tuple(x.shape)} (stride {x.stride()}) for a weight of {k} columns, gated={gated}"
        )
    if m > MAX_M:
        raise ValueError(f"{m} tokens: the weight-streaming GEMM takes at most {MAX_M}")
    if use_dot is None:
        use_dot = m > GEMV_M
    scaled = scale is not None
    per_channel = not scaled or per_row_scales(block, k)
    if not block_n:
        block_n = _SMALL_M_BLOCK_N if scaled or use_dot else _UNSCALED_GEMV_BLOCK_N
    if not block_k:
        widest = 256 if use_dot else _GEMV_BLOCK_K
        block_k = widest if per_channel else min(widest, block[1])
    if not num_warps:
        num_warps = 4 if use_dot else _GEMV_WARPS
    if not per_channel and block[1] % block_k:
        raise ValueError(f"scale blocks of {block[1]} columns do not split into {block_k}-column tiles")
    tiles = cdiv(n, block_n)
    if not split_k:
        split_k = _split_k_for(tiles, cdiv(k, block_k), x.device)
    block_m = MAX_M if use_dot else next_power_of_2(m)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partial, arrivals = SCRATCH.get(x.device, split_k * block_m * n if split_k > 1 else 0, tiles)
    s = scale if scale is not None else out  # never read: SCALED is off
    _weight_stream_kernel[(tiles, split_k)](
        x, weight, s, out, partial, arrivals, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        s.stride(0), GROUP_N=block[0], GROUP_K=max(block[1], 1), SCALED=scaled, PER_CHANNEL=per_channel,
        SPLIT_K=split_k, USE_DOT=use_dot, GATED=gated, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def _split_k_for(tiles: int, k_blocks: int, device: torch.device) -> int:
    """Slices of K so that the programs fill every SM at least twice (each slice keeps 4+ K blocks)."""
    split = 1
    while tiles * split < 2 * sm_count(device) and k_blocks // (2 * split) >= 4:
        split *= 2
    return split
