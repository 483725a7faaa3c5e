"""Greedy sampling on CUDA in one launch: the first maximum of each row of float32 logits, and whether the row
holds a NaN.

``torch.argmax`` reduces a row in one thread block: at a batch of one, 128k logits take ~28 µs of an H200, and
the NaN check is a second pass (~16 µs). Here each row is cut into chunks across programs, each chunk stores its
maximum, the first index of it and a NaN flag, and the last program of a row to finish (an arrival counter per
row, ``ops.scratch``) picks the first chunk holding the row's maximum. Ties go to the lowest index, as argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ominix_worker.devices import sm_count
from ominix_worker.ops import cdiv, next_power_of_2
from ominix_worker.ops.launch import fast_kernel
from ominix_worker.ops.scratch import SCRATCH

_TILE = 2048  # logits a program loads at a time
_MIN_CHUNK = 4096  # logits a program covers at least


# vocab and num_chunks are not specialized on (no value of theirs changes the code); stride (one model's row
# length) and chunk (a multiple of _TILE) are, so the compiler can prove the loads aligned.
@fast_kernel
@triton.jit(do_not_specialize=["vocab", "num_chunks"])
def _greedy_kernel(
    logits_ptr,
    part_max_ptr,
    part_idx_ptr,
    part_nan_ptr,
    arrivals_ptr,
    ids_ptr,
    bad_ptr,
    vocab,
    stride,
    chunk,
    num_chunks,
    TILE: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.program_id(1)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, vocab)
    offs = tl.arange(0, TILE)
    best = float("-inf")
    best_idx = lo
    nan = 0
    base = logits_ptr + row.to(tl.int64) * stride
    for start in range(lo, hi, TILE):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < hi, other=float("-inf"))
        is_nan = x != x
        nan = tl.maximum(nan, tl.max(is_nan.to(tl.int32), 0))
        x = tl.where(is_nan, float("-inf"), x)
        tile_max = tl.max(x, 0)
        tile_idx = tl.min(tl.where((x == tile_max) & (idx < hi), idx, vocab), 0)
        # A later tile wins only with a strictly larger value: the first maximum is kept.
        take = tile_max > best
        best_idx = tl.where(take, tile_idx, best_idx)
        best = tl.where(take, tile_max, best)
    part = row * num_chunks + c
    tl.store(part_max_ptr + part, best)
    tl.store(part_idx_ptr + part, best_idx)
    tl.store(part_nan_ptr + part, nan)
    tl.debug_barrier()  # the partials are stored before the arrival is counted (release below)
    arrived = tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == num_chunks - 1:
        cs = tl.arange(0, BLOCK_C)
        c_mask = cs < num_chunks
        first = row * num_chunks
        maxima = tl.load(part_max_ptr + first + cs, mask=c_mask, other=float("-inf"), cache_modifier=".cg")
        indices = tl.load(part_idx_ptr + first + cs, mask=c_mask, other=0, cache_modifier=".cg")
        nans = tl.load(part_nan_ptr + first + cs, mask=c_mask, other=0, cache_modifier=".cg")
        row_max = tl.max(maxima, 0)
        # Chunks are in index order, so the lowest index among the maximal chunks is the first maximum.
        winner = tl.min(tl.where((maxima == row_max) & c_mask, indices, vocab), 0)
        tl.store(ids_ptr + row, winner.to(tl.int64))
        tl.store(bad_ptr + row, (tl.max(nans, 0) > 0).to(tl.int8))
        tl.atomic_xchg(arrivals_ptr + row, 0)  # ready for the next launch


def greedy_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids int64 (B,), bad rows bool (B,)) of float32 ``logits`` (B, V) on CUDA: the first maximum of
    each row, and whether the row holds a NaN (its id is then meaningless)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be 2-D with contiguous rows, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    bad = torch.empty(rows, dtype=torch.int8, device=logits.device)
    if rows == 0:
        return ids, bad.bool()
    # Enough programs to cover the GPU twice, each at least _MIN_CHUNK logits.
    wanted = cdiv(2 * sm_count(logits.device), rows)
    num_chunks = max(1, min(wanted, cdiv(vocab, _MIN_CHUNK)))
    chunk = cdiv(cdiv(vocab, num_chunks), _TILE) * _TILE
    num_chunks = cdiv(vocab, chunk)
    part_max = torch.empty(rows * num_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows * num_chunks, dtype=torch.int32, device=logits.device)
    part_nan = torch.empty(rows * num_chunks, dtype=torch.int32, device=logits.device)
    arrivals = SCRATCH.counters(logits.device, rows)
    # One BLOCK_C per vocabulary (the most chunks a row can have), not per batch size: the kernel compiles once,
    # in the worker's warm-up, never in the middle of serving when a batch first grows.
    block_c = max(16, next_power_of_2(cdiv(vocab, _MIN_CHUNK)))
    _greedy_kernel[(rows, num_chunks)](
        logits, part_max, part_idx, part_nan, arrivals, ids, bad, vocab, logits.stride(0), chunk, num_chunks,
        TILE=_TILE, BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip
    return ids, bad.view(torch.bool)
