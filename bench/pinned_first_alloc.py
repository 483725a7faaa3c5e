"""Does a pinned host allocation of a size new to torch's cache wait for the device?

Each size (rounded by the caching host allocator to a power of two, one size per class) is allocated twice with
``--queue-ms`` of 8,192³ matmuls queued before each, timing the host's time in the allocation alone: the first
comes from the driver (page-locked memory, which CUDA lists among the implicitly synchronizing calls), the
second from the cache, the first block having been freed into it. A first allocation that takes about the
queue's time waited for the device, and would hold a serving worker's step as long. On an H200 (2026-11-30,
bench/RESULTS.md) none did, at 64 B to 1 MiB.

    python bench/pinned_first_alloc.py [--sizes 64,4096,65536,1048576] [--queue-ms 150] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # bench.* from the repository root

import torch

from bench.common import counts_option
from bench.gemm_first_call import queue_of


def empty_host_cache() -> bool:
    """Return the cached pinned blocks to the driver (torch's private entry points differ by version)."""
    for name in ("_accelerator_emptyHostCache", "_host_emptyCache"):
        empty = getattr(torch._C, name, None)
        if empty is not None:
            empty()
            return True
    return False


def queued_alloc_ms(size: int, square: torch.Tensor, reps: int) -> float:
    """Host ms of one pinned allocation of ``size`` bytes issued right after ``reps`` square matmuls."""
    torch.cuda.synchronize()
    for _ in range(reps):
        torch.matmul(square, square)
    start = time.perf_counter()
    block = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    host = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    del block  # back to the cache: the next allocation of this size is served from it
    return host


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64,4096,65536,1048576", help="bytes, one per power-of-two class")
    p.add_argument("--queue-ms", type=float, default=150.0, help="device work queued before each allocation")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    sizes = counts_option(p, "--sizes", args.sizes)
    classes = [(size - 1).bit_length() for size in sizes]  # the allocator rounds up to 2 ** class
    if len(set(classes)) != len(classes):
        p.error("--sizes: two sizes share a power-of-two class (the second would come from the cache)")
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    square, reps = queue_of(args.queue_ms)
    emptied = empty_host_cache()
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {reps} matmuls of 8192^3 "
        f"(~{args.queue_ms:.0f} ms) queued before each allocation; host cache emptied first: {emptied}"
    )
    results = []
    for size in sizes:
        first, second = (queued_alloc_ms(size, square, reps) for _ in range(2))
        results.append({"bytes": size, "first_ms": round(first, 3), "second_ms": round(second, 3)})
        waited = " <- the first waited for the device" if first > 0.5 * args.queue_ms else ""
        print(f"  {size:9d} B  first {first:8.2f} ms  second {second:7.3f} ms{waited}")
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "emptied": emptied}
        with open(args.json, "w") as f:
            json.dump({**meta, "queued_matmuls": reps, "allocations": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
