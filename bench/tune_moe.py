"""Tunes the Triton fused MoE tile shapes for one MoE layer shape and writes the table the worker reads, and
times the tuned layer per decode step against the bandwidth floor of the active experts' weights.

    python bench/tune_moe.py --config bench/configs/qwen3-30b-a3b-config.json [--fp8] [--quick] [--write]

For every token count M in the list it times ``fused_experts`` (align, gate_up GEMM, SiLU·mul, down GEMM,
sum) with uniformly random routing for each candidate tile shape and keeps the fastest. ``--write`` stores
``workers/ominix_worker/ops/moe_configs/E=..,N=..,K=..,dtype=..,device=<this GPU>.json``; the worker picks the
nearest M entry of that file at run time (``fused_moe.pick_config``).

The floor of one decode step's MoE work is reading the weights of the distinct experts the batch routes to
(at batch 1: top_k experts × 3 × H × I elements per layer) at the measured device copy bandwidth.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))
import conftest  # noqa: E402,F401  (makes ominix_worker importable from a bare checkout)
from roofline import measure_copy_bandwidth  # noqa: E402

from ominix_worker.config import ModelConfig, load_hf_config  # noqa: E402
from ominix_worker.ops import fused_moe  # noqa: E402
from ominix_worker.ops.moe_ref import select_experts  # noqa: E402

TOKEN_COUNTS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096, 8192]


def candidates(use_fp8: bool, quick: bool, tokens: int) -> list[dict[str, int]]:
    """Tile shapes to try for ``tokens`` tokens; ``quick`` keeps 18-48 per size class (decode: narrow N tiles
    so that the few experts' weights spread over every SM; prefill: big tiles, 8 warps, grouped order), the
    full space has 512."""
    k_tiles = [64, 128] if use_fp8 else [64, 128, 256]
    if quick and tokens <= 64:
        space = ([16], [32, 64, 128], k_tiles, [1], [4], [3, 4, 5])
    elif quick and tokens <= 512:
        space = ([16, 32, 64], [64, 128], [64, 128], [1], [4, 8], [3, 4])
    elif quick:
        space = ([64, 128], [128, 256], [64, 128], [16], [4, 8], [3, 4])
    else:
        space = ([16, 32, 64, 128], [32, 64, 128, 256], [64, 128] if use_fp8 else [32, 64, 128, 256],
                 [1, 16], [4, 8], [3, 4])  # fmt: skip
    return [
        dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=w, num_stages=st)
        for bm, bn, bk, gm, w, st in itertools.product(*space)
    ]


Layer = tuple[torch.Tensor, torch.Tensor, dict[str, Any]]
Routed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def expert_weights(
    config: ModelConfig, use_fp8: bool, gen: torch.Generator, per_channel: bool = False
) -> Layer:
    """One layer's stacked experts (random, bf16 or FP8) on the GPU, with ``fused_experts``' scale arguments:
    128 × 128 block scales (as FP8 checkpoints ship), or one scale per output row (``--quantization fp8``)."""
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    w13 = (torch.randn((e, 2 * i, h), generator=gen) / h**0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn((e, h, i), generator=gen) / i**0.5).to(torch.bfloat16).cuda()
    if not use_fp8:
        return w13, w2, {}
    from ominix_worker.quant.fp8 import quantize_fp8_blocks

    b13, b2 = ((1, h), (1, i)) if per_channel else ((128, 128), (128, 128))
    q13, s13 = quantize_fp8_blocks(w13, b13)
    q2, s2 = quantize_fp8_blocks(w2, b2)
    return q13, q2, {"w13_scale": s13, "w2_scale": s2, "w13_block": b13, "w2_block": b2}


def routed_tokens(config, tokens: int, gen: torch.Generator) -> Routed:
    """Activations and a uniformly random top-k routing for ``tokens`` tokens."""
    x = torch.randn((tokens, config.hidden_size), generator=gen).to(torch.bfloat16).cuda()
    logits = torch.randn((tokens, config.num_experts), generator=gen).cuda()
    weights, ids = select_experts(logits, config.num_experts_per_tok, renormalize=True)
    return x, weights, ids


def time_layer(layer: Layer, routed: Routed, cfg: dict[str, int] | None) -> float:
    w13, w2, scales = layer
    x, weights, ids = routed
    # Replayed from a CUDA graph, as the worker runs it: an eager timing at decode sizes measures the Python
    # launch cost of the four kernels, not the tile shape.
    return do_bench_cudagraph(
        lambda: fused_moe.fused_experts(x, w13, w2, weights, ids, config=cfg, **scales),
        rep=60,
        return_mode="median",
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="bench/configs/qwen3-30b-a3b-config.json")
    parser.add_argument("--fp8", action="store_true", help="tune the W8A8 path (128 x 128 block scales)")
    parser.add_argument(
        "--per-channel", action="store_true", help="FP8 with one scale per weight row instead"
    )
    parser.add_argument("--quick", action="store_true", help="fewer candidates and token counts")
    parser.add_argument("--write", action="store_true", help="store the table under moe_configs/")
    parser.add_argument("--tokens", type=int, nargs="*", default=None, help="token counts to tune")
    args = parser.parse_args()
    config = load_hf_config(args.config)
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    if not config.is_moe:
        parser.error(f"{args.config} is not a mixture-of-experts config")
    tokens_list = args.tokens or ([1, 8, 32, 128, 512, 2048, 8192] if args.quick else TOKEN_COUNTS)
    gen = torch.Generator().manual_seed(0)
    table: dict[str, dict[str, int]] = {}
    layer = expert_weights(config, args.fp8, gen, args.per_channel)
    for tokens in tokens_list:
        routed = routed_tokens(config, tokens, gen)
        default_ms = time_layer(layer, routed, None)
        best_ms, best = default_ms, fused_moe.default_config(tokens, args.fp8)
        for cfg in candidates(args.fp8, args.quick, tokens):
            try:
                ms = time_layer(layer, routed, cfg)
            except Exception:  # noqa: BLE001 - a shape the compiler or the device refuses is skipped
                continue
            if ms < best_ms:
                best_ms, best = ms, cfg
        table[str(tokens)] = best
        print(
            f"M={tokens:5d}  default {default_ms * 1e3:8.1f} us  tuned {best_ms * 1e3:8.1f} us  {best}",
            flush=True,
        )
    name = fused_moe.config_file_name(e, 2 * i, h, "fp8" if args.fp8 else "bf16")
    if args.write:
        fused_moe.CONFIG_DIR.mkdir(exist_ok=True)
        path = fused_moe.CONFIG_DIR / name
        # Token counts not tuned in this run keep their stored entries.
        stored = json.loads(path.read_text()) if path.is_file() else {}
        merged = {**stored, **table}
        merged = {m: merged[m] for m in sorted(merged, key=int)}
        path.write_text(json.dumps(merged, indent=1) + "\n")
        fused_moe._stored_table.cache_clear()
        print(f"wrote {fused_moe.CONFIG_DIR / name}")
    report_decode_floor(config, args.fp8, gen)


def report_decode_floor(config: ModelConfig, use_fp8: bool, gen: torch.Generator) -> None:
    """MoE time per decode step (all layers) vs reading the routed experts' weights once at copy bandwidth.

    Four layers with their own weights run back to back per timing, so no layer finds its experts in L2.
    The floor counts expert weights only (scales, router and activations are a few percent more)."""
    bandwidth = measure_copy_bandwidth()  # DRAM bytes/s (a copy counted as bytes read + bytes written)
    h, i = config.hidden_size, config.moe_intermediate_size
    element = 1 if use_fp8 else 2
    layers = len(config.moe_layers)
    print(f"\nMoE per decode step ({layers} layers, {'fp8' if use_fp8 else 'bf16'}), copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s")  # fmt: skip
    print("batch  distinct experts/layer  kernel ms/step  floor ms/step  floor/kernel")
    layer_set = [expert_weights(config, use_fp8, gen) for _ in range(4)]
    for batch in (1, 8, 32, 128):
        routed = [routed_tokens(config, batch, gen) for _ in layer_set]

        def run(routed: list[Routed] = routed) -> None:
            for (w13, w2, scales), (x, weights, ids) in zip(layer_set, routed, strict=True):
                fused_moe.fused_experts(x, w13, w2, weights, ids, **scales)

        per_layer_ms = do_bench_cudagraph(run, rep=100, return_mode="median") / len(layer_set)
        distinct = sum(int(torch.unique(r[2]).numel()) for r in routed) / len(routed)
        ms = per_layer_ms * layers
        floor_ms = distinct * 3 * h * i * element * layers / bandwidth * 1e3
        print(
            f"{batch:5d}  {distinct:22.1f}  {ms:14.3f}  {floor_ms:13.3f}  {floor_ms / ms:12.2f}", flush=True
        )


if __name__ == "__main__":
    main()
