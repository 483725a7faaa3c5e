"""One MoE layer at prefill sizes: the Triton tile path (``fused_experts`` with its tuned table) against torch's
grouped GEMM (``ops.grouped_mm_moe``), per token count, in ms and achieved TFLOP/s (2 GEMMs, 2·T·k·(2I·H + H·I)
flops), on random uniform routings. The crossover sets ``GROUPED_MM_MIN_TOKENS``.

    python bench/moe_prefill.py [--json out.json] [--tokens 256,1024,8192]
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))
import conftest  # noqa: E402,F401  (makes ominix_worker importable from a bare checkout)

from ominix_worker.ops.biased_moe import clamped_swiglu_cuda, fused_experts_biased  # noqa: E402
from ominix_worker.ops.fused import silu_and_mul  # noqa: E402
from ominix_worker.ops.fused_moe import fused_experts, pick_config, select_experts  # noqa: E402
from ominix_worker.ops.grouped_mm_moe import experts_grouped_mm  # noqa: E402

SHAPES = {  # name: (experts, top_k, hidden, intermediate, biased)
    "gpt-oss-20b": (32, 4, 2880, 2880, True),
    "qwen3-30b-a3b": (128, 8, 2048, 768, False),
}


def bench_shape(name: str, tokens_list: list[int]) -> list[dict[str, object]]:
    experts, top_k, hidden, inter, biased = SHAPES[name]
    dev, dt = "cuda", torch.bfloat16
    w13 = torch.randn((experts, 2 * inter, hidden), device=dev, dtype=dt) / hidden**0.5
    w2 = torch.randn((experts, hidden, inter), device=dev, dtype=dt) / inter**0.5
    b13 = torch.randn((experts, 2 * inter), device=dev, dtype=dt)
    b2 = torch.randn((experts, hidden), device=dev, dtype=dt)
    swiglu = partial(clamped_swiglu_cuda, alpha=1.702, limit=7.0)
    rows = []
    for tokens in tokens_list:
        x = torch.randn((tokens, hidden), device=dev, dtype=dt)
        weights, ids = select_experts(torch.randn((tokens, experts), device=dev), top_k, renormalize=True)
        cfg = pick_config(experts, 2 * inter, hidden, tokens, False)
        if biased:
            tile = partial(fused_experts_biased, x, w13, w2, b13, b2, weights, ids, swiglu, config=cfg)
            lib = partial(experts_grouped_mm, x, w13, w2, weights, ids, swiglu, b13, b2)
        else:
            tile = partial(fused_experts, x, w13, w2, weights, ids, config=cfg)
            lib = partial(experts_grouped_mm, x, w13, w2, weights, ids, silu_and_mul)
        flops = 2 * tokens * top_k * (2 * inter * hidden + hidden * inter)
        tile_ms, lib_ms = do_bench(tile, warmup=10, rep=50), do_bench(lib, warmup=10, rep=50)
        row = dict(shape=name, tokens=tokens, triton_ms=round(tile_ms, 3), grouped_mm_ms=round(lib_ms, 3),
                   triton_tflops=round(flops / tile_ms / 1e9, 1), grouped_mm_tflops=round(flops / lib_ms / 1e9, 1))  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="write every row to this file")
    parser.add_argument("--tokens", default="256,512,1024,2048,4096,8192,16384")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args(argv)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = [r for name in args.shapes.split(",") for r in bench_shape(name, tokens)]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
