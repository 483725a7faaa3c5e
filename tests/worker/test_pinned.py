"""The pinned host memory a CUDA worker allocates at start for its steps' copies (``pinned.py``): the size
classes, how many blocks of each, and that they are all held at once before they are freed into the cache (a
block freed before the next is allocated would be handed out again and grow nothing). The allocator stands in
for pinned memory here; tests/gpu/test_pinned_gpu.py checks on a device that serving then allocates none."""

from __future__ import annotations

import weakref

import torch

from ominix_worker.pinned import (
    HUGE_BLOCKS,
    LARGE_BLOCKS,
    SMALL_BLOCKS,
    WARM_MAX_BYTES,
    pinned_size_classes,
    step_host_bytes,
    warm_pinned_memory,
)


def test_classes_are_every_power_of_two_up_to_the_largest_tensor() -> None:
    classes = pinned_size_classes(3 * 2**20)
    sizes = [size for size, _ in classes]
    assert sizes == [2**k for k in range(23)]  # 4 MiB holds 3 MiB
    counts = dict(classes)
    assert counts[1] == counts[64 * 1024] == SMALL_BLOCKS
    assert counts[128 * 1024] == counts[2**20] == LARGE_BLOCKS
    assert counts[2**21] == counts[2**22] == HUGE_BLOCKS
    assert pinned_size_classes(1) == [(1, SMALL_BLOCKS)]
    assert pinned_size_classes(2**30)[-1] == (WARM_MAX_BYTES, HUGE_BLOCKS)  # larger sizes are not warmed
    assert pinned_size_classes(4096)[-1] == (4096, SMALL_BLOCKS)
    # A block table and a slot mapping per KV group: the larger sizes scale with the groups.
    two = dict(pinned_size_classes(3 * 2**20, kv_groups=2))
    assert two[1] == SMALL_BLOCKS and two[2**20] == 2 * LARGE_BLOCKS and two[2**22] == 2 * HUGE_BLOCKS


def test_every_block_is_held_until_all_are_allocated() -> None:
    allocated: list[weakref.ref[torch.Tensor]] = []
    alive_at_last = 0

    def allocate(size: int) -> torch.Tensor:
        nonlocal alive_at_last
        alive_at_last = sum(1 for ref in allocated if ref() is not None)
        tensor = torch.empty(size, dtype=torch.uint8)
        allocated.append(weakref.ref(tensor))
        return tensor

    total = warm_pinned_memory(1000, allocate=allocate)
    classes = pinned_size_classes(1000)
    assert total == sum(size * blocks for size, blocks in classes)
    assert len(allocated) == sum(blocks for _, blocks in classes)
    assert alive_at_last == len(allocated) - 1  # every block before the last still held
    assert all(ref() is None for ref in allocated)  # and all freed on return


def test_the_largest_step_tensor_is_token_ids_or_the_block_tables() -> None:
    assert step_host_bytes(8192, 64, 2048, 16) == 8192 * 8  # 64 tables of 144 int32 columns are less
    assert step_host_bytes(2048, 256, 131072, 16) == 256 * 8192 * 4  # 8,192 columns: aligned already
    assert step_host_bytes(16, 4, 1000, 16) == 4 * 64 * 4  # 63 blocks, aligned to 64 columns
