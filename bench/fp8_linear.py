"""Per-channel FP8 linears of one decoder layer on this GPU, by token count: device time of the layer's four
projections (one CUDA graph replayed, as decode steps run them) with bf16 weights, with FP8 weights and the
torch-op activation quantization of 2026-11-26 (eight kernels per linear), with FP8 weights through
``w8a8_per_channel_matmul`` (one quantization kernel), and up to ``SMALL_M`` tokens through the weight-only
kernel ``weight_stream_matmul`` (``bf16_weight_stream``: the same kernel on the bf16 weights, unscaled). Prints
one JSON line; ``*_step_ms`` multiply one layer by the number of layers. ``--sweep`` times the weight-only
kernel's tiles per projection instead (over enough weight copies to miss L2), with the bandwidth each reaches;
``--sweep --bf16`` the CUDA-core tiles on bf16 weights, cuBLAS first. ``--activations`` times the activation
side of the W8A8 path instead: the per-token quantization of the layer's four inputs with each row read once
(the default up to ``ONE_PASS_MAX_K``) and read twice, and the down projection fed [gate | up] through
``silu_and_mul`` then the FP8 linear against ``fp8_linear_gated`` (the product quantized in the kernel that
computes it).

    python bench/fp8_linear.py --hidden 4096 --ffn 14336 --heads 32 --kv-heads 8 --layers 32
    python bench/fp8_linear.py --sweep --tokens 1 16
    python bench/fp8_linear.py --sweep --bf16 --tokens 1
    python bench/fp8_linear.py --activations --tokens 32 256 8192
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workers"))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from moe_profile import graph_time_us  # noqa: E402

from ominix_worker.ops import fused_moe  # noqa: E402
from ominix_worker.ops.fp8_gemm import (  # noqa: E402
    SMALL_M,
    fp8_linear_gated,
    w8a8_per_channel_matmul,
)
from ominix_worker.ops.fused import silu_and_mul  # noqa: E402
from ominix_worker.ops.weight_stream import GEMV_M, weight_stream_matmul  # noqa: E402
from ominix_worker.quant.fp8 import FP8_MAX, quantize_fp8_blocks  # noqa: E402


def torch_ops_quantized(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The per-channel path before the quantization kernel: per-token scales from torch ops."""
    x_scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-10) / FP8_MAX
    q = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(weight.dtype)
    return torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=scale.reshape(1, -1), out_dtype=x.dtype)


def sweep(
    shapes: dict[str, tuple[int, int]], tokens: list[int], bf16: bool = False
) -> list[dict[str, object]]:
    """Per projection and token count: µs and GB/s of the weight-only kernel per (block_n, block_k, split_k,
    stages, warps, dot), the kernel's own choice first (block_k and split_k "auto"). ``dot``: the 16-row
    tensor-core tile, or the float32 sums on the CUDA cores (at most ``GEMV_M`` tokens). ``bf16``: unscaled
    bf16 weights (``PackableLinear``'s one-token path), CUDA-core tiles only, cuBLAS (``F.linear``) first."""
    # The kernel's own choice first; the tensor-core tiles for FP8 weights only.
    grid = [(0, 0, 0, 3, 0, None)] if bf16 else [(32, 0, 0, 3, 4, None)]
    if not bf16:
        grid += [
            (bn, bk, sk, st, wp, True)
            for bn in (32, 64)
            for bk in (256, 512)
            for sk in (1, 2, 4)
            for st in (3, 4)
            for wp in (4, 8)
        ]
    gemv_grid = [
        (bn, bk, sk, st, wp, False)
        for bn in (16, 32, 64)
        for bk in (256, 512)
        for sk in ((0,) if bf16 else (0, 1, 2, 4))
        for st in ((2, 3, 4) if bf16 else (3,))
        for wp in (4, 8)
    ]
    rows: list[dict[str, object]] = []
    for name, (n, k) in shapes.items():
        copies = max(1, -(-(256 << 20) // (n * k)))  # more than L2 holds, as a step's layers are
        if bf16:
            copies *= 2
        weights: list[tuple[torch.Tensor, torch.Tensor | None]] = [
            (torch.randn((n, k), device="cuda", dtype=torch.bfloat16) / k**0.5, None)
            if bf16
            else quantize_fp8_blocks(torch.randn((n, k), device="cuda") / k**0.5, (1, k))
            for _ in range(copies)
        ]
        for m in tokens:
            x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16)
            if bf16:
                us = graph_time_us(
                    lambda x=x, weights=weights: [F.linear(x, w) for w, _ in weights], replays=20
                )
                us /= copies
                rows.append(
                    {"proj": name, "tokens": m, "kernel": "cublas", "us": round(us, 2),
                     "gb_s": round(2 * n * k / us / 1e3, 1)}
                )  # fmt: skip
            for bn, bk, sk, st, wp, dot in grid + (gemv_grid if m <= GEMV_M else []):

                def run(
                    config: tuple[int, ...] = (bn, bk, sk, st, wp),
                    dot: bool | None = dot,
                    x: torch.Tensor = x,
                    weights: list[tuple[torch.Tensor, torch.Tensor | None]] = weights,
                ) -> None:
                    for q, scale in weights:
                        weight_stream_matmul(
                            x, q, scale, (1, x.shape[1]), block_n=config[0], block_k=config[1],
                            split_k=config[2], num_stages=config[3], num_warps=config[4], use_dot=dot,
                        )  # fmt: skip

                try:
                    us = graph_time_us(run, replays=20) / copies
                except triton.runtime.errors.OutOfResources:  # the tile and its stages exceed shared memory
                    continue
                rows.append(
                    {"proj": name, "tokens": m, "block_n": bn or "auto", "block_k": bk or "auto", "split_k": sk or "auto",
                     "stages": st, "warps": wp, "dot": "auto" if dot is None else dot, "us": round(us, 2),
                     "gb_s": round(weights[0][0].element_size() * n * k / us / 1e3, 1)}
                )  # fmt: skip
    return rows


@torch.inference_mode()
def activation_times(
    shapes: dict[str, tuple[int, int]],
    weights: dict[str, tuple[torch.Tensor, ...]],
    tokens: list[int],
    layers: int,
) -> list[dict[str, object]]:
    """Per token count, ms per step (one layer × ``layers``): the four inputs' per-token quantization, rows read
    once and twice; the down projection from [gate | up], product then linear, and fused."""
    return [_activation_row(m, shapes, weights["down"], layers) for m in tokens]


def _activation_row(
    m: int, shapes: dict[str, tuple[int, int]], down: tuple[torch.Tensor, ...], layers: int
) -> dict[str, object]:
    _, down_q, down_s = down
    ffn = shapes["down"][1]
    inputs = [torch.randn((m, k), device="cuda", dtype=torch.bfloat16) for _, k in shapes.values()]
    gate_up = torch.randn((m, 2 * ffn), device="cuda", dtype=torch.bfloat16)

    def quantize_inputs() -> None:
        for x in inputs:
            fused_moe.quant_fp8_per_token(x)

    def step_ms(fn: Callable[[], object]) -> float:
        return round(graph_time_us(fn) / 1e3 * layers, 3)

    row: dict[str, object] = {"tokens": m, "quant_one_pass_step_ms": step_ms(quantize_inputs)}
    saved, fused_moe.ONE_PASS_MAX_K = fused_moe.ONE_PASS_MAX_K, 0
    try:
        row["quant_two_pass_step_ms"] = step_ms(quantize_inputs)
    finally:
        fused_moe.ONE_PASS_MAX_K = saved
    row["down_silu_then_linear_step_ms"] = step_ms(
        lambda: w8a8_per_channel_matmul(silu_and_mul(gate_up), down_q, down_s)
    )
    row["down_gated_step_ms"] = step_ms(lambda: fp8_linear_gated(gate_up, down_q, down_s, (1, ffn)))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 256, 512])
    p.add_argument("--sweep", action="store_true", help="time the weight-only kernel's tiles per projection")
    p.add_argument("--bf16", action="store_true", help="--sweep: unscaled bf16 weights, beside cuBLAS")
    p.add_argument("--activations", action="store_true", help="time the activation quantization paths")
    args = p.parse_args()
    h, hd = args.hidden, args.hidden // args.heads
    shapes = {  # name: (N, K)
        "qkv": ((args.heads + 2 * args.kv_heads) * hd, h),
        "o": (h, args.heads * hd),
        "gate_up": (2 * args.ffn, h),
        "down": (h, args.ffn),
    }
    if args.sweep:
        print(
            json.dumps(
                {"device": torch.cuda.get_device_name(), "sweep": sweep(shapes, args.tokens, args.bf16)}
            ),
            flush=True,
        )
        return
    weights = {}
    for name, (n, k) in shapes.items():
        w = torch.randn((n, k), device="cuda", dtype=torch.bfloat16) / k**0.5
        q, s = quantize_fp8_blocks(w, (1, k))
        weights[name] = (w, q, s)
    if args.activations:
        rows = activation_times(shapes, weights, args.tokens, args.layers)
        print(json.dumps({"device": torch.cuda.get_device_name(), "activations": rows}), flush=True)
        return
    variants: dict[str, Callable[[torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor]] = {
        "bf16": lambda x, ws: F.linear(x, ws[0]),
        "bf16_weight_stream": lambda x, ws: weight_stream_matmul(x, ws[0]),
        "fp8_torch_ops": lambda x, ws: torch_ops_quantized(x, ws[1], ws[2]),
        "fp8_one_quant_kernel": lambda x, ws: w8a8_per_channel_matmul(x, ws[1], ws[2]),
        "fp8_weight_only": lambda x, ws: weight_stream_matmul(x, ws[1], ws[2], (1, x.shape[1])),
        "fp8_weight_only_dot": lambda x, ws: weight_stream_matmul(
            x, ws[1], ws[2], (1, x.shape[1]), use_dot=True
        ),
    }
    rows = []
    for m in args.tokens:
        inputs = {
            name: torch.randn((m, k), device="cuda", dtype=torch.bfloat16) for name, (_, k) in shapes.items()
        }
        row: dict[str, object] = {"tokens": m}
        for label, fn in variants.items():
            if "weight_" in label and m > SMALL_M:
                continue

            def layer(fn: Callable[..., torch.Tensor] = fn, inputs: dict[str, torch.Tensor] = inputs) -> None:
                for name in shapes:
                    fn(inputs[name], weights[name])

            row[f"{label}_step_ms"] = round(graph_time_us(layer) / 1e3 * args.layers, 3)
        rows.append(row)
    weight_bytes = sum(n * k for n, k in shapes.values()) * args.layers
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(),
                "fp8_weight_gb_per_step": round(weight_bytes / 1e9, 3),
                "rows": rows,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
