"""cuBLAS bf16 GEMM time by row count at the Llama-3.1-8B linear shapes (qkv, o, gate_up, down), one layer's
four GEMMs replayed from a CUDA graph 32 times (a step's worth), so the figure is the device's, launches
excluded; then each shape alone, 32 times from its own graph. One weight per shape serves all 32 layers (the
``o`` weight, 32 MB, fits in L2; at prefill row counts the GEMMs are compute-bound). Shows how the step's token
count (M) moves cuBLAS's tile choice and its rate: an eager step's M is its prompt tokens plus its decode rows,
rarely a round number. The replays run back to back, so the rate is the card's sustained one, below what a
single profiled step at boost clocks reads.

``--orientation w_xt`` computes each product the other way round, ``W @ X^T`` into an (N, M) output: cuBLAS then
sees the row count as the other dimension of its problem and picks its kernel by other rules. The figure is the
GEMMs' alone; a model would still have to read the transposed output. ``--orientation x_w`` keeps each weight
stored (K, N), transposed once at load, so cuBLAS runs the "NN" form instead of the model's "TN".
``--blas-library cublaslt`` routes torch's matmuls through cuBLASLt (``torch.backends.cuda.preferred_blas_library``;
cublas, torch's default for a bf16 matmul without bias, otherwise).

    python bench/gemm_rows.py [--rows 1024,1028,1032 | --rows 1024:1153:8] [--orientation w_xt|x_w]
        [--blas-library cublaslt] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # bench.* from the repository root

import torch

from bench.common import counts_option

# (name, N, K) of the Llama-3.1-8B linears: fused qkv, o, fused gate_up, down.
SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
LAYERS = 32


# The model's X @ W^T; the same product as W @ X^T (transposed output); X @ W with W stored (K, N).
ORIENTATIONS = ("x_wt", "w_xt", "x_w")
BLAS_LIBRARIES = ("cublas", "cublaslt")


def time_rows(m: int, weights: list[torch.Tensor], reps: int, orientation: str = "x_wt") -> float:
    """Device ms for LAYERS layers' four GEMMs at m rows (median of reps graph replays)."""
    xs = [torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16) for w in weights]
    swapped = orientation == "w_xt"
    stored_kn = [w.t().contiguous() for w in weights] if orientation == "x_w" else weights
    outs = [
        torch.empty(*((w.shape[0], m) if swapped else (m, w.shape[0])), device="cuda", dtype=torch.bfloat16)
        for w in weights
    ]

    def run() -> None:
        for x, w, w_kn, o in zip(xs, weights, stored_kn, outs, strict=True):
            if swapped:
                torch.matmul(w, x.t(), out=o)
            elif orientation == "x_w":
                torch.matmul(x, w_kn, out=o)
            else:
                torch.matmul(x, w.t(), out=o)

    for _ in range(2):  # warm-up outside the capture: cuBLAS picks and loads its kernels here
        run()
    torch.cuda.synchronize()
    for x, w, o in zip(xs, weights, outs, strict=True):  # each orientation computes the model's product
        if product_off(o.t() if swapped else o, torch.nn.functional.linear(x, w), 0.02):
            raise RuntimeError(f"--orientation {orientation} computed another product at {m} rows")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            run()
    return median_replay_ms(graph, reps)


def median_replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Device ms of one replay of ``graph``: the median of ``replays`` back-to-back replays."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def product_off(out: torch.Tensor, expected: torch.Tensor, tolerance: float) -> bool:
    """Whether ``out`` differs from ``expected`` by more than ``tolerance`` of expected's largest magnitude (a
    kernel computing another product, or garbage)."""
    scale = expected.abs().max().item()
    return bool((out.float() - expected.float()).abs().max().item() > tolerance * max(scale, 1e-30))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--rows",
        default="1024,1032,1040,1064,1088,1152,1280,2048,2056,4096,4104,6144,6152,8192,8200",
        help="row counts, START:STOP:STEP or a comma-separated list",
    )
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--orientation", choices=ORIENTATIONS, default="x_wt")
    p.add_argument("--blas-library", choices=BLAS_LIBRARIES, default="cublas")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    counts = counts_option(p, "--rows", args.rows)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(args.blas_library)
    try:
        return _measure(args, counts)
    finally:  # a process-wide setting: main() may run inside a test process
        torch.backends.cuda.preferred_blas_library(before)


def _measure(args: argparse.Namespace, counts: list[int]) -> int:
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _, n, k in SHAPES]
    flop_per_row = 2 * LAYERS * sum(n * k for _, n, k in SHAPES)
    rows = []
    for m in counts:
        ms = time_rows(m, weights, args.reps, args.orientation)
        rate = m * flop_per_row / ms / 1e9
        by_shape = {
            name: round(time_rows(m, [w], args.reps, args.orientation), 3)
            for (name, _, _), w in zip(SHAPES, weights, strict=True)
        }
        rows.append({"rows": m, "ms": round(ms, 3), "tflops": round(rate, 1), "by_shape_ms": by_shape})
        shapes = " ".join(f"{k} {v:.2f}" for k, v in by_shape.items())
        print(
            f"M={m:6d}  {ms:8.3f} ms  {rate:6.1f} TFLOP/s  {1e3 * ms / m:6.3f} us/row  ({shapes})", flush=True
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "orientation": args.orientation,
                    "blas_library": args.blas_library,
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
