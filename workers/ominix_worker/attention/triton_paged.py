"""Paged attention for CUDA in Triton: KV store, split-K decode with GQA grouping, and a paged flash-attention
kernel for prefill / chunked prefill / prefix hits / mixed batches.

Decode path (every request has exactly one query token): grid ``(num_kv_heads, num_requests, num_splits)``, heads
first so that the programs launched together read whole token rows of the cache (a row holds every KV head). One
program owns all ``num_heads // num_kv_heads`` query heads of one KV head, so each K/V element is read from device
memory once per step. Long contexts are cut into ``num_splits`` contiguous ranges (flash-decoding); each split
writes a partial output and its log-sum-exp, and a second kernel merges the splits. The split count depends only
on ``(num_requests, max_seq_len)`` host integers, never on device data, and every split derives its token range
from the request's live ``seq_lens`` entry, so any split count is correct for any length: a CUDA graph captured
for a batch size stays valid for every context length. Capture with the ``max_seq_len`` you expect (or set
``decode_splits``): only speed depends on it (see ``decode_num_splits``). Outside capture, splits serve only
long contexts, because each extra launch costs more host time than it saves on the GPU.

General path: grid ``(num_requests, num_heads, cdiv(max_query_len, BLOCK_M))``. A request's query rows are the
last ``q_len`` positions of its ``seq_len``, so row ``m`` sits at position ``seq_len - q_len + m`` and may see
keys ``0..position``. The last axis counts a request's query tiles from its last (the one that sees the most
keys), so the longest programs are handed out first. Programs whose tile lies past their request's ``q_len``
exit at once, which keeps the grid a function of host integers only (no device-to-host sync). Softmax runs
online in fp32. In a mixed step with host offsets, single-token requests whose contexts are no longer than the
longest prompt-side request's, and too few to fill the GPU on their own, ride in the same launch, one program
per KV head as on the decode path, unsplit.
A step of one request whose query tiles leave most of the GPU idle (a prefix-hit suffix or a last chunk over a
long context, as the captured prefill graphs run it) splits its keys too (``prefill_num_splits``): the head
axis becomes ``split * num_heads + head`` and the decode path's merge kernel combines the partials row by row.

FP8 KV (``--kv-cache-dtype fp8_e4m3``): the cache holds e4m3 values of K / k_scale and V / v_scale (one scale
each per layer, ``KVScales``: the checkpoint's, else 1.0); the store kernel quantizes, the attention kernels
dequantize each tile to the query dtype in registers, so a step reads half the KV bytes of bf16.

Attention sinks (gpt-oss, ``sinks=``): per query head a logit that joins the softmax denominator with no value.
Each online softmax starts from it (running max = the sink, running sum = 1) instead of from -inf / 0; under
split-K only split 0 starts from it, so the merge counts it once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ominix_worker.attention.base import (
    FP8_KV_DTYPES,
    UNIT_KV_SCALES,
    AttentionCall,
    AttentionMetadata,
    KVScales,
    PiecewiseAttention,
)
from ominix_worker.attention.mixed_plan import (
    MixedPlan,
    plan_mixed_step,
    prompt_side_requests,
    warm_up_steps,
)
from ominix_worker.devices import sm_count
from ominix_worker.ops import cdiv, next_power_of_2
from ominix_worker.ops.fused import kv_cache_value
from ominix_worker.ops.launch import fast_kernel

# Tokens per split below which splitting a decode context more finely stops paying for the merge.
_MIN_TOKENS_PER_SPLIT = 64
# Outside graph capture every launch costs host time (about 40 µs through Triton's launcher, measured on an
# H100 host), which a batch-1 step cannot hide: there a split must cover this many tokens to pay for the merge.
_EAGER_MIN_TOKENS_PER_SPLIT = 1024
_MAX_SPLITS = 32
# Keys per split below which a prefill split stops paying for its partial outputs and the merge.
_MIN_TOKENS_PER_PREFILL_SPLIT = 256
# CUDA's limit on a grid's second dimension (the first allows 2**31 - 1): a heads-first decode grid puts the
# requests there, so a step of more requests than this launches requests first.
_MAX_GRID_Y = 65535
# Prefill tile (BLOCK_M, BLOCK_N, num_warps, num_stages) for 16-bit inputs and head_dim <= 128.
PREFILL_CONFIG = (64, 64, 4, 3)


@fast_kernel
@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    kv_ptr,
    slot_ptr,
    key_stride_t,
    value_stride_t,
    kv_half_stride,
    k_scale,
    v_scale,
    ROW: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One program per new token: copy its K and V rows (num_kv_heads * head_dim) into the flat slot; an FP8
    cache stores K / k_scale and V / v_scale, saturated to the e4m3 range."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padded token (e.g. a CUDA-graph filler row): nothing to store
        return
    cols = tl.arange(0, BLOCK_ROW)
    mask = cols < ROW
    k = tl.load(key_ptr + t.to(tl.int64) * key_stride_t + cols, mask=mask)
    v = tl.load(value_ptr + t.to(tl.int64) * value_stride_t + cols, mask=mask)
    dtype = kv_ptr.dtype.element_ty
    dst = kv_ptr + slot * ROW + cols
    tl.store(dst, kv_cache_value(k, k_scale, KV_FP8, dtype), mask=mask)
    tl.store(dst + kv_half_stride, kv_cache_value(v, v_scale, KV_FP8, dtype), mask=mask)


@triton.jit
def _attend_one_token(
    q,
    m_i,
    l_i,
    acc,
    kv_ptr,
    bt_row,
    kvh,
    start,
    end,
    first_key,
    qk_scale,
    kv_half_stride,
    k_scale,
    v_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Online softmax (base 2) of one token's query heads of KV head ``kvh`` (``q``: BLOCK_G × BLOCK_D) over
    the keys in [start, end) of one request's paged KV (``bt_row``: its block-table row); keys before
    ``first_key`` (a window's first) are masked and never loaded. Returns the updated (m_i, l_i, acc)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    row_stride: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = (pos < end) & (pos >= first_key)
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        slot = blk * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_off = slot[:, None] * row_stride + kvh * HEAD_DIM + offs_d[None, :]
        ld_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(kv_ptr + kv_off, mask=ld_mask, other=0.0)
        v = tl.load(kv_ptr + kv_half_stride + kv_off, mask=ld_mask, other=0.0)
        if KV_FP8:  # dequantize to the query dtype before the tensor-core dots
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _attend_decode_row(
    q_ptr,
    kv_ptr,
    bt_row,
    sinks_ptr,
    row,
    seq_len,
    kvh,
    split,
    num_splits,
    window,
    scale,
    q_stride_t,
    q_stride_h,
    kv_half_stride,
    k_scale,
    v_scale,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,
    WINDOWED: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Split ``split`` of ``num_splits`` of one single-token query row (query row ``row``, context ``seq_len``):
    the GROUP query heads of KV head ``kvh`` at once, so each K/V element is read once. Returns the unnormalized
    (m_i, l_i, acc) in base 2, the heads and their mask."""
    # With a window the query (position seq_len - 1) sees keys from seq_len - window on; the splits share the
    # tiles from the one holding that key. Block-table entries before it may be null (-1): never loaded.
    first_key = 0
    if WINDOWED:
        first_key = tl.maximum(seq_len - window, 0)
    lo = (first_key // BLOCK_N) * BLOCK_N
    # Each split covers a whole number of BLOCK_N tiles; trailing splits may be empty.
    tiles = tl.cdiv(seq_len - lo, BLOCK_N)
    tiles_per_split = tl.cdiv(tiles, num_splits)
    start = lo + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(
        q_ptr + row.to(tl.int64) * q_stride_t + heads[:, None] * q_stride_h + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    qk_scale = scale * 1.4426950408889634  # log2(e): the softmax runs in base 2 (exp2)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    if HAS_SINKS:
        # Split 0 starts from the sink: a key of logit ``sink`` (base 2 here) whose value is zero.
        first = (tl.zeros([BLOCK_G], dtype=tl.int32) + split) == 0
        sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(first, sink, m_i)
        l_i = tl.where(first, 1.0, l_i)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i, l_i, acc = _attend_one_token(
        q, m_i, l_i, acc, kv_ptr, bt_row, kvh, start, end, first_key, qk_scale, kv_half_stride, k_scale,
        v_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, IEEE, KV_FP8,
    )  # fmt: skip
    return m_i, l_i, acc, heads, g_mask


@triton.jit
def _store_decode_row(
    out_ptr, row, heads, g_mask, m_i, l_i, acc, out_stride_t, out_stride_h, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Normalize an unsplit decode row's accumulator and store its heads' outputs."""
    offs_d = tl.arange(0, BLOCK_D)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # seq_len 0 (padded request) writes zeros, never NaN
    o = acc / l_safe[:, None]
    tl.store(
        out_ptr + row.to(tl.int64) * out_stride_t + heads[:, None] * out_stride_h + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & (offs_d < HEAD_DIM)[None, :],
    )


# Arguments that change from step to step are not specialised on (Triton compiles a variant per value that is
# 1 or a multiple of 16): a block-table width or split count seen first mid-run would stall that step for the
# compile.
@fast_kernel
@triton.jit(do_not_specialize=["bt_stride", "num_splits"])
def _decode_kernel(
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    sinks_ptr,
    scale,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    bt_stride,
    kv_half_stride,
    num_splits,
    k_scale,
    v_scale,
    window,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    MIXED: tl.constexpr,
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,
    WINDOWED: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
):
    if HEADS_FIRST:
        kvh = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
    split = tl.program_id(2)
    if MIXED:
        # Mixed step: this kernel serves the single-token requests, the prefill kernel the others.
        row = tl.load(query_start_loc_ptr + b)
        if tl.load(query_start_loc_ptr + b + 1) - row != 1:
            return
    else:
        row = b

    m_i, l_i, acc, heads, g_mask = _attend_decode_row(
        q_ptr, kv_ptr, block_tables_ptr + b.to(tl.int64) * bt_stride, sinks_ptr, row, tl.load(seq_lens_ptr + b),
        kvh, split, num_splits, window, scale, q_stride_t, q_stride_h, kv_half_stride, k_scale, v_scale,
        NUM_KV_HEADS, GROUP, BLOCK_G, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, IEEE, KV_FP8, WINDOWED, HAS_SINKS,
    )  # fmt: skip
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    if SPLIT:
        # Partials (B, H, S, D) and lse (B, H, S); an empty split leaves lse = -inf so the merge ignores it.
        row = (b * NUM_HEADS + heads) * num_splits + split
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))  # base 2
        tl.store(
            part_out_ptr + row[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
            o,
            mask=g_mask[:, None] & d_mask[None, :],
        )
        tl.store(part_lse_ptr + row, lse, mask=g_mask)
    else:
        _store_decode_row(
            out_ptr, row, heads, g_mask, m_i, l_i, acc, out_stride_t, out_stride_h, HEAD_DIM, BLOCK_D
        )


@fast_kernel
@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    out_ptr,
    out_stride_t,
    out_stride_h,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    MIXED: tl.constexpr,
    ONE_REQUEST_ROWS: tl.constexpr = False,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    if MIXED:
        row = tl.load(query_start_loc_ptr + b)
        if tl.load(query_start_loc_ptr + b + 1) - row != 1:
            return
    else:
        row = b
    if ONE_REQUEST_ROWS:
        # b is a query row of the only request: rows past its query (graph padding) stay as they are, and a
        # one-token query belongs to the decode kernel, which wrote it already.
        rows_end = tl.load(query_start_loc_ptr + 1)
        if (b >= rows_end) | (rows_end == 1):
            return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    row0 = (b * NUM_HEADS + h) * num_splits
    lse = tl.load(part_lse_ptr + row0 + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    denom = tl.where(denom > 0.0, denom, 1.0)
    o = tl.load(
        part_out_ptr + (row0 + offs_s)[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    res = tl.sum(o * w[:, None], 0) / denom
    tl.store(
        out_ptr + row.to(tl.int64) * out_stride_t + h * out_stride_h + offs_d,
        res.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


@fast_kernel
@triton.jit(do_not_specialize=["bt_stride", "num_splits"])
def _prefill_kernel(
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    sinks_ptr,
    scale,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    bt_stride,
    kv_half_stride,
    k_scale,
    v_scale,
    window,
    num_splits,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DECODE_ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    DECODE_BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,
    WINDOWED: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    # Split-K (SPLIT): axis 1 is split * num_heads + head; each split attends to its own range of whole BLOCK_N
    # key tiles and writes a partial output and its log-sum-exp for _merge_splits_kernel.
    h = tl.program_id(1) % (NUM_KV_HEADS * GROUP)
    split = tl.program_id(1) // (NUM_KV_HEADS * GROUP)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    if q_len == 1:
        # A single-token request: with DECODE_ROWS, program (b, kv head, 0) attends for all GROUP query heads
        # of its KV head (the decode kernel's way, unsplit); otherwise the decode kernel serves it.
        if DECODE_ROWS:  # noqa: SIM102  (a compile-time branch: without it the decode code is not built)
            if (tl.program_id(2) == 0) & (h < NUM_KV_HEADS):
                m_g, l_g, acc_g, heads, g_mask = _attend_decode_row(
                    q_ptr, kv_ptr, block_tables_ptr + b.to(tl.int64) * bt_stride, sinks_ptr, q_start, seq_len,
                    h, 0, 1, window, scale, q_stride_t, q_stride_h, kv_half_stride, k_scale, v_scale,
                    NUM_KV_HEADS, GROUP, BLOCK_G, HEAD_DIM, BLOCK_D, BLOCK_SIZE, DECODE_BLOCK_N, IEEE, KV_FP8,
                    WINDOWED, HAS_SINKS,
                )  # fmt: skip
                _store_decode_row(
                    out_ptr, q_start, heads, g_mask, m_g, l_g, acc_g, out_stride_t, out_stride_h, HEAD_DIM, BLOCK_D
                )  # fmt: skip
        return
    # Axis 2 counts a request's query tiles from its last: the last tile sees the most keys, and the GPU hands
    # out programs in grid order (axis 2 slowest), so the longest programs start first instead of trailing.
    tiles = tl.cdiv(q_len, BLOCK_M)
    if tl.program_id(2) >= tiles:
        return
    tile = tiles - 1 - tl.program_id(2)
    context_len = seq_len - q_len
    kvh = h // GROUP

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * q_stride_t + h * q_stride_h + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    qk_scale = scale * 1.4426950408889634  # log2(e): the softmax runs in base 2 (exp2)
    q_pos = context_len + offs_m  # absolute position of each query row

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:  # every row starts from the head's sink: a key of that logit whose value is zero
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    row_stride: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + b.to(tl.int64) * bt_stride
    # Keys past the tile's last query position are masked for every row, so the loop stops there.
    kv_end = tl.minimum(seq_len, context_len + (tile + 1) * BLOCK_M)
    # Tiles wholly before the tile's first query position need no causal mask.
    full_end = tl.minimum(context_len + tile * BLOCK_M, kv_end)
    full_end = (full_end // BLOCK_N) * BLOCK_N
    masked_start = full_end
    first_key = 0
    if WINDOWED:
        # Every tile is masked, from the one holding the first key the tile's first query sees; block-table
        # entries before it may be null (-1) and are never loaded.
        first_key = tl.maximum(context_len + tile * BLOCK_M - window + 1, 0)
        masked_start = (first_key // BLOCK_N) * BLOCK_N
        full_end = 0
    key_lo = 0
    if SPLIT:  # never with a window or sinks (the host keeps those unsplit)
        tiles_per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), num_splits)
        key_lo = split * tiles_per_split * BLOCK_N
        kv_end = tl.minimum(key_lo + tiles_per_split * BLOCK_N, kv_end)
        full_end = tl.maximum(tl.minimum(full_end, kv_end), key_lo)
        masked_start = full_end
    for n0 in range(key_lo, full_end, BLOCK_N):
        pos = n0 + offs_n
        blk = tl.load(bt_row + pos // BLOCK_SIZE).to(tl.int64)
        slot = blk * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_off = slot[:, None] * row_stride + kvh * HEAD_DIM + offs_d[None, :]
        k = tl.load(kv_ptr + kv_off, mask=d_mask[None, :], other=0.0)
        v = tl.load(kv_ptr + kv_half_stride + kv_off, mask=d_mask[None, :], other=0.0)
        if KV_FP8:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    for n0 in range(masked_start, kv_end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = (pos < kv_end) & (pos >= first_key)
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        slot = blk * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_off = slot[:, None] * row_stride + kvh * HEAD_DIM + offs_d[None, :]
        ld_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(kv_ptr + kv_off, mask=ld_mask, other=0.0)
        v = tl.load(kv_ptr + kv_half_stride + kv_off, mask=ld_mask, other=0.0)
        if KV_FP8:  # dequantize to the query dtype before the tensor-core dots
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if WINDOWED:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        # A row that sees nothing yet keeps a finite max so exp2() never sees inf - inf.
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if SPLIT:
        # Partials (T, H, S, D) and lse (T, H, S) per query row; a split that saw no key leaves lse = -inf.
        part = (q_rows * (NUM_KV_HEADS * GROUP) + h) * num_splits + split
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))  # base 2
        tl.store(
            part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            o,
            mask=m_mask[:, None] & d_mask[None, :],
        )
        tl.store(part_lse_ptr + part, lse, mask=m_mask)
    else:
        tl.store(
            out_ptr + q_rows[:, None] * out_stride_t + h * out_stride_h + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & d_mask[None, :],
        )


def _decode_block_n(head_dim: int, ieee: bool) -> int:
    """Key tile of a single-token row. A tile may straddle cache blocks: every token looks its block up, so
    the tile is free of block_size."""
    return 32 if ieee or head_dim > 128 else 64


def _is_fp8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype in FP8_KV_DTYPES


def decode_num_splits(
    num_requests: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int = 132,
    min_tokens_per_split: int = _MIN_TOKENS_PER_SPLIT,
) -> int:
    """Split count for the decode kernel: enough programs to fill the GPU about twice, never splits shorter
    than ``min_tokens_per_split`` tokens. A pure function of host integers, so a captured graph can fix it."""
    programs = max(1, num_requests * num_kv_heads)
    want = cdiv(2 * num_sms, programs)
    cap = max(1, cdiv(max_seq_len, min_tokens_per_split))
    splits = max(1, min(want, cap, _MAX_SPLITS))
    return next_power_of_2(splits)


def prefill_num_splits(
    programs: int,
    max_seq_len: int,
    num_sms: int = 132,
    min_tokens_per_split: int = _MIN_TOKENS_PER_PREFILL_SPLIT,
) -> int:
    """Split count for the prefill kernel: one request's short query (a prefix-hit suffix, a last chunk) over a
    long context runs only ``programs`` (query tiles × heads) programs, each walking the whole context; splits
    fill the GPU about twice, each at least ``min_tokens_per_split`` keys. 1 when the programs already fill it.
    A pure function of host integers, so a captured graph can fix it."""
    if programs >= num_sms:
        return 1
    want = cdiv(2 * num_sms, max(1, programs))
    cap = max(1, max_seq_len // min_tokens_per_split)
    splits = max(1, min(want, cap, _MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)  # a power of two, never above the cap


def _partials(
    num_rows: int, num_heads: int, splits: int, head_dim: int, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 split partials (rows, heads, splits, head_dim) and their log-sum-exps (rows, heads, splits);
    unsplit, ``out`` stands in for both (the kernels never touch them then)."""
    if splits == 1:
        return out, out
    shape = (num_rows, num_heads, splits)
    return (
        torch.empty((*shape, head_dim), dtype=torch.float32, device=out.device),
        torch.empty(shape, dtype=torch.float32, device=out.device),
    )


def _merge(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor,
    num_rows: int,
    mixed: bool = False,
    one_request_rows: bool = False,
) -> None:
    """Combine split partials (rows, heads, splits, head_dim) into ``out``: rows are requests (decode) or one
    request's query rows (``one_request_rows``)."""
    _, num_heads, splits, head_dim = part_out.shape
    _merge_splits_kernel[(num_rows, num_heads)](
        part_out,
        part_lse,
        meta.query_start_loc,
        out,
        out.stride(0),
        out.stride(1),
        splits,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_S=_MAX_SPLITS,  # one variant for every split count (masked to num_splits)
        MIXED=mixed,
        ONE_REQUEST_ROWS=one_request_rows,
        num_warps=4,
    )


class TritonPagedAttention:
    """Attention backend for CUDA devices (name "triton-paged"); see the module docstring for the grids."""

    name = "triton-paged"
    # The kernels attend within AttentionMetadata.sliding_window (one metadata per KV group, so each layer
    # gets its group's window; tests/gpu/test_triton_sliding_window.py, tests/gpu/test_hybrid_layers_gpu.py).
    supports_sliding_window = True
    supports_sinks = True  # tests/gpu/test_triton_sinks.py

    def __init__(self, block_size: int = 16, store_with_index_copy: bool = False) -> None:
        if block_size & (block_size - 1) or not 16 <= block_size <= 128:
            raise ValueError(f"block_size must be a power of two in [16, 128], got {block_size}")
        self.block_size = block_size
        self.store_with_index_copy = store_with_index_copy
        # The Triton store skips slot -1; the index-copy store (a comparison path) would fail on it.
        self.skips_unset_slots = not store_with_index_copy
        # Its store is the Triton one ``ops.fused.rotary_store_kv`` also performs; the index-copy comparison
        # path keeps its own. Off: the model rotates and calls ``write_kv`` (tests, comparisons).
        self.takes_fused_rotary_store = not store_with_index_copy
        # Fixed split count for CUDA-graph capture; None picks one per call from the metadata.
        self.decode_splits: int | None = None
        # Split count of a single request's prefill (tuning, tests); None picks one (``prefill_num_splits``).
        self.prefill_splits: int | None = None
        # (BLOCK_M, BLOCK_N, num_warps, num_stages) override for the prefill kernel (tuning); None = defaults.
        self.prefill_config: tuple[int, int, int, int] | None = None
        # (BLOCK_N, num_warps, num_stages) override for the decode kernel (tuning); None = defaults.
        self.decode_config: tuple[int, int, int] | None = None
        # The decode grid's program order: the KV heads of one request next to each other (programs launched
        # together then read whole token rows of the cache, which interleaves the heads), or one KV head of
        # every request first (comparisons: 1 - 3% slower at batch 256 on an H200, RESULTS 2026-12-02).
        self.decode_heads_first = True
        # Let a mixed step's single-token requests ride in the prefill kernel's launch (``_mixed_plan``); off
        # keeps them in the decode kernel (tests, comparisons).
        self.decode_rows_in_prefill = True
        # The last plan and what it was worked out from (identities: the KV groups' metadata share the lists).
        self._plan_key: tuple[object, object, int] | None = None
        self._plan: tuple[MixedPlan, int] = (MixedPlan.NONE, 0)  # and the prefill grid's leading requests
        # Set while an eager step's pieces are captured (``PiecewiseAttention``): ``forward`` hands it the call.
        self.cut: AttentionCall | None = None

    def piecewise_attention(self) -> PiecewiseAttention | None:
        """The Triton store skips slot -1; the index-copy store (a comparison path) would fail on it."""
        return None if self.store_with_index_copy else self

    def mixed_warm_up_steps(
        self, num_kv_heads: int, max_tokens: int, device: torch.device
    ) -> list[tuple[int, int, int]]:
        """``mixed_plan.warm_up_steps`` for this GPU and KV-head count: one eager mixed step per kernel variant
        ``_mixed_plan`` can pick."""
        return warm_up_steps(sm_count(device, off_gpu=132) // num_kv_heads, max_tokens)

    def allocate_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> list[torch.Tensor]:
        shape = (2, num_blocks, self.block_size, num_kv_heads, head_dim)
        return [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write_kv(
        self,
        kv_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: AttentionMetadata,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> None:
        num_tokens = key.shape[0]
        if num_tokens == 0:
            return
        if self.store_with_index_copy and not _is_fp8(kv_cache):
            _, nb, bs, kvh, d = kv_cache.shape
            kv_cache[0].view(nb * bs, kvh, d).index_copy_(0, meta.slot_mapping, key)
            kv_cache[1].view(nb * bs, kvh, d).index_copy_(0, meta.slot_mapping, value)
            return
        key2 = key.reshape(num_tokens, -1)
        value2 = value.reshape(num_tokens, -1)
        if key2.stride(1) != 1:
            key2 = key2.contiguous()
        if value2.stride(1) != 1:
            value2 = value2.contiguous()
        row = key2.shape[1]
        _store_kv_kernel[(num_tokens,)](
            key2,
            value2,
            kv_cache,
            meta.slot_mapping,
            key2.stride(0),
            value2.stride(0),
            kv_cache.stride(0),
            kv_scales.k,
            kv_scales.v,
            ROW=row,
            BLOCK_ROW=next_power_of_2(row),
            KV_FP8=_is_fp8(kv_cache),
            num_warps=4,
        )

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales = UNIT_KV_SCALES,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.cut is not None:
            return self.cut(query, kv_cache, meta, scale, kv_scales, sinks)
        out = torch.empty_like(query)
        self.forward_into(query, kv_cache, meta, scale, out, kv_scales, sinks)
        return out

    def forward_into(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        kv_scales: KVScales = UNIT_KV_SCALES,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Like ``forward`` but writes a caller-owned ``out`` (a static buffer under CUDA-graph capture)."""
        if query.shape[0] == 0:
            return
        if sinks is not None and (sinks.shape != (query.shape[1],) or not sinks.is_contiguous()):
            raise ValueError(f"sinks must be contiguous ({query.shape[1]},), got {tuple(sinks.shape)}")
        if meta.num_decode_only:
            self._decode(query, kv_cache, meta, scale, out, kv_scales, mixed=False, sinks=sinks)
            return
        plan, prompt_side = self._mixed_plan(meta, kv_cache.shape[3], sm_count(query.device, off_gpu=132))
        if plan == MixedPlan.DECODE_KERNEL:
            self._decode(query, kv_cache, meta, scale, out, kv_scales, mixed=True, sinks=sinks)
        if meta.max_query_len > 1:
            in_prefill = plan == MixedPlan.IN_PREFILL
            grid_requests = meta.num_requests if in_prefill else prompt_side
            self._prefill(query, kv_cache, meta, scale, out, kv_scales, sinks, in_prefill, grid_requests)

    def _mixed_plan(self, meta: AttentionMetadata, num_kv_heads: int, num_sms: int) -> tuple[MixedPlan, int]:
        """Where a step's single-token requests attend (``mixed_plan.plan_mixed_step``) and how many leading
        requests the prefill grid spans (``mixed_plan.prompt_side_requests``), worked out once per step: its KV
        groups' metadata share the host lists, which are never changed once built."""
        max_rows = num_sms // num_kv_heads if self.decode_rows_in_prefill else 0
        starts = meta.query_start_loc_cpu
        if starts is None or meta.no_single_token_requests:
            return plan_mixed_step(meta, max_rows), meta.num_requests  # no loop over the requests
        key = (starts, meta.seq_lens_cpu, max_rows)
        cached = self._plan_key
        if cached is None or cached[0] is not key[0] or cached[1] is not key[1] or cached[2] != max_rows:
            self._plan_key = key
            self._plan = (plan_mixed_step(meta, max_rows), prompt_side_requests(meta))
        return self._plan

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        kv_scales: KVScales,
        mixed: bool,
        sinks: torch.Tensor | None = None,
    ) -> None:
        num_requests = meta.num_requests
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_heads = query.shape[1]
        group = num_heads // num_kv_heads
        splits = self.decode_splits
        if splits is None:
            capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
            min_tokens = _MIN_TOKENS_PER_SPLIT if capturing else _EAGER_MIN_TOKENS_PER_SPLIT
            splits = decode_num_splits(
                num_requests, num_kv_heads, meta.max_seq_len, sm_count(query.device, off_gpu=132), min_tokens
            )
        block_d = next_power_of_2(head_dim)
        ieee = query.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
        block_n, num_warps, num_stages = self.decode_config or (_decode_block_n(head_dim, ieee), 4, 3)
        part_out, part_lse = _partials(num_requests, num_heads, splits, head_dim, out)
        heads_first = self.decode_heads_first and num_requests <= _MAX_GRID_Y
        grid = (num_kv_heads, num_requests, splits) if heads_first else (num_requests, num_kv_heads, splits)
        _decode_kernel[grid](
            query,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            out,
            part_out,
            part_lse,
            query if sinks is None else sinks,  # any pointer when there are no sinks
            scale,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            meta.block_tables.stride(0),
            kv_cache.stride(0),
            splits,
            kv_scales.k,
            kv_scales.v,
            meta.sliding_window,
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            GROUP=group,
            BLOCK_G=max(16, next_power_of_2(group)),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_SIZE=block_size,
            BLOCK_N=block_n,
            SPLIT=splits > 1,
            MIXED=mixed,
            IEEE=ieee,
            KV_FP8=_is_fp8(kv_cache),
            WINDOWED=meta.sliding_window > 0,
            HAS_SINKS=sinks is not None,
            HEADS_FIRST=heads_first,  # the grid's order: the kernel reads its program ids by it
            num_warps=num_warps,
            num_stages=num_stages,
        )
        if splits > 1:
            _merge(part_out, part_lse, meta, out, num_requests, mixed=mixed)

    def _prefill_config(
        self, meta: AttentionMetadata, head_dim: int, ieee: bool
    ) -> tuple[int, int, int, int]:
        """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the prefill kernel."""
        if self.prefill_config is not None:
            return self.prefill_config
        if ieee or head_dim > 128:
            return (32, 32, 4, 2)
        if meta.max_query_len <= 16:  # short chunks: small query tiles waste less
            return (16, 64, 4, 3)
        return PREFILL_CONFIG

    def _prefill(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        kv_scales: KVScales,
        sinks: torch.Tensor | None = None,
        decode_rows: bool = False,
        grid_requests: int | None = None,
    ) -> None:
        """The prefill kernel over the first ``grid_requests`` requests (all by default); with ``decode_rows``
        the single-token ones among them attend here too."""
        num_requests = meta.num_requests
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_heads = query.shape[1]
        ieee = query.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
        block_m, block_n, num_warps, num_stages = self._prefill_config(meta, head_dim, ieee)
        tiles = cdiv(meta.max_query_len, block_m)
        splits = 1
        if num_requests == 1 and sinks is None and meta.sliding_window == 0:
            # One request's rows, none of them a single-token request's, so every output row is merged.
            capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
            if self.prefill_splits is not None and not 1 <= self.prefill_splits <= _MAX_SPLITS:
                raise ValueError(f"prefill_splits must be in [1, {_MAX_SPLITS}], got {self.prefill_splits}")
            splits = self.prefill_splits or prefill_num_splits(
                tiles * num_heads,
                meta.max_seq_len,
                sm_count(query.device, off_gpu=132),
                _MIN_TOKENS_PER_PREFILL_SPLIT if capturing else _EAGER_MIN_TOKENS_PER_SPLIT,
            )
        part_out, part_lse = _partials(query.shape[0], num_heads, splits, head_dim, out)
        grid = (num_requests if grid_requests is None else grid_requests, num_heads * splits, tiles)
        _prefill_kernel[grid](
            query,
            kv_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            out,
            part_out,
            part_lse,
            query if sinks is None else sinks,  # any pointer when there are no sinks
            scale,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            meta.block_tables.stride(0),
            kv_cache.stride(0),
            kv_scales.k,
            kv_scales.v,
            meta.sliding_window,
            splits,
            NUM_KV_HEADS=num_kv_heads,
            GROUP=num_heads // num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=next_power_of_2(head_dim),
            BLOCK_SIZE=block_size,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            DECODE_ROWS=decode_rows,
            BLOCK_G=max(16, next_power_of_2(num_heads // num_kv_heads)),
            DECODE_BLOCK_N=_decode_block_n(head_dim, ieee),
            IEEE=ieee,
            KV_FP8=_is_fp8(kv_cache),
            WINDOWED=meta.sliding_window > 0,
            HAS_SINKS=sinks is not None,
            SPLIT=splits > 1,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        if splits > 1:
            _merge(part_out, part_lse, meta, out, query.shape[0], one_request_rows=True)
