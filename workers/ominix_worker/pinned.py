"""Pinned host memory for the steps' copies, allocated once at start.

Every step stages its inputs (token ids, positions, slots, block tables, sampling parameters) in pinned host
memory for asynchronous copies to the device, and its sampled ids come back through a pinned buffer. torch's
caching host allocator rounds each request up to a power of two and keeps freed blocks per size; a size with
no free block calls the driver for page-locked memory, which CUDA documents as an implicit synchronization:
the host can wait there while the device works through what is queued. In a serving worker that would be the
first step of each new size, with two or three steps queued before it (every fresh H200 service had one step
whose input preparation took 47 - 98 ms, bench/RESULTS.md, 2026-11-30; ``bench/pinned_first_alloc.py``
measures the wait). ``warm_pinned_memory`` allocates enough blocks of every size a step can use and frees them
into the cache, so serving finds them there. Not covered: the (row, id) indices of repetition penalties and
``min_tokens``, as long as the rows' prompts and outputs together, whose steps may still allocate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ominix_worker.ops import cdiv
from ominix_worker.runner import BLOCK_TABLE_ALIGN

# Live blocks of one size a serving worker may hold at once: a step stages about a dozen tensors (most of them
# small, several of one size), a block is reusable only once its copy has run, and up to three steps are in
# flight. Larger sizes (token-sized tensors, and a block table and slot mapping per KV group) need fewer, per
# KV group.
SMALL_BLOCKS = 48
SMALL_MAX_BYTES = 64 * 1024
LARGE_BLOCKS = 12
# Past this, this many blocks of a size per KV group: a long context's block tables are rare, and each block
# stays pinned for good.
HUGE_BYTES = 1024 * 1024
HUGE_BLOCKS = 2
# No size past this is warmed: block tables that large (256 requests at over 250K tokens each) would pin
# hundreds of MiB for steps that seldom come; such a step allocates at its first use.
WARM_MAX_BYTES = 16 * 1024 * 1024


def pinned_size_classes(max_bytes: int, kv_groups: int = 1) -> list[tuple[int, int]]:
    """(bytes, blocks) for every power-of-two size up to the one that holds ``max_bytes``, at most
    ``WARM_MAX_BYTES``."""
    classes: list[tuple[int, int]] = []
    size = 1
    while True:
        if size <= SMALL_MAX_BYTES:
            blocks = SMALL_BLOCKS
        elif size <= HUGE_BYTES:
            blocks = LARGE_BLOCKS * kv_groups
        else:
            blocks = HUGE_BLOCKS * kv_groups
        classes.append((size, blocks))
        if size >= min(max_bytes, WARM_MAX_BYTES):
            return classes
        size *= 2


def _pinned_bytes(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)


def warm_pinned_memory(
    max_bytes: int, kv_groups: int = 1, allocate: Callable[[int], torch.Tensor] = _pinned_bytes
) -> int:
    """Allocate every class of ``pinned_size_classes(max_bytes, kv_groups)`` at once, then free it all into
    the caching allocator; returns the bytes now cached. CUDA, at start, after the graphs' own pinned buffers
    (which would otherwise keep some of these blocks for good)."""
    held = [
        allocate(size) for size, blocks in pinned_size_classes(max_bytes, kv_groups) for _ in range(blocks)
    ]
    total = sum(t.numel() * t.element_size() for t in held)
    held.clear()
    return total


def step_host_bytes(max_batch_tokens: int, max_running: int, max_model_len: int, block_size: int) -> int:
    """The largest pinned tensor a step stages (penalty indices aside): a token-sized int64 tensor (ids,
    positions, slots) or the int32 block table of every running request at the longest context, whichever is
    larger."""
    width = (
        cdiv(cdiv(max_model_len, block_size), BLOCK_TABLE_ALIGN) * BLOCK_TABLE_ALIGN
    )  # as the runner aligns it
    return max(max_batch_tokens * 8, max_running * width * 4)
