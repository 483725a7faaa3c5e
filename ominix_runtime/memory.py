"""Keep a serving process's memory near its baseline after large requests (glibc; elsewhere these do nothing),
and its garbage collector out of the way of the step loop (``freeze_startup_heap``).

glibc serves a large allocation with its own mapping, but after the first such block is freed it raises that
threshold to the block's size: later multi-megabyte request buffers then come from the heap, which fragments
and never shrinks (engine RSS grew by ~150 MiB over 50 rejected 3.9 MB prompts). A fixed threshold keeps large
buffers in mappings that go back to the system on free; ``trim`` hands back what the heaps hold free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from typing import Any

LARGE_ALLOCATION_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt  # noqa: B018 - glibc only: musl and others have no mallopt/malloc_trim
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def map_large_allocations(threshold: int = LARGE_ALLOCATION_BYTES) -> bool:
    """Allocations of ``threshold`` bytes or more get their own mapping, always (True when set)."""
    return _LIBC is not None and bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, int(threshold)))


def trim() -> None:
    """Return the heaps' free memory to the system."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


# Young-generation threshold while serving. Python's default (700) runs a collection every few hundred
# container allocations, i.e. about once per decode step at batch 256; each run also ages survivors towards
# the full collections. Nearly everything a step allocates is freed by reference counting.
SERVING_GC_THRESHOLD = (20_000, 20, 20)


def freeze_startup_heap() -> None:
    """Once startup is done: collect, then move every surviving object out of the collector's reach.

    Modules, descriptors, weights' Python wrappers and the like live as long as the process; left in the
    oldest generation, every full collection walks all of them, a pause of tens to hundreds of milliseconds
    in the middle of serving (measured: a 216 ms pause in the engine at batch 256, bench/engine_overhead.py).
    Frozen, a full collection walks only what serving created.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLD)
