"""Triton fused mixture-of-experts for CUDA: align tokens by expert, grouped GEMMs, SiLU·mul, weighted sum.

One MoE layer over T tokens routed to k experts each (T·k assignments):

1. ``moe_align`` (one single-program kernel) counts the assignments per expert, pads each expert's share to a
   multiple of BLOCK_M and writes, for every padded slot, the flat assignment id (``t * k + j``) that sits there
   (``T·k`` marks padding) and, for every BLOCK_M tile, its expert. Shapes depend only on T, so nothing waits on
   the host and a CUDA graph can capture the layer.
2. ``_grouped_gemm`` computes every tile against its expert's weights: gate_up = x @ w13[e]ᵀ into one row per
   assignment, then (after SiLU·mul) down = h @ w2[e]ᵀ scaled by the assignment's routing weight.
3. The k weighted rows of each token are summed (``moe_sum``).

``select_experts`` is the router's softmax/sigmoid, top-k and renormalisation in one kernel per layer.

Tiles past the padded total exit at once, so a fixed grid covers every routing. Under expert parallelism an
``expert_map`` turns global expert ids into this rank's (-1 for another rank's expert): align leaves those
assignments out, so no tile computes them and their rows of the weighted sum stay zero. FP8 weights (e4m3 with block
scales, see ``ominix_worker.quant.fp8``) run W8A8: activations are quantized per token and K group on the fly.
With block scales the tile accumulates ``dot(a, b) · a_scale · b_scale`` per K block; with per-channel scales
(one per weight row, ``--quantization fp8``) each activation row gets one scale too, so the tile accumulates the
raw products in place and scales once at the end (on an H200 one Qwen3-30B-A3B layer at 256 tokens went from
245 to 225 µs, at 1,024 from 356 to 288).

Tile shapes come from a tuned table per (E, N, K, dtype, device) when one is stored in ``moe_configs/`` (written
by ``bench/tune_moe.py``), else from the table of a card with the same SMs (``SM_TWINS``), otherwise from a size
heuristic.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from ominix_worker.ops import cdiv, next_power_of_2
from ominix_worker.ops.fused import silu_and_mul, silu_times

CONFIG_DIR = Path(__file__).resolve().parent / "moe_configs"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


# ---- routing ---------------------------------------------------------------------------------------------


@triton.jit
def _select_experts_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    stride_l,
    num_experts,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SOFTMAX: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    # One program per token: scores, k rounds of max-and-remove, optional renormalisation, all in registers.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < num_experts
    x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=-float("inf")).to(tl.float32)
    if SOFTMAX:
        p = tl.exp(x - tl.max(x, 0))
        p = tl.where(mask, p, 0.0)
        scores = p / tl.sum(p, 0)
    else:
        scores = tl.where(mask, tl.sigmoid(x), -1.0)  # sigmoid scores lie in (0, 1): -1 marks padding
    slots = tl.arange(0, K_PAD)
    top_w = tl.zeros((K_PAD,), dtype=tl.float32)
    top_i = tl.zeros((K_PAD,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(scores, 0)
        # Lowest index among equal scores, so the choice is deterministic.
        index = tl.min(tl.where(scores == best, offs, BLOCK_E), 0)
        # NaN scores match nothing: the index would point past the experts, and align would count it out of
        # bounds. Any valid expert will do (the weight is NaN already); slot j's is the cheapest.
        index = tl.where(index < num_experts, index, j)
        top_w = tl.where(slots == j, best, top_w)
        top_i = tl.where(slots == j, index, top_i)
        scores = tl.where(offs == index, -2.0, scores)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 0)
    keep = slots < TOP_K
    tl.store(weights_ptr + row * TOP_K + slots, top_w, mask=keep)
    tl.store(ids_ptr + row * TOP_K + slots, top_i, mask=keep)


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_ref.select_experts`` in one kernel: (T, E) logits → weights (T, k) float32, ids (T, k) int32.

    The reference spends seven small kernels on this (float cast, softmax, top-k gather and sort, id cast, sum,
    divide); at decode batch sizes each costs a few microseconds per layer."""
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"unsupported MoE scoring function {scoring_func!r} (softmax, sigmoid)")
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        block_e = next_power_of_2(num_experts)
        _select_experts_kernel[(num_tokens,)](
            router_logits, weights, ids, router_logits.stride(0), num_experts, TOP_K=top_k,
            K_PAD=next_power_of_2(top_k), BLOCK_E=block_e, SOFTMAX=scoring_func == "softmax",
            RENORMALIZE=renormalize, num_warps=1 if block_e <= 256 else 4,
        )  # fmt: skip
    return weights, ids


# ---- weighted sum ----------------------------------------------------------------------------------------


@triton.jit
def _moe_sum_kernel(rows_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + (token * TOP_K + j) * H + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum(rows: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """(T·k, H) contiguous weighted expert outputs → (T, H), summed in float32 (torch's reduction kernel is
    tuned for long rows and costs ~5 µs at decode sizes)."""
    hidden = rows.shape[1]
    out = torch.empty((num_tokens, hidden), dtype=rows.dtype, device=rows.device)
    block = 1024 if hidden >= 1024 else next_power_of_2(hidden)
    _moe_sum_kernel[(num_tokens, cdiv(hidden, block))](rows, out, hidden, TOP_K=top_k, BLOCK=block)
    return out


# ---- align -----------------------------------------------------------------------------------------------


# The single-program align walks every assignment itself: ~27 µs per layer at 2,048 assignments (decode batch
# 256, top-8) and far more for a prefill chunk. Above this many assignments the same three phases run as three
# kernels: count (many programs, global atomics), scan (one program over the experts) and scatter (many).
PARALLEL_ALIGN_MIN_ASSIGNMENTS = 512


@triton.jit
def _count_assignments(topk_ids_ptr, counts_ptr, ranks_ptr, offs, num_assignments, CHUNK: tl.constexpr):
    # Each assignment's rank inside its expert is the counter's value before its own increment. Negative
    # ids (experts of other ranks) are neither counted nor placed.
    mask = offs < num_assignments
    expert = tl.load(topk_ids_ptr + offs, mask=mask, other=0)
    mask = mask & (expert >= 0)
    rank = tl.atomic_add(counts_ptr + expert, tl.full((CHUNK,), 1, dtype=tl.int32), mask=mask)
    tl.store(ranks_ptr + offs, rank, mask=mask)


@triton.jit
def _scan_experts(
    counts_ptr,
    expert_ids_ptr,
    num_post_pad_ptr,
    max_blocks,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # Pads each expert's count to BLOCK_M, stores the padded total, turns the counts into each expert's start
    # and writes every tile's expert.
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < NUM_EXPERTS
    counts = tl.load(counts_ptr + offs_e, mask=e_mask, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    tl.store(num_post_pad_ptr, total)
    tl.debug_barrier()
    tl.store(counts_ptr + offs_e, ends - padded, mask=e_mask)
    # Tile b belongs to the expert whose padded range holds row b * BLOCK_M: the number of experts ending
    # at or before that row. Tiles past the total get -1.
    for start in range(0, max_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        row = blocks * BLOCK_M
        before = (ends[None, :] <= row[:, None]) & e_mask[None, :]
        expert = tl.sum(before.to(tl.int32), 1)
        expert = tl.where(row < total, expert, -1)
        tl.store(expert_ids_ptr + blocks, expert, mask=blocks < max_blocks)


@triton.jit
def _place_assignments(topk_ids_ptr, sorted_ids_ptr, starts_ptr, ranks_ptr, offs, num_assignments):
    mask = offs < num_assignments
    expert = tl.load(topk_ids_ptr + offs, mask=mask, other=0)
    mask = mask & (expert >= 0)
    rank = tl.load(ranks_ptr + offs, mask=mask, other=0)
    base = tl.load(starts_ptr + expert, mask=mask, other=0)
    tl.store(sorted_ids_ptr + base + rank, offs, mask=mask)


# Kernels take the step's assignment counts unspecialised (Triton compiles a variant per value that is 1 or a
# multiple of 16): a count seen first mid-run would stall that step for the compile.
@triton.jit(do_not_specialize=["num_assignments", "max_padded", "max_blocks"])
def _moe_align_kernel(
    topk_ids_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_pad_ptr,
    scratch_ptr,
    ranks_ptr,
    num_assignments,
    max_padded,
    max_blocks,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    offs_e = tl.arange(0, BLOCK_E)
    tl.store(scratch_ptr + offs_e, tl.zeros((BLOCK_E,), dtype=tl.int32), mask=offs_e < NUM_EXPERTS)
    for start in range(0, max_padded, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        fill = tl.full((CHUNK,), 0, dtype=tl.int32) + num_assignments
        tl.store(sorted_ids_ptr + offs, fill, mask=offs < max_padded)
    tl.debug_barrier()
    for start in range(0, num_assignments, CHUNK):
        _count_assignments(
            topk_ids_ptr, scratch_ptr, ranks_ptr, start + tl.arange(0, CHUNK), num_assignments, CHUNK
        )
    tl.debug_barrier()
    _scan_experts(
        scratch_ptr, expert_ids_ptr, num_post_pad_ptr, max_blocks, NUM_EXPERTS, BLOCK_E, BLOCK_M, CHUNK
    )
    tl.debug_barrier()
    for start in range(0, num_assignments, CHUNK):
        _place_assignments(
            topk_ids_ptr, sorted_ids_ptr, scratch_ptr, ranks_ptr, start + tl.arange(0, CHUNK), num_assignments
        )


@triton.jit(do_not_specialize=["num_assignments", "max_padded"])
def _align_count_kernel(
    topk_ids_ptr, sorted_ids_ptr, counts_ptr, ranks_ptr, num_assignments, max_padded, CHUNK: tl.constexpr
):
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    fill = tl.full((CHUNK,), 0, dtype=tl.int32) + num_assignments
    tl.store(sorted_ids_ptr + offs, fill, mask=offs < max_padded)
    _count_assignments(topk_ids_ptr, counts_ptr, ranks_ptr, offs, num_assignments, CHUNK)


@triton.jit(do_not_specialize=["max_blocks"])
def _align_scan_kernel(
    counts_ptr,
    expert_ids_ptr,
    num_post_pad_ptr,
    max_blocks,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    _scan_experts(
        counts_ptr, expert_ids_ptr, num_post_pad_ptr, max_blocks, NUM_EXPERTS, BLOCK_E, BLOCK_M, CHUNK
    )


@triton.jit(do_not_specialize=["num_assignments"])
def _align_scatter_kernel(
    topk_ids_ptr, sorted_ids_ptr, starts_ptr, ranks_ptr, num_assignments, CHUNK: tl.constexpr
):
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    _place_assignments(topk_ids_ptr, sorted_ids_ptr, starts_ptr, ranks_ptr, offs, num_assignments)


def max_padded_slots(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded total: at most min(assignments, experts) experts are used, each padded by
    fewer than BLOCK_M rows."""
    return num_assignments + min(num_assignments, num_experts) * (block_m - 1)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(T, k) expert ids → (sorted assignment ids (P,), expert of each BLOCK_M tile (P / BLOCK_M,), padded
    total (1,)), all int32 on the device; P = ``max_padded_slots``."""
    num_assignments = topk_ids.numel()
    max_padded = max_padded_slots(num_assignments, num_experts, block_m)
    max_blocks = cdiv(max_padded, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_post_pad = torch.empty(1, dtype=torch.int32, device=device)
    scratch = torch.empty(num_experts, dtype=torch.int32, device=device)
    ranks = torch.empty(max(num_assignments, 1), dtype=torch.int32, device=device)
    flat_ids = topk_ids.reshape(-1)
    block_e = next_power_of_2(num_experts)
    scan_chunk = 256 if num_experts <= 64 else 128
    if num_assignments < PARALLEL_ALIGN_MIN_ASSIGNMENTS:
        _moe_align_kernel[(1,)](
            flat_ids, sorted_ids, expert_ids, num_post_pad, scratch, ranks, num_assignments, max_padded,
            max_blocks, NUM_EXPERTS=num_experts, BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=scan_chunk, num_warps=4,
        )  # fmt: skip
        return sorted_ids, expert_ids, num_post_pad
    chunk = 1024
    scratch.zero_()
    _align_count_kernel[(cdiv(max_padded, chunk),)](
        flat_ids, sorted_ids, scratch, ranks, num_assignments, max_padded, CHUNK=chunk, num_warps=4
    )
    _align_scan_kernel[(1,)](
        scratch, expert_ids, num_post_pad, max_blocks, NUM_EXPERTS=num_experts, BLOCK_E=block_e,
        BLOCK_M=block_m, CHUNK=scan_chunk, num_warps=4,
    )  # fmt: skip
    _align_scatter_kernel[(cdiv(num_assignments, chunk),)](
        flat_ids, sorted_ids, scratch, ranks, num_assignments, CHUNK=chunk, num_warps=4
    )
    return sorted_ids, expert_ids, num_post_pad


# ---- grouped GEMM ----------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_assignments"])
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    a_scale_ptr,
    b_scale_ptr,
    topk_weights_ptr,
    bias_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_pad_ptr,
    N,
    K,
    num_assignments,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_asm,
    stride_bse,
    stride_bsn,
    stride_bsk,
    stride_bias,
    A_ROWS_PER_TOKEN: tl.constexpr,  # k when A holds one row per token (gate_up), 1 when one per assignment
    MUL_ROUTING_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,  # adds the expert's bias row before the routing weight: w · (x Wᵀ + b)
    USE_FP8: tl.constexpr,
    ROW_SCALES: tl.constexpr,  # with USE_FP8: one scale per A row and per B row over all of K, applied once
    IEEE: tl.constexpr,  # float32 operands multiplied in full float32 rather than TF32
    GROUP_N: tl.constexpr,  # weight scale block (rows, columns) when USE_FP8
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_tiles_m = tl.cdiv(tl.load(num_post_pad_ptr), BLOCK_M)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row tiles share each column tile's weights while they are in L2.
    per_group = GROUP_M * num_tiles_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_size = min(tl.num_programs(0) // num_tiles_n - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    if pid_m >= num_tiles_m:
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(sorted_ids_ptr + offs_m)
    row_mask = assignment < num_assignments
    a_row = (assignment // A_ROWS_PER_TOKEN).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    b_ptrs = (
        b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    )
    b_scale_ptrs = (
        b_scale_ptr + expert * stride_bse + (offs_n // GROUP_N) * stride_bsn
    )  # this tile's scale rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if ROW_SCALES:
            acc = tl.dot(a, b, acc)
        elif USE_FP8:
            a_s = tl.load(a_scale_ptr + a_row * stride_asm + k0 // BLOCK_K, mask=row_mask, other=0.0)
            b_s = tl.load(b_scale_ptrs + (k0 // GROUP_K) * stride_bsk, mask=n_mask, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        elif IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if ROW_SCALES:  # the scales are constant along K: the loop accumulated raw products in place
        a_s = tl.load(a_scale_ptr + a_row * stride_asm, mask=row_mask, other=0.0)
        b_s = tl.load(b_scale_ptrs, mask=n_mask, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_bias + offs_n, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_ROUTING_WEIGHT:
        weight = tl.load(topk_weights_ptr + assignment, mask=row_mask, other=0.0)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + assignment[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


# ---- FP8 activations -------------------------------------------------------------------------------------


def per_row_scales(block: tuple[int, int], k: int) -> bool:
    """Whether weight scale blocks ``block`` (rows, columns) give each weight row one scale over all of its ``k``
    columns: per-channel, per-tensor stored per channel, or a tensor-parallel shard of either."""
    return block[0] == 1 and block[1] >= k


@triton.jit
def _quant_fp8_group_kernel(
    x_ptr, q_ptr, s_ptr, stride_x, stride_q, K, GROUP: tl.constexpr, FP8_MAX: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-10) / FP8_MAX
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * tl.cdiv(K, GROUP) + group, scale)


def quant_fp8_per_token_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) → e4m3 values (M, K) and float32 scales (M, ceil(K / group)): x ≈ q · scale per group of a
    power-of-two width; ``group`` ≥ K is one scale per row (``quant_fp8_per_token``, any K)."""
    m, k = x.shape
    if group >= k:
        return quant_fp8_per_token(x)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, cdiv(k, group)), dtype=torch.float32, device=x.device)
    if m:
        _quant_fp8_group_kernel[(m, cdiv(k, group))](
            x, q, s, x.stride(0), q.stride(0), k, GROUP=group, FP8_MAX=FP8_MAX, num_warps=1
        )
    return q, s


@triton.jit
def _quant_fp8_row_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_x,
    stride_q,
    FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,  # BLOCK >= K: the row stays in registers between its max and its quantization
):
    """Row ``program_id``: scale = max|x| / FP8_MAX, q = x / scale in e4m3."""
    row = tl.program_id(0).to(tl.int64)
    if ONE_PASS:
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        _quantize_row(x, q_ptr + row * stride_q + offs, s_ptr + row, offs < K, FP8_MAX)
    else:  # two passes over the row: its max, then its quantization
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = _row_scale(amax, FP8_MAX)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
            _store_e4m3(x, scale, q_ptr + row * stride_q + offs, offs < K, FP8_MAX)
        tl.store(s_ptr + row, scale)


@triton.jit
def _row_scale(abs_max, FP8_MAX: tl.constexpr):
    """max(``abs_max``) / FP8_MAX, kept off zero: the row's scale."""
    return tl.maximum(tl.max(abs_max, 0), 1e-10) / FP8_MAX


@triton.jit
def _store_e4m3(y, scale, q_ptrs, mask, FP8_MAX: tl.constexpr):
    q = tl.clamp(y / scale, -FP8_MAX, FP8_MAX)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_row(y, q_ptrs, s_ptr, mask, FP8_MAX: tl.constexpr):
    """One row held in registers (float32, zero where ``mask`` is off): its e4m3 values y / scale to ``q_ptrs``
    and its scale max|y| / FP8_MAX to ``s_ptr``."""
    scale = _row_scale(tl.abs(y), FP8_MAX)
    _store_e4m3(y, scale, q_ptrs, mask, FP8_MAX)
    tl.store(s_ptr, scale)


# Rows up to this width are read once (held in registers, at most 32 values a thread with 16 warps) rather than
# twice: the activations of a prefill step's FP8 GEMMs are read from memory once instead of twice.
ONE_PASS_MAX_K = 16384


def _one_pass_warps(block: int) -> int:
    """Warps for a row of ``block`` values held in registers: 4 up to 2,048, then one per 512, at most 16."""
    return min(16, max(4, block // 512))


def quant_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) → e4m3 values (M, K) and float32 scales (M, 1), x ≈ q · scale per row, in one launch."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if not m:
        return q, s
    one_pass = k <= ONE_PASS_MAX_K
    block = next_power_of_2(k) if one_pass else 1024
    warps = _one_pass_warps(block) if one_pass else 4
    _quant_fp8_row_kernel[(m,)](
        x, q, s, k, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX, BLOCK=block, ONE_PASS=one_pass, num_warps=warps
    )  # fmt: skip
    return q, s


@triton.jit
def _silu_and_mul_quant_fp8_kernel(
    x_ptr, q_ptr, s_ptr, N, stride_x, stride_q, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr
):
    """Row ``program_id`` of [gate | up]: y = silu(gate) · up as ``silu_and_mul`` rounds it, then y's e4m3
    values and per-row scale as ``_quant_fp8_row_kernel`` computes them; y never leaves registers."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0)
    y = silu_times(gate, up).to(tl.float32)
    _quantize_row(y, q_ptr + row * stride_q + offs, s_ptr + row, mask, FP8_MAX)


def silu_and_mul_quant_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant_fp8_per_token(silu_and_mul(gate_up))``, the same bits, in one launch when a row fits in
    registers: the product is neither written out nor read back (a gated MLP's FP8 down projection input)."""
    m, width = gate_up.shape
    n = width // 2
    if n > ONE_PASS_MAX_K:
        return quant_fp8_per_token(silu_and_mul(gate_up))
    q = torch.empty((m, n), dtype=FP8_DTYPE, device=gate_up.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=gate_up.device)
    if m:
        block = next_power_of_2(n)
        _silu_and_mul_quant_fp8_kernel[(m,)](
            gate_up, q, s, n, gate_up.stride(0), q.stride(0), FP8_MAX=FP8_MAX, BLOCK=block,
            num_warps=_one_pass_warps(block),
        )  # fmt: skip
    return q, s


# ---- configs ---------------------------------------------------------------------------------------------


@functools.cache
def _card_name(index: int) -> str:
    return torch.cuda.get_device_name(index).replace(" ", "_")


def _device_name() -> str:
    """The current card as the tables name it. Looked up once per card: every MoE layer of an eager step picks
    its config, and torch reads the device's properties on each ``get_device_name`` (this function took 1.7 ms
    of a 48-layer Qwen3-30B-A3B-shaped step's launch under cProfile, 1.1 ms of it reading the properties; H200,
    2026-11-29)."""
    return _card_name(torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"


def config_file_name(num_experts: int, n: int, k: int, dtype: str, device: str | None = None) -> str:
    """``E=128,N=1536,K=2048,dtype=bf16,device=NVIDIA_H100_80GB_HBM3.json``: one table per MoE layer shape,
    named by its gate_up GEMM (N = 2 × moe_intermediate, K = hidden); both GEMMs use the entry (they walk the
    same aligned tiles)."""
    return f"E={num_experts},N={n},K={k},dtype={dtype},device={device or _device_name()}.json"


@functools.cache
def _stored_table(name: str) -> dict[int, dict[str, int]] | None:
    path = CONFIG_DIR / name
    if not path.is_file():
        return None
    return {int(m): cfg for m, cfg in json.loads(path.read_text()).items()}


def default_config(num_tokens: int, use_fp8: bool) -> dict[str, int]:
    """Tile shape without a tuned table: small M tiles for decode (few rows per expert), larger for prefill."""
    if use_fp8:  # one K block per weight scale block
        block_m = 16 if num_tokens <= 64 else 64
        return dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128, GROUP_M=1 if num_tokens <= 64 else 8,
                    num_warps=4, num_stages=3)  # fmt: skip
    if num_tokens <= 32:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    if num_tokens <= 512:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


# Cards built from the same streaming multiprocessors (132 sm_90 SMs, the same shared memory and clocks within a
# few percent) with other memory: a table tuned on one is the best guess on the other, where the untuned
# defaults are far off at prefill sizes (64 × 128 tiles where the tuned tables take 128 × 256).
SM_TWINS: dict[str, tuple[str, ...]] = {
    "NVIDIA_H200": ("NVIDIA_H100_80GB_HBM3",),
    "NVIDIA_H100_80GB_HBM3": ("NVIDIA_H200",),
}


def stored_table(
    num_experts: int, n: int, k: int, dtype: str, device: str | None = None
) -> dict[int, dict[str, int]] | None:
    """The tuned table of this shape for ``device`` (this card by default), else for one of its SM twins."""
    name = device or _device_name()
    for candidate in (name, *SM_TWINS.get(name, ())):
        table = _stored_table(config_file_name(num_experts, n, k, dtype, candidate))
        if table:
            return table
    return None


def pick_config(num_experts: int, n: int, k: int, num_tokens: int, use_fp8: bool) -> dict[str, int]:
    """The tuned entry for the nearest stored token count (this card's table, else a twin's), else
    ``default_config``."""
    table = stored_table(num_experts, n, k, "fp8" if use_fp8 else "bf16")
    if not table:
        return default_config(num_tokens, use_fp8)
    nearest = min(table, key=lambda m: abs(m - num_tokens))
    return dict(table[nearest])


# ---- entry points ----------------------------------------------------------------------------------------


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_post_pad: torch.Tensor,
    num_assignments: int,
    a_rows_per_token: int,
    config: dict[str, int],
    topk_weights: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,
    a_row_scales: torch.Tensor | None = None,
) -> None:
    """out[assignment] = (a[assignment // a_rows_per_token] @ b[expert]ᵀ + bias[expert]) (× routing weight),
    for every tile; ``bias`` (E, N) is optional. ``a_row_scales`` (rows, 1): ``a`` is already e4m3 with one
    scale per row (per-channel weights only)."""
    n, k = b.shape[1], b.shape[2]
    use_fp8 = b_scale is not None
    # Weight scales that span whole rows (per-channel) pair with one activation scale per row: the tile then
    # accumulates raw products in place and scales once, as an unscaled GEMM does.
    row_scales = use_fp8 and per_row_scales(scale_block, k)
    if a_row_scales is not None and not row_scales:
        raise ValueError("pre-quantized activations need per-channel FP8 weights")
    a_scale = a
    if a_row_scales is not None:
        a_scale = a_row_scales
    elif use_fp8:
        a, a_scale = quant_fp8_per_token(a) if row_scales else quant_fp8_per_token_group(a, config["BLOCK_K"])
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    grid = (expert_ids.numel() * cdiv(n, block_n),)
    bs = b_scale if b_scale is not None else b
    # float32 follows torch's TF32 switch, so float32 references compare against full-precision products.
    ieee = a.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    _grouped_gemm_kernel[grid](
        a, b, out, a_scale, bs, topk_weights if topk_weights is not None else out,
        bias if bias is not None else out, sorted_ids, expert_ids, num_post_pad, n, k, num_assignments,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0), a_scale.stride(0), bs.stride(0),
        bs.stride(1), bs.stride(2) if bs.dim() == 3 else 0, bias.stride(0) if bias is not None else 0,
        A_ROWS_PER_TOKEN=a_rows_per_token, MUL_ROUTING_WEIGHT=topk_weights is not None,
        HAS_BIAS=bias is not None, USE_FP8=use_fp8, ROW_SCALES=row_scales, IEEE=ieee,
        GROUP_N=scale_block[0], GROUP_K=scale_block[1], BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=config["BLOCK_K"], GROUP_M=config["GROUP_M"], num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )  # fmt: skip


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_block: tuple[int, int] = (128, 128),
    w2_block: tuple[int, int] = (128, 128),
    config: dict[str, Any] | None = None,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_k topk_weights[t, k] · w2[e]ᵀ(silu(gate) · up) with [gate | up] = w13[e] x_t and e = topk_ids[t, k].

    ``x`` (T, H); ``w13`` (E, 2I, H); ``w2`` (E, H, I); fp8 weights come with float32 scales
    (E, ceil(rows / block rows), ceil(columns / block columns)) for blocks ``w13_block`` and ``w2_block``
    (per-channel: (1, columns)). The K tile must divide the scale block's columns.

    ``expert_map`` (E_global,) int32, expert parallelism: ``topk_ids`` are global ids, ``w13``/``w2`` hold this
    rank's experts, and the map gives each global id its local index or -1; assignments to -1 add nothing.
    The lookup is a device gather, so the call stays free of host syncs.
    """
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    use_fp8 = w13_scale is not None
    cfg = dict(config or pick_config(num_experts, two_i, hidden, num_tokens, use_fp8))
    if use_fp8:  # a K tile never straddles two weight scale blocks
        while cfg["BLOCK_K"] > 32 and (w13_block[1] % cfg["BLOCK_K"] or w2_block[1] % cfg["BLOCK_K"]):
            cfg["BLOCK_K"] //= 2
    if expert_map is not None:
        topk_ids = expert_map[topk_ids.long()]
    sorted_ids, expert_ids, num_post_pad = moe_align(topk_ids, num_experts, cfg["BLOCK_M"])
    num_assignments = num_tokens * top_k
    gate_up = torch.empty((num_assignments, two_i), dtype=x.dtype, device=x.device)
    grouped_gemm(
        x, w13, gate_up, sorted_ids, expert_ids, num_post_pad, num_assignments, top_k, cfg,
        b_scale=w13_scale, scale_block=w13_block,
    )  # fmt: skip
    # Rows of skipped assignments hold whatever gate_up held (never written); the down GEMM never reads them.
    # Per-channel FP8 experts take the product in e4m3 straight from the kernel that computes it.
    hidden_scales = None
    if use_fp8 and per_row_scales(w2_block, w2.shape[2]):
        hidden_act, hidden_scales = silu_and_mul_quant_fp8(gate_up)
    else:
        hidden_act = silu_and_mul(gate_up)
    # Rows of skipped assignments (another rank's experts) are never written: they must read as zero.
    alloc = torch.zeros if expert_map is not None else torch.empty
    down = alloc((num_assignments, hidden), dtype=x.dtype, device=x.device)
    grouped_gemm(
        hidden_act, w2, down, sorted_ids, expert_ids, num_post_pad, num_assignments, 1, cfg,
        topk_weights=topk_weights.reshape(-1).float(), b_scale=w2_scale, scale_block=w2_block,
        a_row_scales=hidden_scales,
    )  # fmt: skip
    return moe_sum(down, num_tokens, top_k)
