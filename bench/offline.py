"""Workload W1 end-to-end through the service, plus batch-1 latency and shared-prefix TTFT.

W1: 256 requests x 512 random prompt tokens x 256 output tokens (ignore_eos), all sent at once; then the same
prompts again, which the prefix cache should serve. Reports output tok/s of both passes and their ratio.
``--batch1``: one request (512-token prompt, 256 outputs) alone: TPOT. ``--shared-prefix``: request B shares a
2,048-token prefix with the finished request A: TTFT of A (cold) vs B (warm), one request at a time over one
open connection (a router's), whose first call is not timed.

Either targets a running engine (``--address``) or starts one (``--launch``; every argument this script does
not know is passed to ``ominix-runtime launch``), stopping it at the end:

    python bench/offline.py --launch --model dummy:bench/configs/llama8b-config.json --devices cuda:0 --all
    python bench/offline.py --address 127.0.0.1:50061 --num-requests 16 --input-len 128 --output-len 32

With ``--peer-hf`` it runs bench/peer_hf.py's static ``generate`` on the same workload afterwards (the service
is stopped first so both get the whole device), and on CUDA it divides by bench/roofline.py's estimate.
The comparison table is printed last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: import ``bench.*`` from the repository root.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.common import (  # noqa: E402
    exit_code_of,
    fmt,
    format_table,
    launch_service,
    run_while_alive,
    write_json,
    write_plot,
)
from bench.serve import (  # noqa: E402
    BenchConfig,
    BenchResult,
    ModelFacts,
    build_random_requests,
    fetch_backends,
    fetch_model_facts,
    format_report,
    run_benchmark,
    send_one,
)
from ominix_runtime.client import AsyncEngineClient  # noqa: E402
from ominix_runtime.models import DEFAULT_MODEL_NAME, embedded_model_path  # noqa: E402


@dataclass(slots=True)
class Row:
    measurement: str
    value: str
    unit: str
    note: str = ""


@dataclass(slots=True)
class OfflineReport:
    model: str = ""
    device: str = ""
    dtype: str = ""
    weight_dtype: str = ""  # the capability's: "float8_e4m3fn" for FP8 weights, "" for the run dtype
    rows: list[Row] = field(default_factory=list)
    figures: dict[str, float | None] = field(default_factory=dict)
    runs: dict[str, Any] = field(default_factory=dict)

    def add(
        self, key: str, value: float | None, label: str, unit: str, note: str = "", digits: int = 1
    ) -> None:
        self.figures[key] = value
        self.rows.append(Row(label, fmt(value, digits), unit, note))


def _config(args: argparse.Namespace, label: str, **overrides: Any) -> BenchConfig:
    base = BenchConfig(
        num_requests=args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
        num_channels=args.num_channels,
        client_procs=args.client_procs,
        batch_submit=args.batch_submit,
        label=label,
        progress=False if args.no_progress else None,
    )
    for name, value in overrides.items():
        setattr(base, name, value)
    return base


async def _warm_up(address: str, args: argparse.Namespace, facts: ModelFacts) -> None:
    """A few short requests with unrelated prompts: first-call costs stay out of the measured runs."""
    if args.warmup_requests <= 0:
        return
    config = _config(
        args,
        "warm-up",
        num_requests=args.warmup_requests,
        input_len=64,
        output_len=16,
        progress=False,
        client_procs=1,
    )
    requests = build_random_requests(config, facts, seed=args.seed + 1000)
    result = await run_benchmark(address, config, requests)
    if result.metrics.failed:
        raise RuntimeError(f"warm-up failed: {result.errors()[:3]}")


def _keep(report: OfflineReport, key: str, result: BenchResult, args: argparse.Namespace) -> None:
    print(format_report(result), flush=True)
    report.runs[key] = result.to_json(include_requests=not args.no_request_details)
    if args.plot_prefix:
        print(f"plot: {write_plot(f'{args.plot_prefix}{key}.png', result.plot_data())}", flush=True)
    if result.metrics.failed:
        raise RuntimeError(f"{key}: {result.metrics.failed} requests failed, e.g. {result.errors()[:3]}")


async def run_w1(address: str, args: argparse.Namespace, facts: ModelFacts, report: OfflineReport) -> None:
    config = _config(args, "W1 cold")
    requests = build_random_requests(config, facts)
    cold = await run_benchmark(address, config, requests)
    _keep(report, "w1_cold", cold, args)
    config.label = "W1 same prompts again (prefix cache)"
    warm = await run_benchmark(address, config, requests)
    _keep(report, "w1_prefix_cached", warm, args)
    shape = f"{args.num_requests} x {args.input_len} in x {args.output_len} out"
    report.add("w1_cold_out_tok_s", cold.metrics.output_throughput, f"W1 cold ({shape})", "out tok/s")
    cached_share = warm.metrics.total_cached_tokens / max(1, warm.metrics.total_input_tokens)
    report.add(
        "w1_cached_out_tok_s",
        warm.metrics.output_throughput,
        "W1 same prompts again",
        "out tok/s",
        f"{cached_share:.0%} of prompt tokens from cache",
    )
    ratio = (
        warm.metrics.output_throughput / cold.metrics.output_throughput if cold.metrics.completed else None
    )
    report.add("w1_cached_over_cold", ratio, "W1 prefix-cached / cold", "x", digits=2)
    report.add("w1_cold_ttft_p50_ms", cold.metrics.ttft.median_ms, "W1 cold TTFT median", "ms")
    report.add("w1_cold_tpot_p50_ms", cold.metrics.tpot.median_ms, "W1 cold TPOT median", "ms", digits=2)


async def run_batch1(
    address: str, args: argparse.Namespace, facts: ModelFacts, report: OfflineReport
) -> None:
    config = _config(
        args, "batch 1", num_requests=1, input_len=args.batch1_input_len, output_len=args.output_len
    )
    tpots = []
    result = None
    for trial in range(args.batch1_trials):
        requests = build_random_requests(config, facts, seed=args.seed + 2000 + trial)
        result = await run_benchmark(address, config, requests)
        if result.metrics.failed:
            raise RuntimeError(f"batch-1 request failed: {result.errors()}")
        tpots.append(result.metrics.tpot.mean_ms)
    assert result is not None
    _keep(report, "batch1", result, args)
    report.add(
        "batch1_tpot_ms",
        statistics.median(tpots),
        f"batch 1 TPOT ({args.batch1_input_len} in, {args.output_len} out)",
        "ms",
        f"median of {len(tpots)}",
        digits=2,
    )


async def run_shared_prefix(
    address: str, args: argparse.Namespace, facts: ModelFacts, report: OfflineReport
) -> None:
    """A (cold) then B sharing A's prefix (warm), one at a time, several fresh prefixes; medians."""
    config = _config(
        args,
        "shared prefix",
        num_requests=2,
        input_len=args.prefix_suffix_len,
        output_len=8,
        shared_prefix_len=args.prefix_len,
    )
    cold_ms: list[float] = []
    warm_ms: list[float] = []
    # B's send and first-token times (perf_counter, CLOCK_MONOTONIC on Linux, which every process on the host
    # shares): bench/service_summary.py lines them up with the worker's step log.
    warm_timeline: list[tuple[float, float]] = []
    cached = 0
    async with AsyncEngineClient(address) as client:
        await client.wait_ready(30.0)
        # The connection's first call is not timed: it sets up what every later call on it reuses.
        (untimed,) = build_random_requests(replace(config, num_requests=1), facts, seed=args.seed + 2999)
        await send_one(client, untimed, config, f"prefix-{uuid.uuid4().hex[:8]}-untimed")
        for trial in range(args.prefix_trials):
            first, second = build_random_requests(config, facts, seed=args.seed + 3000 + trial)
            tag = f"prefix-{uuid.uuid4().hex[:8]}-{trial}"
            a = await send_one(client, first, config, f"{tag}-a")
            b = await send_one(client, second, config, f"{tag}-b")
            ttft_ms = []
            for name, result in (("A", a), ("B", b)):
                if not result.success or result.first_token_time is None:
                    raise RuntimeError(f"shared-prefix request {name} failed: {result.error}")
                ttft_ms.append(result.first_token_time * 1e3)
            cold_ms.append(ttft_ms[0])
            warm_ms.append(ttft_ms[1])
            assert b.first_token_time is not None  # checked above
            warm_timeline.append((b.clock_origin + b.send_time, b.clock_origin + b.first_token_time))
            cached = b.cached_tokens
    report.runs["shared_prefix"] = {
        "ttft_cold_ms": cold_ms,
        "ttft_warm_ms": warm_ms,
        "warm_timeline_s": warm_timeline,
    }
    cold, warm = statistics.median(cold_ms), statistics.median(warm_ms)
    prompt = f"{args.prefix_len}+{args.prefix_suffix_len} tokens"
    report.add("prefix_ttft_cold_ms", cold, f"TTFT cold, {prompt}", "ms", digits=2)
    report.add(
        "prefix_ttft_warm_ms", warm, "TTFT warm (prefix shared)", "ms", f"{cached} tokens cached", digits=2
    )
    report.add(
        "prefix_ttft_cold_over_warm", cold / warm if warm > 0 else None, "TTFT cold / warm", "x", digits=2
    )


async def run_modes(address: str, args: argparse.Namespace, report: OfflineReport) -> None:
    facts = await fetch_model_facts(address)
    backends = await fetch_backends(address)
    report.model = facts.name
    if backends.backends:
        report.device = ", ".join(b.device for b in backends.backends)
        report.dtype = backends.backends[0].dtype
        report.weight_dtype = backends.backends[0].weight_dtype
    print(
        f"model {facts.name} on {report.device} ({report.dtype}) at {address}; W1 client processes: "
        f"{args.client_procs}",
        flush=True,
    )
    await _warm_up(address, args, facts)
    if args.w1:
        await run_w1(address, args, facts, report)
    if args.batch1:
        await run_batch1(address, args, facts, report)
    if args.shared_prefix:
        await run_shared_prefix(address, args, facts, report)


# ---------------------------------------------------------------- roofline and HF peer (other modules)


def _model_shape(config_path: str | None, dtype: str, weight_bytes: int = 0) -> Any:
    """bench/roofline.py's ModelShape from a config.json; its default (Llama-3.1-8B) when there is none.
    ``weight_bytes``: per stored weight element (1 for FP8), 0 for the run dtype's."""
    from bench.roofline import ModelShape

    dtype_bytes = 4 if dtype == "float32" else 2
    if not config_path:
        return ModelShape(dtype_bytes=dtype_bytes, weight_bytes=weight_bytes)
    raw = json.loads(Path(config_path).read_text())
    heads = int(raw["num_attention_heads"])
    return ModelShape(
        hidden=int(raw["hidden_size"]),
        layers=int(raw["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(raw.get("num_key_value_heads", heads)),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        ffn=int(raw["intermediate_size"]),
        vocab=int(raw["vocab_size"]),
        dtype_bytes=dtype_bytes,
        weight_bytes=weight_bytes,
    )


def _is_moe(config_path: str) -> bool:
    raw = json.loads(Path(config_path).read_text())
    return bool(raw.get("num_experts") or raw.get("num_local_experts"))


def add_roofline(args: argparse.Namespace, report: OfflineReport) -> None:
    """Achieved / roofline via bench/roofline.py: on CUDA (ceilings measured now, the service already
    stopped) or anywhere when --bandwidth and --flops are given."""
    given = args.bandwidth is not None and args.flops is not None
    if not (given or report.device.startswith("cuda")):
        return
    if not (report.figures.get("w1_cold_out_tok_s") or report.figures.get("batch1_tpot_ms")):
        return
    try:
        from bench import roofline
    except ImportError as exc:
        print(f"roofline skipped: {exc}", file=sys.stderr)
        return
    fp8 = "float8" in report.weight_dtype
    if given:
        bandwidth, flops, source = args.bandwidth, args.flops, "given ceilings"
    else:
        # FP8 weights: every FLOP at the FP8 tensor-core rate (an upper bound, so the result stays a ceiling).
        rate = roofline.measure_fp8_matmul_rate if fp8 else roofline.measure_matmul_rate
        bandwidth, flops = roofline.measure_copy_bandwidth(), rate()
        source = "measured ceilings"
    source += f": {bandwidth / 1e12:.2f} TB/s, {flops / 1e12:.0f} TFLOP/s" + (" FP8" if fp8 else "")
    if args.gpus > 1:
        # A tensor-parallel group reads and computes its shards side by side: the ceilings add up (all-reduce
        # time is left out, so this stays a floor).
        bandwidth, flops = bandwidth * args.gpus, flops * args.gpus
        source += f" per GPU x {args.gpus}"
    if args.model_config and _is_moe(args.model_config):
        # The W1 roofline models dense layers; bench/tune_moe.py reports the MoE decode floor instead.
        print("roofline skipped: mixture-of-experts config (see bench/tune_moe.py)", file=sys.stderr)
        return
    shape = _model_shape(args.model_config, report.dtype, weight_bytes=1 if fp8 else 0)
    if report.figures.get("w1_cold_out_tok_s"):
        roof = roofline.w1_roofline(
            bandwidth, flops, shape, args.num_requests, args.input_len, args.output_len, args.num_requests
        )
        report.add("w1_roofline_out_tok_s", roof.out_tok_s, "W1 roofline", "out tok/s", source)
        achieved = report.figures["w1_cold_out_tok_s"] / roof.out_tok_s
        report.add("w1_cold_over_roofline", achieved, "W1 cold / roofline", "x", digits=2)
    if report.figures.get("batch1_tpot_ms"):
        roof = roofline.w1_roofline(bandwidth, flops, shape, 1, args.batch1_input_len, args.output_len, 1)
        report.add("batch1_tpot_floor_ms", roof.batch1_tpot_floor_ms, "batch-1 TPOT floor", "ms", digits=2)
        report.add(
            "batch1_floor_over_tpot",
            roof.batch1_tpot_floor_ms / report.figures["batch1_tpot_ms"],
            "batch-1 TPOT floor / achieved",
            "x",
            digits=2,
        )


def _peer_model(args: argparse.Namespace, report: OfflineReport) -> str | None:
    if args.peer_model:
        return str(args.peer_model)
    if args.launch_model:
        return str(args.launch_model)
    if report.model == DEFAULT_MODEL_NAME:
        return str(embedded_model_path())
    return None  # peer_hf.py's own default: the Llama-3.1-8B-shaped config


def add_peer_hf(args: argparse.Namespace, report: OfflineReport) -> None:
    """bench/peer_hf.py's static generate on the same workload, in this process (the service is stopped)."""
    try:
        from bench import peer_hf
    except ImportError as exc:
        print(f"HF peer skipped: {exc}", file=sys.stderr)
        return
    device = report.device.split(",")[0].strip() or "cpu"
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "peer.json"
        argv = [
            "--device",
            device,
            "--batch",
            str(args.peer_batch),
            "--requests",
            str(args.num_requests),
            "--prompt-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            "--json",
            str(out),
        ]
        model = _peer_model(args, report)
        if model:
            argv += ["--model", model]
        if report.dtype:
            argv += ["--dtype", report.dtype]
        print(f"HF peer: bench/peer_hf.py {' '.join(argv)}", file=sys.stderr, flush=True)
        if peer_hf.main(argv) != 0 or not out.is_file():
            print("HF peer failed", file=sys.stderr)
            return
        outcome = json.loads(out.read_text())
    report.runs["hf_static"] = outcome
    peer_tok_s = float(outcome["out_tok_s"])
    report.add("hf_static_out_tok_s", peer_tok_s, f"HF static generate, batch {args.peer_batch}", "out tok/s")
    ours = report.figures.get("w1_cold_out_tok_s")
    if ours:
        report.add("w1_cold_over_hf", ours / peer_tok_s, "W1 cold / HF static", "x", digits=2)


# ---------------------------------------------------------------- command line


def _model_from(launch_args: Sequence[str]) -> str | None:
    """The ``--model`` value among the pass-through arguments, if any."""
    for i, arg in enumerate(launch_args):
        if arg == "--model" and i + 1 < len(launch_args):
            return launch_args[i + 1]
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
    return None


def _config_json_of(model: str | None) -> str | None:
    """The config.json behind ``dummy:PATH`` or an HF folder, if any."""
    if not model:
        return None
    path = Path(model[len("dummy:") :] if model.startswith("dummy:") else model)
    if path.is_dir() and (path / "config.json").is_file():
        return str(path / "config.json")
    return str(path) if path.suffix == ".json" and path.is_file() else None


def default_client_procs() -> int:
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: ``--model`` (passed on to launch) would otherwise be taken for ``--model-config``.
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--address", default=None, help="a running engine (default 127.0.0.1:50061)")
    target.add_argument("--launch", action="store_true", help="start `ominix-runtime launch` with free ports")
    parser.add_argument("--device", dest="devices_alias", default=None, help="same as launch's --devices")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for SERVING")
    parser.add_argument("--w1", action="store_true", help="W1 cold + prefix-cached (default mode)")
    parser.add_argument("--batch1", action="store_true", help="batch-1 TPOT")
    parser.add_argument("--shared-prefix", action="store_true", help="TTFT cold vs warm with a shared prefix")
    parser.add_argument("--all", action="store_true", help="every mode")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--batch1-input-len", type=int, default=512)
    parser.add_argument("--batch1-trials", type=int, default=3)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--prefix-suffix-len", type=int, default=64)
    parser.add_argument("--prefix-trials", type=int, default=3)
    parser.add_argument("--warmup-requests", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--num-channels", type=int, default=4, help="gRPC connections for the streams (per client process)"
    )
    parser.add_argument(
        "--client-procs",
        type=int,
        default=default_client_procs(),
        help="client processes sharing the W1 requests (default: one per 4 CPUs, at most 4): one process "
        "reading 512 streams runs out of CPU near 15k tokens/s",
    )
    parser.add_argument(
        "--batch-submit",
        action="store_true",
        help="W1: each client process sends its requests in one GenerateBatch call, not one call each",
    )
    parser.add_argument(
        "--peer-hf", action="store_true", help="then run bench/peer_hf.py on the same workload"
    )
    parser.add_argument("--peer-batch", type=int, default=128)
    parser.add_argument("--peer-model", default=None, help="model for the HF peer (default: the served one)")
    parser.add_argument("--model-config", default=None, help="config.json for the roofline (from dummy:...)")
    parser.add_argument(
        "--bandwidth", type=float, default=None, help="roofline ceiling, bytes/s (else measured)"
    )
    parser.add_argument("--flops", type=float, default=None, help="roofline ceiling, FLOP/s (else measured)")
    parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="GPUs serving the model (a TP group): the roofline's ceilings scale",
    )
    parser.add_argument("--out-json", default=None)
    parser.add_argument("--no-request-details", action="store_true")
    parser.add_argument("--plot-prefix", default=None, help="write PNGs named PREFIX<run>.png")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, launch_args = parser.parse_known_args(argv)
    if launch_args and not args.launch:
        parser.error(f"unknown arguments (only --launch passes arguments on): {launch_args}")
    if args.devices_alias:
        launch_args = [*launch_args, "--devices", args.devices_alias]
    if args.all:
        args.w1 = args.batch1 = args.shared_prefix = True
    if not (args.w1 or args.batch1 or args.shared_prefix):
        args.w1 = True
    args.launch_model = _model_from(launch_args) if args.launch else None
    args.model_config = args.model_config or _config_json_of(args.launch_model or args.peer_model)
    report = OfflineReport()
    started = time.time()
    if args.launch:
        with launch_service(launch_args, ready_timeout_s=args.ready_timeout) as service:
            run_while_alive(run_modes(service.address, args, report), service)
        print("service stopped", file=sys.stderr, flush=True)
    else:
        asyncio.run(run_modes(args.address or "127.0.0.1:50061", args, report))
    add_roofline(args, report)
    if args.peer_hf:
        add_peer_hf(args, report)
    if args.out_json:
        payload = {
            "started_at_unix": started,
            "model": report.model,
            "device": report.device,
            "dtype": report.dtype,
            "launch_args": launch_args if args.launch else None,
            "figures": report.figures,
            "runs": report.runs,
        }
        print(f"json: {write_json(args.out_json, payload)}")
    print()
    print(f"ominix-runtime offline benchmark: {report.model} on {report.device} ({report.dtype})")
    print(
        format_table(
            [(r.measurement, r.value, r.unit, r.note) for r in report.rows],
            ("measurement", "value", "unit", "note"),
        )
    )
    return 0 if all(v is None or math.isfinite(v) for v in report.figures.values()) else 1


if __name__ == "__main__":
    sys.exit(exit_code_of(main))
