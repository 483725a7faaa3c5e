"""A cuBLAS GEMM's first call at a new row count against its second: does the first cost more, and does it wait
for the device?

Each row count M runs a bf16 ``x[M, K] @ W[N, K].T`` (the Llama-3.1-8B LM head's shape by default) into an output
allocated beforehand (so the caching allocator stays out of the figure), twice:

- ``--mode idle``: on an idle device, each call timed until its result is back;
- ``--mode queued``: each call issued right after ``--queue-ms`` of 8,192³ matmuls were queued, timing only the
  host's time in the call itself. A call that returns at once has queued its kernel; one that takes about the
  queue's time waited for the device, and would hold a serving worker's device thread as long.

Run each mode in its own process: a row count called in one sweep is no longer new to cuBLAS in the next, and
neither are the row counts 1 and 256, which warm cuBLAS up before either sweep. On an H200 (bench/RESULTS.md,
2026-11-30) the first call at the LM head's shape paid ~3 ms idle and waited for the queue, once per bucket of
8 row counts; at the gate-up shape (``--n 28672``) it waited 163 - 185 ms behind ~150 ms of queue, at counts 7
to 33 rows apart.

    python bench/gemm_first_call.py --mode idle --rows 2:260:3 [--n 128256 --k 4096] [--json out.json]
    python bench/gemm_first_call.py --mode queued --rows 11,19,27,35,43 [--queue-ms 150]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # bench.* from the repository root

import torch

from bench.common import counts_option

WARM_ROWS = (1, 256)  # called before either sweep


def idle_call_ms(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.matmul(x, w.t(), out=out)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def queued_call_ms(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, square: torch.Tensor, reps: int
) -> float:
    """Host ms of one call issued right after ``reps`` square matmuls were queued."""
    torch.cuda.synchronize()
    for _ in range(reps):
        torch.matmul(square, square)
    start = time.perf_counter()
    torch.matmul(x, w.t(), out=out)
    host = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    return host


def queue_of(queue_ms: float) -> tuple[torch.Tensor, int]:
    """A square bf16 matrix and how many of its 8,192³ matmuls queue about ``queue_ms`` of device work."""
    square = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.matmul(square, square)  # its own first call stays out of the rate below
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        torch.matmul(square, square)
    torch.cuda.synchronize()
    return square, max(1, round(queue_ms / ((time.perf_counter() - start) * 1e3 / 10)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("idle", "queued"), default="idle")
    p.add_argument("--rows", default="2:260:3", help="row counts, START:STOP:STEP or a comma-separated list")
    p.add_argument("--n", type=int, default=128256, help="output features (Llama-3.1-8B's vocabulary)")
    p.add_argument("--k", type=int, default=4096, help="input features")
    p.add_argument("--queue-ms", type=float, default=150.0, help="--mode queued: device work queued first")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = counts_option(p, "--rows", args.rows)
    warm = sorted(set(rows) & set(WARM_ROWS))
    if warm:
        p.error(f"--rows: {warm} are called to warm cuBLAS up, so not new to it")
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    w = torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16)
    for m in WARM_ROWS:  # cuBLAS's own start-up stays out of the figures
        x = torch.randn(m, args.k, device="cuda", dtype=torch.bfloat16)
        idle_call_ms(x, w, torch.empty(m, args.n, device="cuda", dtype=torch.bfloat16))
    inputs = [torch.randn(m, args.k, device="cuda", dtype=torch.bfloat16) for m in rows]
    outputs = [torch.empty(m, args.n, device="cuda", dtype=torch.bfloat16) for m in rows]
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}: N={args.n} K={args.k}, mode {args.mode}"
    )
    reps = 0
    call: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], float] = idle_call_ms
    if args.mode == "queued":
        square, reps = queue_of(args.queue_ms)
        print(
            f"queue: {reps} matmuls of 8192^3 (~{args.queue_ms:.0f} ms) before each call; host time of the call"
        )
        call = functools.partial(queued_call_ms, square=square, reps=reps)
    results: list[dict[str, float]] = []
    for m, x, out in zip(rows, inputs, outputs, strict=True):
        first, second = (call(x, w, out) for _ in range(2))
        results.append({"rows": m, "first_ms": round(first, 3), "second_ms": round(second, 3)})
    for r in results:
        costly = " <- first call costs more" if r["first_ms"] > 3 * r["second_ms"] + 0.5 else ""
        print(f"  M={r['rows']:5d}  first {r['first_ms']:8.2f} ms  second {r['second_ms']:7.2f} ms{costly}")
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "n": args.n, "k": args.k}
        with open(args.json, "w") as f:
            json.dump({**meta, "mode": args.mode, "queued_matmuls": reps, "calls": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
