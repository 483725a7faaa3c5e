"""Triton fused elementwise ops for the decoder layer: RMSNorm (optionally with the residual add), SiLU-and-mul,
rotary embedding applied in place, and rotary with the paged KV store in one launch. Each reads its inputs once
and writes its outputs once, where the torch versions make several passes (and launches) over the same
activations.

Numerics follow the model code: RMSNorm normalises in fp32 and scales in the run dtype; rotary uses the
rotate-half (GPT-NeoX) layout with a ``cos_sin`` table of shape (2, max_positions, head_dim) in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ominix_worker.attention.base import FP8_KV_DTYPES
from ominix_worker.ops import cdiv, next_power_of_2
from ominix_worker.ops.launch import fast_kernel


@fast_kernel
@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    x_stride,
    residual_stride,
    out_stride,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        # The sum is rounded to the run dtype before normalising, as an unfused ``x + residual`` would be.
        x = x + tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        tl.store(residual_ptr + row * residual_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / N + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = (x32 * rstd).to(x.dtype) * w
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x²) + eps))`` over the last dim of a 2-D ``x``."""
    out = torch.empty_like(x)
    n = x.shape[-1]
    _rms_norm_kernel[(x.shape[0],)](
        x, x, weight, out, x.stride(0), x.stride(0), out.stride(0), eps, N=n,
        BLOCK=next_power_of_2(n), ADD_RESIDUAL=False, num_warps=_warps(n),
    )  # fmt: skip
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` in place, then returns ``rms_norm(residual)``; one pass instead of four."""
    out = torch.empty_like(x)
    n = x.shape[-1]
    _rms_norm_kernel[(x.shape[0],)](
        x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0), eps, N=n,
        BLOCK=next_power_of_2(n), ADD_RESIDUAL=True, num_warps=_warps(n),
    )  # fmt: skip
    return out


def _warps(n: int) -> int:
    return 4 if n <= 2048 else 8 if n <= 8192 else 16


@triton.jit
def silu_times(gate, up):
    """silu(gate) · up as every gated-MLP kernel rounds it: silu of the float32 gate in up's dtype, times up."""
    return (gate / (1.0 + tl.exp(-gate))).to(up.dtype) * up


@fast_kernel
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + N + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * out_stride + cols, silu_times(gate, up), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(T, 2I) laid out [gate | up] → silu(gate) * up, shape (T, I)."""
    num_tokens, width = gate_up.shape
    n = width // 2
    if out is None:
        out = torch.empty((num_tokens, n), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(num_tokens, cdiv(n, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), N=n, BLOCK=block, num_warps=4
    )
    return out


@fast_kernel
@triton.jit
def _rotary_kernel(
    x_ptr,
    pos_ptr,
    cos_sin_ptr,
    x_stride_t,
    x_stride_h,
    table_stride,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    pos, offs_h, offs_d, mask, base, x1, x2 = _token_heads(
        x_ptr, pos_ptr, x_stride_t, x_stride_h, num_heads, HALF, BLOCK_H, BLOCK_HALF
    )
    _rotate_store(
        base, x1.to(tl.float32), x2.to(tl.float32), cos_sin_ptr, table_stride, pos, offs_d, mask, HALF
    )


@triton.jit
def _token_heads(
    x_ptr,
    pos_ptr,
    x_stride_t,
    x_stride_h,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """This program's token: its position, the head and half-dim offsets, the mask of real (head, column) pairs,
    the pointers to each head's first half and the two halves loaded."""
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d < HALF)[None, :]
    base = x_ptr + t.to(tl.int64) * x_stride_t + offs_h[:, None] * x_stride_h + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    return pos, offs_h, offs_d, mask, base, x1, x2


@triton.jit
def _rotated(a, b, cos_sin_ptr, table_stride, pos, offs_d, HALF: tl.constexpr):
    """The rotation of the float32 halves ``a``, ``b`` (heads × HALF) at position ``pos``, in float32."""
    d_mask = offs_d < HALF
    cos = tl.load(cos_sin_ptr + pos * 2 * HALF + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + table_stride + pos * 2 * HALF + offs_d, mask=d_mask, other=0.0)[None, :]
    # cos/sin repeat across the two halves (emb = cat(freqs, freqs)), so the first half's entries serve both.
    return a * cos - b * sin, b * cos + a * sin


@triton.jit
def _rotate_store(base, a, b, cos_sin_ptr, table_stride, pos, offs_d, mask, HALF: tl.constexpr):
    """Stores the rotation of the float32 halves ``a``, ``b`` (heads × HALF) at position ``pos`` to ``base`` and
    ``base + HALF``, in the dtype ``base`` points to."""
    first, second = _rotated(a, b, cos_sin_ptr, table_stride, pos, offs_d, HALF)
    dtype = base.dtype.element_ty
    tl.store(base, first.to(dtype), mask=mask)
    tl.store(base + HALF, second.to(dtype), mask=mask)


@triton.jit
def kv_cache_value(x, scale, KV_FP8: tl.constexpr, dtype: tl.constexpr):
    """``x`` as a KV cache of ``dtype`` holds it: an FP8 cache x / scale, saturated to the e4m3 range."""
    if KV_FP8:
        x = tl.clamp(x.to(tl.float32) / scale, -448.0, 448.0)
    return x.to(dtype)


def rotary_in_place(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotates ``x`` (T, heads, head_dim) in place; ``cos_sin`` (2, max_positions, head_dim) float32, contiguous."""
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens == 0:
        return
    assert x.stride(2) == 1 and cos_sin.is_contiguous() and cos_sin.shape[-1] == head_dim
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        x, positions, cos_sin, x.stride(0), x.stride(1), cos_sin.stride(0), num_heads, HALF=half,
        BLOCK_H=next_power_of_2(num_heads), BLOCK_HALF=next_power_of_2(half), num_warps=4,
    )  # fmt: skip


@fast_kernel
@triton.jit
def _qk_norm_rotary_kernel(
    x_ptr,
    pos_ptr,
    cos_sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    x_stride_t,
    x_stride_h,
    table_stride,
    num_heads,
    num_q_heads,
    eps,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One token's Q and K heads: each head RMS-normalised with its weight (Q's or K's) and rounded to the run
    dtype as ``_rms_norm_kernel`` rounds, then rotated as ``_rotary_kernel`` rotates; in place."""
    pos, offs_h, offs_d, mask, base, x1, x2 = _token_heads(
        x_ptr, pos_ptr, x_stride_t, x_stride_h, num_heads, HALF, BLOCK_H, BLOCK_HALF
    )
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)
    is_q = (offs_h < num_q_heads)[:, None]
    d_mask = offs_d < HALF
    q_w1 = tl.load(q_weight_ptr + offs_d, mask=d_mask, other=0.0)[None, :]
    q_w2 = tl.load(q_weight_ptr + HALF + offs_d, mask=d_mask, other=0.0)[None, :]
    k_w1 = tl.load(k_weight_ptr + offs_d, mask=d_mask, other=0.0)[None, :]
    k_w2 = tl.load(k_weight_ptr + HALF + offs_d, mask=d_mask, other=0.0)[None, :]
    a = ((a * rstd[:, None]).to(x1.dtype) * tl.where(is_q, q_w1, k_w1)).to(x1.dtype).to(tl.float32)
    b = ((b * rstd[:, None]).to(x1.dtype) * tl.where(is_q, q_w2, k_w2)).to(x1.dtype).to(tl.float32)
    _rotate_store(base, a, b, cos_sin_ptr, table_stride, pos, offs_d, mask, HALF)


def qk_norm_rotary_in_place(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    num_q_heads: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
) -> None:
    """``x`` (T, Q heads + K heads, head_dim), Q's heads first (a view of a fused QKV output): every head
    RMS-normalised over head_dim (Q's heads by ``q_weight``, K's by ``k_weight``), then rotated, in place. One
    pass over Q and K where ``rms_norm`` on each strided view (a copy each) and a rotary launch each took
    six."""
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens == 0:
        return
    assert x.stride(2) == 1 and cos_sin.is_contiguous() and cos_sin.shape[-1] == head_dim
    assert q_weight.shape == k_weight.shape == (head_dim,)
    half = head_dim // 2
    _qk_norm_rotary_kernel[(num_tokens,)](
        x, positions, cos_sin, q_weight, k_weight, x.stride(0), x.stride(1), cos_sin.stride(0), num_heads,
        num_q_heads, eps, HALF=half, BLOCK_H=next_power_of_2(num_heads),
        BLOCK_HALF=next_power_of_2(half), num_warps=4,
    )  # fmt: skip


@fast_kernel
@triton.jit
def _rotary_store_kv_kernel(
    qk_ptr,
    value_ptr,
    pos_ptr,
    cos_sin_ptr,
    kv_ptr,
    slot_ptr,
    qk_stride_t,
    qk_stride_h,
    value_stride_t,
    table_stride,
    kv_half_stride,
    num_heads,
    num_q_heads,
    k_scale,
    v_scale,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One token: its Q heads rotated in place; its K heads rotated and, with its V row, stored in the token's
    KV slot (none for slot -1). K is rounded to the run dtype before an FP8 cache's scaling, as the rotary
    kernel's output would be when the store reads it."""
    pos, offs_h, offs_d, mask, base, x1, x2 = _token_heads(
        qk_ptr, pos_ptr, qk_stride_t, qk_stride_h, num_heads, HALF, BLOCK_H, BLOCK_HALF
    )
    first, second = _rotated(
        x1.to(tl.float32), x2.to(tl.float32), cos_sin_ptr, table_stride, pos, offs_d, HALF
    )
    first = first.to(x1.dtype)
    second = second.to(x1.dtype)
    is_q = (offs_h < num_q_heads)[:, None]
    tl.store(base, first, mask=mask & is_q)
    tl.store(base + HALF, second, mask=mask & is_q)
    slot = tl.load(slot_ptr + tl.program_id(0)).to(tl.int64)
    if slot >= 0:
        dtype = kv_ptr.dtype.element_ty
        k_dst = kv_ptr + slot * ROW + (offs_h - num_q_heads)[:, None] * (2 * HALF) + offs_d[None, :]
        tl.store(k_dst, kv_cache_value(first, k_scale, KV_FP8, dtype), mask=mask & ~is_q)
        tl.store(k_dst + HALF, kv_cache_value(second, k_scale, KV_FP8, dtype), mask=mask & ~is_q)
        cols = tl.arange(0, BLOCK_ROW)
        v = tl.load(value_ptr + tl.program_id(0).to(tl.int64) * value_stride_t + cols, mask=cols < ROW)
        tl.store(
            kv_ptr + kv_half_stride + slot * ROW + cols,
            kv_cache_value(v, v_scale, KV_FP8, dtype),
            mask=cols < ROW,
        )


def rotary_store_kv(
    qk: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    num_q_heads: int,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """``rotary_in_place`` of Q and K and the paged store of K and V, in one launch where they took two.

    ``qk`` (T, Q heads + K heads, head_dim), Q's heads first (a view of a fused QKV output): Q is rotated in
    place, K is not written back (attention reads it from the cache). ``value`` (T, K heads, head_dim).
    ``kv_cache`` (2, blocks, block_size, K heads, head_dim): token t's K and V go to flat slot
    ``slot_mapping[t]`` (nowhere for -1); an FP8 cache stores K / k_scale and V / v_scale, saturated."""
    num_tokens, num_heads, head_dim = qk.shape
    if num_tokens == 0:
        return
    num_kv_heads = num_heads - num_q_heads
    assert qk.stride(2) == 1 and cos_sin.is_contiguous() and cos_sin.shape[-1] == head_dim
    assert kv_cache.is_contiguous() and tuple(kv_cache.shape[3:]) == (num_kv_heads, head_dim)
    value2 = value.reshape(num_tokens, -1)
    if value2.stride(1) != 1:
        value2 = value2.contiguous()
    row = num_kv_heads * head_dim
    half = head_dim // 2
    _rotary_store_kv_kernel[(num_tokens,)](
        qk, value2, positions, cos_sin, kv_cache, slot_mapping, qk.stride(0), qk.stride(1), value2.stride(0),
        cos_sin.stride(0), kv_cache.stride(0), num_heads, num_q_heads, k_scale, v_scale, HALF=half,
        BLOCK_H=next_power_of_2(num_heads), BLOCK_HALF=next_power_of_2(half), ROW=row,
        BLOCK_ROW=next_power_of_2(row), KV_FP8=kv_cache.dtype in FP8_KV_DTYPES, num_warps=4,
    )  # fmt: skip
