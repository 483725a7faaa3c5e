"""W1 roofline: the fastest a GPU could possibly run workload W1, from two measured ceilings.

Measures the device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate (8192³ on random
data, median of repeats), then bounds W1 (Llama-3.1-8B shape, 256 requests × 512 prompt tokens × 256 output
tokens, all admitted at once): prefill is bounded by its FLOPs at the matmul rate; every decode step must read
the weights once and every running request's KV once at the copy bandwidth (or its FLOPs, whichever is slower).

    python bench/roofline.py [--json out.json]          # measure on the local GPU
    python bench/roofline.py --bandwidth 3.0e12 --flops 7.98e14   # no GPU: use given ceilings

``w1_roofline`` is importable (no torch needed) for the offline benchmark to report "fraction of roofline".
For a model with FP8 weights the offline benchmark counts one byte per projection weight (the LM head and norms
stay in the run dtype, as ``--quantization fp8`` leaves them) and the FP8 matmul rate
(``measure_fp8_matmul_rate``: ``torch._scaled_mm`` with row-wise scales, 8192³) for every FLOP, attention's
included; that overstates what attention can reach, so the figure stays a ceiling.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class ModelShape:
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336
    vocab: int = 128256
    dtype_bytes: int = 2  # activations and KV
    weight_bytes: int = 0  # per element of the layers' projections; 0: dtype_bytes (1 for FP8 weights)

    @property
    def layer_matmul_params(self) -> int:
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.ffn
        return qkv + o + mlp

    @property
    def weight_bytes_per_step(self) -> int:
        """Bytes a forward step must read: every layer's matrices, the norms and the LM head (the embedding
        table is gathered, a few rows per step, so it is left out)."""
        # FP8 quantizes the layers' projections; the LM head and the norms stay in the run dtype.
        projections = self.layers * self.layer_matmul_params * (self.weight_bytes or self.dtype_bytes)
        return (
            projections + (self.vocab * self.hidden + (2 * self.layers + 1) * self.hidden) * self.dtype_bytes
        )

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class Roofline:
    prefill_s: float
    decode_s: float
    total_s: float
    output_tokens: int
    out_tok_s: float
    prefill_flops: float
    decode_step_bytes_mean: float
    decode_step_s_mean: float
    batch1_tpot_floor_ms: float


def w1_roofline(
    bandwidth: float,
    flops: float,
    shape: ModelShape | None = None,
    num_requests: int = 256,
    prompt_len: int = 512,
    output_len: int = 256,
    max_running: int = 256,
) -> Roofline:
    """Lower bound on W1's wall time. ``bandwidth`` in bytes/s (read + written), ``flops`` in FLOP/s.

    Requests run in waves of ``max_running``; each wave prefills its prompts (the first output token comes from
    the prefill logits) and then takes ``output_len - 1`` decode steps. Per decode step the time is the larger of
    bytes/bandwidth and FLOPs/rate; prefill is FLOP-bound (its weights are read once per wave at most).
    """
    s = shape or ModelShape()
    q_width = s.heads * s.head_dim
    prefill_s = decode_s = prefill_flops_total = 0.0
    step_bytes_sum = 0.0
    steps = 0
    remaining = num_requests
    while remaining > 0:
        batch = min(remaining, max_running)
        remaining -= batch
        tokens = batch * prompt_len
        # Matmuls over every prompt token (LM head only for each prompt's last token), causal attention:
        # QKᵀ and PV cost 2·2·q_width FLOPs per visible (query, key) pair.
        pairs = batch * prompt_len * (prompt_len + 1) / 2
        f = 2 * s.layers * s.layer_matmul_params * tokens + 2 * s.vocab * s.hidden * batch
        f += 4 * q_width * pairs * s.layers
        prefill_flops_total += f
        prefill_s += max(f / flops, s.weight_bytes_per_step / bandwidth)
        for step in range(1, output_len):
            context = prompt_len + step  # tokens in the cache once this step's token is written
            kv_read = batch * context * s.kv_bytes_per_token
            step_bytes = s.weight_bytes_per_step + kv_read
            step_flops = 2 * (s.layers * s.layer_matmul_params + s.vocab * s.hidden) * batch
            step_flops += 4 * q_width * batch * context * s.layers
            decode_s += max(step_bytes / bandwidth, step_flops / flops)
            step_bytes_sum += step_bytes
            steps += 1
    total = prefill_s + decode_s
    output_tokens = num_requests * output_len
    batch1_bytes = s.weight_bytes_per_step + (prompt_len + output_len // 2) * s.kv_bytes_per_token
    return Roofline(
        prefill_s=prefill_s,
        decode_s=decode_s,
        total_s=total,
        output_tokens=output_tokens,
        out_tok_s=output_tokens / total,
        prefill_flops=prefill_flops_total,
        decode_step_bytes_mean=step_bytes_sum / max(steps, 1),
        decode_step_s_mean=decode_s / max(steps, 1),
        batch1_tpot_floor_ms=1e3 * batch1_bytes / bandwidth,
    )


def measure_copy_bandwidth(num_bytes: int = 2 << 30, repeats: int = 20) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written (median of repeats)."""
    import torch

    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = _time_cuda(lambda: dst.copy_(src), repeats)
    return 2 * num_bytes / _median(times)


def measure_matmul_rate(n: int = 8192, repeats: int = 20) -> float:
    """bf16 n×n×n matmul rate in FLOP/s on random data (median of repeats)."""
    import torch

    a = torch.randn((n, n), dtype=torch.bfloat16, device="cuda")
    b = torch.randn((n, n), dtype=torch.bfloat16, device="cuda")
    c = torch.empty((n, n), dtype=torch.bfloat16, device="cuda")
    times = _time_cuda(lambda: torch.matmul(a, b, out=c), repeats)
    return 2 * n**3 / _median(times)


def measure_fp8_matmul_rate(n: int = 8192, repeats: int = 20) -> float:
    """e4m3 n×n×n ``torch._scaled_mm`` rate in FLOP/s (row-wise float32 scales, bf16 out; median of repeats)."""
    import torch

    a = torch.randn((n, n), device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn((n, n), device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt needs
    scale_a = torch.ones((n, 1), device="cuda")
    scale_b = torch.ones((1, n), device="cuda")
    times = _time_cuda(
        lambda: torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16), repeats
    )
    return 2 * n**3 / _median(times)


def _time_cuda(fn: Callable[[], object], repeats: int) -> list[float]:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bandwidth", type=float, help="bytes/s (read+written); measured when omitted")
    parser.add_argument("--flops", type=float, help="bf16 FLOP/s; measured when omitted")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    device = "given"
    if args.bandwidth is None or args.flops is None:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: pass --bandwidth and --flops", file=sys.stderr)
            return 2
        device = torch.cuda.get_device_name()
    bandwidth = args.bandwidth or measure_copy_bandwidth()
    flops = args.flops or measure_matmul_rate()
    roof = w1_roofline(
        bandwidth, flops, None, args.requests, args.prompt_len, args.output_len, args.max_running
    )
    shape = ModelShape()
    print(f"device            {device}")
    print(f"copy bandwidth    {bandwidth / 1e12:.3f} TB/s (read+written)")
    print(f"bf16 matmul       {flops / 1e12:.1f} TFLOP/s (8192^3, random data)")
    print(
        f"weights/step      {shape.weight_bytes_per_step / 1e9:.2f} GB; KV/token {shape.kv_bytes_per_token} B"
    )
    print(f"W1 prefill        {roof.prefill_s:.3f} s ({roof.prefill_flops / 1e15:.2f} PFLOP)")
    print(f"W1 decode         {roof.decode_s:.3f} s ({roof.decode_step_s_mean * 1e3:.2f} ms/step mean)")
    print(f"W1 total          {roof.total_s:.3f} s -> ceiling {roof.out_tok_s:,.0f} out tok/s")
    print(f"batch-1 TPOT floor {roof.batch1_tpot_floor_ms:.2f} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"device": device, "bandwidth": bandwidth, "flops": flops, **asdict(roof)}, fh, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
