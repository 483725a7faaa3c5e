"""A cuBLAS GEMM's first call at a new row count, on the host, with the device idle and behind queued work.

For each row count M: a bf16 ``x[M, K] @ W[N, K].T`` (the LM head's shape by default) is timed twice with the
device idle (until its result is back), then, at a fresh M of the same sequence, twice right after ``--queue-ms``
of matmuls were queued, where only the host time of the call itself is taken (no synchronize inside). A call
that returns at once queues its kernel; one that takes about the queue's time waited for the device, which
holds a serving worker's device thread for as long. Shows which row counts pay a first-call cost and whether
that cost waits for queued work.

    python bench/gemm_first_call.py [--rows 2:260:3] [--n 128256 --k 4096] [--queue-ms 150] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def parse_rows(spec: str) -> list[int]:
    """``START:STOP:STEP`` (a range) or a comma-separated list."""
    if ":" in spec:
        start, stop, step = (int(x) for x in spec.split(":"))
        return list(range(start, stop, step))
    return [int(x) for x in spec.split(",")]


def idle_call_ms(x: torch.Tensor, w: torch.Tensor) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.matmul(x, w.t())
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def queued_call_ms(x: torch.Tensor, w: torch.Tensor, queue: list[torch.Tensor], reps: int) -> float:
    """Host ms of one call issued right after ``reps`` square matmuls were queued."""
    torch.cuda.synchronize()
    for _ in range(reps):
        torch.matmul(queue[0], queue[1])
    start = time.perf_counter()
    torch.matmul(x, w.t())
    host = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    return host


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--rows", default="2:260:3", help="row counts for the idle calls, START:STOP:STEP or a list"
    )
    p.add_argument(
        "--queued-rows", default="11,17,26,35,41,50,59,65,74,83", help="fresh row counts, queued calls"
    )
    p.add_argument("--n", type=int, default=128256, help="output features (Llama-3.1-8B's vocabulary)")
    p.add_argument("--k", type=int, default=4096, help="input features")
    p.add_argument("--queue-ms", type=float, default=150.0, help="device work queued before each queued call")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    idle_rows, queued_rows = parse_rows(args.rows), parse_rows(args.queued_rows)
    if set(idle_rows) & set(queued_rows):
        print(
            "--rows and --queued-rows must not share a row count: a queued call must be a first one",
            file=sys.stderr,
        )
        return 2
    w = torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16)
    square = [torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    # cuBLAS's own start-up and the square matmul's first call stay out of every figure below.
    for m in (1, 256):
        idle_call_ms(torch.randn(m, args.k, device="cuda", dtype=torch.bfloat16), w)
    torch.matmul(square[0], square[1])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        torch.matmul(square[0], square[1])
    torch.cuda.synchronize()
    reps = max(1, round(args.queue_ms / ((time.perf_counter() - start) * 1e3 / 10)))

    idle = []
    for m in idle_rows:
        x = torch.randn(m, args.k, device="cuda", dtype=torch.bfloat16)
        idle.append(
            {"rows": m, "first_ms": round(idle_call_ms(x, w), 3), "second_ms": round(idle_call_ms(x, w), 3)}
        )
    queued = []
    for m in queued_rows:
        x = torch.randn(m, args.k, device="cuda", dtype=torch.bfloat16)
        first, second = (queued_call_ms(x, w, square, reps) for _ in range(2))
        queued.append({"rows": m, "first_host_ms": round(first, 3), "second_host_ms": round(second, 3)})

    slow = [r for r in idle if r["first_ms"] > 3 * r["second_ms"] + 0.5]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: N={args.n} K={args.k}")
    print(f"idle device: {len(slow)} of {len(idle)} row counts paid a first-call cost:")
    for r in slow:
        print(f"  M={r['rows']:5d}  first {r['first_ms']:7.2f} ms  second {r['second_ms']:6.2f} ms")
    print(f"behind {reps} queued 8192^3 matmuls (~{args.queue_ms:.0f} ms), host time of the call:")
    for r in queued:
        print(f"  M={r['rows']:5d}  first {r['first_host_ms']:7.2f} ms  second {r['second_host_ms']:6.2f} ms")
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "n": args.n, "k": args.k}
        with open(args.json, "w") as f:
            json.dump({**meta, "queued_matmuls": reps, "idle": idle, "queued": queued}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
