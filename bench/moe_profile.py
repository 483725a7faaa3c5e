"""Where one MoE layer's time goes on the GPU, per decode batch size, with CUDA graphs as the worker runs it.

    python bench/moe_profile.py --config bench/configs/qwen3-30b-a3b-config.json [--fp8] [--tokens 1 8 256]

For each token count it captures router + ``select_experts`` + ``fused_experts`` of four layers (each with its own
weights, so no layer finds its experts in L2) in one CUDA graph and times replays: that is the layer's device
time without Python launch cost, which an eager timing at small batch mostly measures. It prints the time per
layer and per decode step (all MoE layers) beside the bandwidth floor of the routed experts' weights, and, with
``--kernels``, a torch.profiler table of the kernels of one eager layer (device durations only).

``--fp8 --per-channel`` holds the FP8 experts with one scale per weight row (as ``--quantization fp8`` loads
them) instead of 128 × 128 blocks. ``--peer-vllm`` times vLLM's Triton ``fused_experts`` on the same routing, with
the experts as vLLM's ``quantization="fp8"`` holds them (one scale per expert; activations quantized per tensor),
in the same graph-replay way.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import measure_copy_bandwidth  # noqa: E402
from tune_moe import Layer, expert_weights  # noqa: E402  (also puts the worker package on the path)

from ominix_worker.config import ModelConfig, load_hf_config  # noqa: E402
from ominix_worker.ops import fused_moe  # noqa: E402
from ominix_worker.ops.moe_ref import select_experts  # noqa: E402

LAYERS = 4


def moe_layer(config: ModelConfig, layer: Layer, router: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    w13, w2, scales = layer
    weights, ids = select_experts(x @ router.t(), config.num_experts_per_tok, renormalize=True)
    return fused_moe.fused_experts(x, w13, w2, weights, ids, **scales)


def vllm_layers(layers: list[Layer]) -> list[Layer]:
    """The same experts as vLLM's online ``quantization="fp8"`` holds them: e4m3 with one scale per expert and
    projection (its activations are quantized per tensor at run time); bf16 layers as they are."""
    from ominix_worker.quant.fp8 import dequantize_fp8

    out: list[Layer] = []
    for w13, w2, scales in layers:
        if not scales:
            out.append((w13, w2, {}))
            continue
        per_tensor = []
        for q, s, block in (
            (w13, scales["w13_scale"], scales["w13_block"]),
            (w2, scales["w2_scale"], scales["w2_block"]),
        ):
            full = dequantize_fp8(q, s, block, torch.float32)
            scale = full.abs().amax(dim=(1, 2)).clamp(min=1e-12) / fused_moe.FP8_MAX
            per_tensor.append(((full / scale[:, None, None]).to(fused_moe.FP8_DTYPE), scale))
        out.append(
            (per_tensor[0][0], per_tensor[1][0], {"w1_scale": per_tensor[0][1], "w2_scale": per_tensor[1][1]})
        )
    return out


def vllm_moe_layer(config: ModelConfig, layer: Layer, router: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """vLLM 0.26's Triton ``fused_experts`` (W8A8 per tensor for FP8) after our router, on the same inputs."""
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts as vllm_fused_experts

    w13, w2, scales = layer
    weights, ids = select_experts(x @ router.t(), config.num_experts_per_tok, renormalize=True)
    quant = fp8_w8a8_moe_quant_config(**scales) if scales else None
    return vllm_fused_experts(x, w13, w2, weights.float(), ids.to(torch.int32), quant_config=quant)


def graph_time_us(fn, replays: int = 200) -> float:
    """Device time of ``fn`` per call, captured once in a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def kernel_table(fn) -> list[tuple[str, float, int]]:
    """(kernel name, device µs per call, launches per call) of one eager call, slowest first."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    calls = 20
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name[:70]] += event.device_time
            count[event.name[:70]] += 1
    rows = [(name, us / calls, count[name] // calls) for name, us in total.items()]
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="bench/configs/qwen3-30b-a3b-config.json")
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--per-channel", action="store_true", help="FP8 with one scale per output row")
    parser.add_argument(
        "--peer-vllm",
        action="store_true",
        help="also time vLLM's fused_experts on the same layers (vllm installed)",
    )
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument(
        "--kernels", type=int, nargs="*", default=[], help="token counts to profile by kernel"
    )
    args = parser.parse_args()
    config = load_hf_config(args.config)
    h, i = config.hidden_size, config.moe_intermediate_size
    gen = torch.Generator().manual_seed(0)
    layers = [expert_weights(config, args.fp8, gen, args.per_channel) for _ in range(LAYERS)]
    peer_layers = vllm_layers(layers) if args.peer_vllm else []
    routers = [(torch.randn((config.num_experts, h), generator=gen) / h**0.5).to(torch.bfloat16).cuda()
               for _ in range(LAYERS)]  # fmt: skip
    bandwidth = measure_copy_bandwidth()
    element = 1 if args.fp8 else 2
    moe_layers = len(config.moe_layers)
    print(f"{'fp8' if args.fp8 else 'bf16'} E={config.num_experts} top{config.num_experts_per_tok} H={h} I={i}, "
          f"{moe_layers} MoE layers, copy bandwidth {bandwidth / 1e12:.2f} TB/s")  # fmt: skip
    print(
        "tokens  distinct/layer  graph us/layer  step ms  floor ms  floor/graph"
        + ("  vLLM us/layer" if peer_layers else "")
    )
    for tokens in args.tokens:
        xs = [torch.randn((tokens, h), generator=gen).to(torch.bfloat16).cuda() for _ in range(LAYERS)]

        def run(xs: list[torch.Tensor] = xs) -> None:
            for layer, router, x in zip(layers, routers, xs, strict=True):
                moe_layer(config, layer, router, x)

        per_layer = graph_time_us(run) / LAYERS
        distinct = (
            sum(
                int(torch.unique(select_experts(x @ r.t(), config.num_experts_per_tok, True)[1]).numel())
                for x, r in zip(xs, routers, strict=True)
            )
            / LAYERS
        )
        floor_ms = distinct * 3 * h * i * element * moe_layers / bandwidth * 1e3
        step_ms = per_layer * moe_layers / 1e3
        peer = ""
        if peer_layers:

            def run_peer(xs: list[torch.Tensor] = xs) -> None:
                for layer, router, x in zip(peer_layers, routers, xs, strict=True):
                    vllm_moe_layer(config, layer, router, x)

            peer = f"  {graph_time_us(run_peer) / LAYERS:14.1f}"
        print(f"{tokens:6d}  {distinct:14.1f}  {per_layer:14.1f}  {step_ms:7.3f}  {floor_ms:8.3f}  "
              f"{floor_ms / step_ms:11.2f}{peer}", flush=True)  # fmt: skip
    for tokens in args.kernels:
        x = torch.randn((tokens, h), generator=gen).to(torch.bfloat16).cuda()
        print(f"\nkernels of one eager layer at {tokens} tokens (device µs per call, launches)")
        for name, us, n in kernel_table(lambda x=x: moe_layer(config, layers[0], routers[0], x)):
            print(f"  {us:8.1f}  x{n}  {name}")


if __name__ == "__main__":
    main()
