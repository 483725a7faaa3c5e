"""The bf16 linears of one decode step at a batch of M tokens: cuBLAS (``F.linear``, what the model runs)
against a plain Triton tensor-core GEMM over a sweep of tiles, per projection of the Llama-3.1-8B shape.

Each case replays, from one CUDA graph, the projection over ``--copies`` distinct weight copies (as a step
reads its layers' weights: nothing is served from L2 from one to the next; the LM head over at most 4) and
reports µs per call, TFLOP/s and the weight-read bandwidth; the summary (``step_ms``) sums the four projections
times the model's 32 layers plus the LM head once over all M rows. It asks one question before any kernel
work: at M = 256 (W1's steady decode) does another tile choice than cuBLAS's do the step's linears in less
time? Prints one JSON line per case and per summary; ``--json`` writes them all.

    python bench/gemm_tiles.py --tokens 256
    python bench/gemm_tiles.py --tokens 128 256 512 --quick
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_profile import graph_time_us  # noqa: E402

# (name, N, K) of the Llama-3.1-8B shape: fused QKV, O, fused gate/up, down; the LM head runs once a step.
MODEL_LAYERS = 32
LM_HEAD_COPIES = 4  # 1 GB each
LAYER_SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
LM_HEAD = ("lm_head", 128256, 4096)


@triton.jit
def _gemm_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_bn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # C[M, N] = A[M, K] @ B[N, K]^T, as F.linear with a row-major weight; grouped launch order over M tiles.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]
    m_mask = offs_m[:, None] < M
    n_mask = offs_n[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K for every shape here
        a = tl.load(a_ptrs, mask=m_mask, other=0.0)
        b = tl.load(b_ptrs, mask=n_mask, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask & n_mask)


def triton_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: tuple[int, ...]) -> None:
    block_m, block_n, block_k, group_m, stages, warps = tile
    m, k = x.shape
    n = w.shape[0]
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gemm_kernel[grid](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_stages=stages, num_warps=warps,
    )  # fmt: skip


def tiles(quick: bool) -> list[tuple[int, ...]]:
    """(block_m, block_n, block_k, group_m, stages, warps)."""
    if quick:
        return [
            (64, 128, 64, 8, 4, 4),
            (128, 128, 64, 8, 4, 8),
            (64, 256, 64, 8, 3, 8),
            (128, 256, 64, 8, 3, 8),
        ]
    grid = itertools.product((64, 128), (64, 128, 256), (64, 128), (8,), (3, 4), (4, 8))
    # A 64 x 64 tile gives each of 8 warps too little of the MMA to keep busy; the large tiles that overflow
    # shared memory at their stage count are refused by Triton (OutOfResources) and skipped in bench_shape.
    return [t for t in grid if not (t[0] == 64 and t[1] == 64 and t[5] == 8)]


def time_layers(fn: Callable[[int], None], layers: int) -> float:
    """Device µs per layer of ``fn(i)`` over the layers' weights, from one CUDA graph."""

    def step() -> None:
        for i in range(layers):
            fn(i)

    return graph_time_us(step, replays=20) / layers


def bench_shape(
    name: str, n: int, k: int, m: int, copies: int, sweep: list[tuple[int, ...]], gen: torch.Generator
) -> dict[str, object]:
    dev = torch.device("cuda")
    weights = [
        torch.randn(n, k, generator=gen, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)
    ]
    x = torch.randn(m, k, generator=gen, device=dev, dtype=torch.bfloat16)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    flop = 2.0 * m * n * k
    wbytes = 2.0 * n * k

    def rates(us: float) -> dict[str, float]:
        return {
            "us": round(us, 2),
            "tflops": round(flop / us / 1e6, 1),
            "weight_tbps": round(wbytes / us / 1e6, 2),
        }

    cublas = time_layers(lambda i: torch.mm(x, weights[i].t(), out=out), copies)
    reference = F.linear(x, weights[0]).float()
    row: dict[str, object] = {"shape": name, "m": m, "n": n, "k": k, "cublas": rates(cublas)}
    best: tuple[float, tuple[int, ...]] | None = None
    failed = 0
    for tile in sweep:
        try:
            triton_linear(x, weights[0], out, tile)
            err = ((out.float() - reference).abs().max() / reference.abs().max()).item()
            if err > 2e-2:
                raise AssertionError(f"tile {tile}: relative error {err:.3g}")
            us = time_layers(lambda i, t=tile: triton_linear(x, weights[i], out, t), copies)
        except triton.runtime.errors.OutOfResources:
            failed += 1
            continue
        if best is None or us < best[0]:
            best = (us, tile)
    if best is not None:
        row["triton_best"] = {**rates(best[0]), "tile": list(best[1])}
        row["triton_vs_cublas"] = round(best[0] / cublas, 3)
    row["tiles_tried"] = len(sweep) - failed
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256], help="M: tokens in the step")
    parser.add_argument(
        "--copies", type=int, default=MODEL_LAYERS, help="distinct weight copies per projection"
    )
    parser.add_argument("--quick", action="store_true", help="four tiles instead of the sweep")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_tiles: needs a CUDA device", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    sweep = tiles(args.quick)
    rows: list[dict[str, object]] = []
    for m in args.tokens:
        per_m = []
        for name, n, k in (*LAYER_SHAPES, LM_HEAD):
            copies = min(args.copies, LM_HEAD_COPIES) if name == "lm_head" else args.copies
            row = bench_shape(name, n, k, m, copies, sweep, gen)
            torch.cuda.empty_cache()  # the shape's weight copies are gone with its frame
            print(json.dumps(row), flush=True)
            per_m.append(row)
        for impl in ("cublas", "triton_best"):
            total, missing = 0.0, []
            for r in per_m:
                figures = r.get(impl)
                if isinstance(figures, dict):
                    total += float(figures["us"]) * (1 if r["shape"] == "lm_head" else MODEL_LAYERS)
                else:
                    missing.append(r["shape"])
            summary = {"m": m, "impl": impl, "step_ms": None if missing else round(total / 1e3, 3)}
            summary |= {"no_tile_for": missing} if missing else {}
            print(json.dumps(summary), flush=True)
            per_m.append(summary)
        rows += per_m
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
