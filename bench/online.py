"""Online serving at fixed request rates, saved in the result format of `vllm bench serve --save-result`.

An open-loop load generator over the engine's gRPC front API (``bench/serve.py``): for each rate in turn
(requests/s, Poisson arrivals; ``inf`` sends everything at once) it sends random token-id prompts of exactly
``--input-len`` tokens with ``ignore_eos`` and ``max_tokens = --output-len``, streams every response and
measures TTFT, TPOT = (E2EL - TTFT) / (output tokens - 1) and ITL per request. Each rate gets its own seed, so
no rate's prompts repeat another's (the prefix cache cannot help). One JSON list holds one result per rate,
each with the field names `vllm bench serve --save-result` writes (``request_rate``, ``completed``,
``request_goodput``, ``median_ttft_ms``, ``p99_tpot_ms``, ...), so ``bench/plot_online.py`` reads both.

    python bench/online.py run --address 127.0.0.1:50061 --rates 4,8,16,32,inf --out-json ours.json
    python bench/online.py run --launch --model dummy:/tmp/m --devices cuda:0 --out-json ours.json
    python bench/online.py num-prompts --rate 16 --seconds 15    # the count both systems get at a rate
    python bench/online.py model-dir --config bench/configs/llama8b-config.json --out /tmp/m

``model-dir`` writes a dummy model folder both servers can load: the config and a word-level tokenizer whose
token ``i`` is the word ``t<i>``, so any sequence of ordinary token ids decodes to text that encodes back to
exactly the same ids (`vllm bench serve`'s random prompts are text; their lengths stay exact).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.common import (  # noqa: E402
    exit_code_of,
    fmt,
    launch_service,
    percentile,
    run_while_alive,
    write_json,
)
from bench.openai_front import is_openai  # noqa: E402
from bench.serve import (  # noqa: E402
    BenchConfig,
    BenchResult,
    ModelFacts,
    build_random_requests,
    fetch_model_facts,
    openai_facts,
    run_benchmark,
    throughput_timeline,
)

DEFAULT_RATES = "4,8,16,32,inf"
BACKEND = "ominix-grpc"
OPENAI_BACKEND = "openai"  # an http:// address: /v1/completions (bench/openai_front.py)


# ---------------------------------------------------------------- the plan


def parse_rates(text: str) -> list[float]:
    """'4,8,inf' -> [4.0, 8.0, inf]; every finite rate must be positive."""
    rates = []
    for part in text.split(","):
        rate = float(part.strip())
        if not (math.isinf(rate) or rate > 0):
            raise ValueError(f"a request rate must be positive or inf, got {part!r}")
        rates.append(rate)
    if not rates:
        raise ValueError("no request rate given")
    return rates


def num_prompts(rate: float, seconds: float, inf_prompts: int, min_prompts: int) -> int:
    """Requests sent at ``rate``: ``seconds`` of arrivals (at least ``min_prompts``); ``inf_prompts`` at once."""
    if math.isinf(rate):
        return inf_prompts
    return max(min_prompts, round(rate * seconds))


def parse_percentiles(text: str) -> list[float]:
    """'50,99' -> [50.0, 99.0]; each within [0, 100] (``--percentiles``: checked as the arguments are read)."""
    try:
        values = [float(p) for p in text.split(",")]
    except ValueError:
        values = []
    if not values or any(not 0.0 <= v <= 100.0 for v in values):
        raise argparse.ArgumentTypeError(f"percentiles are numbers within [0, 100], got {text!r}")
    return values


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


# ---------------------------------------------------------------- the result, as vllm bench serve saves it


def _percentile_key(q: float) -> str:
    return str(int(q)) if int(q) == q else str(q)


def _latency_fields(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, Any]:
    """mean/median/std/p<q> of one metric in ms, under vLLM's key names; None where there is no value."""
    values_ms = [v * 1000.0 for v in values_s]
    fields: dict[str, Any] = {}
    if values_ms:
        mean = sum(values_ms) / len(values_ms)
        fields[f"mean_{name}_ms"] = mean
        fields[f"median_{name}_ms"] = percentile(values_ms, 50)
        fields[f"std_{name}_ms"] = math.sqrt(sum((v - mean) ** 2 for v in values_ms) / len(values_ms))
    else:
        fields.update({f"mean_{name}_ms": None, f"median_{name}_ms": None, f"std_{name}_ms": None})
    for q in percentiles:
        fields[f"p{_percentile_key(q)}_{name}_ms"] = percentile(values_ms, q) if values_ms else None
    return fields


# ITL tail thresholds (ms): the share of gaps at or above each tells fewer long gaps from shorter ones, e.g. which
# of two servers stalls fewer streams for a prefill step and which stalls them for less time.
ITL_TAIL_MS = (10, 15, 20, 25, 30, 50, 100, 200)


def itl_tail(gaps_s: Sequence[float]) -> dict[str, float | int]:
    """``itl_tail``: the number of gaps and, per threshold of ITL_TAIL_MS, the share of them at or above it."""
    gaps_ms = sorted(g * 1000.0 for g in gaps_s)
    tail: dict[str, float | int] = {"gaps": len(gaps_ms)}
    for ms in ITL_TAIL_MS:
        at_least = len(gaps_ms) - bisect.bisect_left(gaps_ms, ms)
        tail[f"share_at_least_{ms}ms"] = at_least / len(gaps_ms) if gaps_ms else 0.0
    return tail


# A stall: a run of consecutive gaps of one stream, each at least STALL_FACTOR times that stream's median gap and
# STALL_MIN_EXCESS_S above it (a step that carried a prompt, a host hiccup; a chunk of k tokens also leaves one
# gap of about k median gaps: ``multi_token_chunks`` counts those). A server that delivers a stalled step's tokens
# late and the next ones early spreads one stall over two gaps: a lower ITL p99 for the same wait. Counting the run
# as one stall, net of the short gaps right after it that make some of it up, compares what the streams waited,
# not how the wait was cut.
STALL_FACTOR = 1.5
STALL_MIN_EXCESS_S = 0.001  # a stream of sub-millisecond gaps has no stall of a fraction of one
STALL_PERCENTILES = (50, 90, 99)


def _stalls_of_stream(stream: Sequence[float]) -> list[tuple[float, float, int]]:
    """Each stall of one stream's gaps (seconds): its net excess (its gaps' time beyond as many median gaps, less
    what the gaps shorter than the median right after it made up), its longest gap, and how many gaps it spans."""
    median = statistics.median(stream)

    def long(gap: float) -> bool:
        return gap >= STALL_FACTOR * median and gap - median >= STALL_MIN_EXCESS_S

    stalls = []
    i = 0
    while i < len(stream):
        if not long(stream[i]):
            i += 1
            continue
        end = i
        while end < len(stream) and long(stream[end]):
            end += 1
        caught_up = end
        while caught_up < len(stream) and stream[caught_up] < median:
            caught_up += 1
        net = sum(stream[i:caught_up]) - median * (caught_up - i)
        stalls.append((net, max(stream[i:end]), end - i))
        i = caught_up
    return stalls


def itl_stalls(streams_s: Sequence[Sequence[float]]) -> dict[str, float | int | None]:
    """``itl_stalls`` of every stream's gaps (seconds; streams of fewer than 3 gaps are left out, their median
    says nothing): the gaps counted, the stalls and stalls per 1,000 gaps, each stall's net excess and its
    longest gap at STALL_PERCENTILES in ms, and the share of stalls that spanned more than one gap (each None
    without the gaps or stalls it is taken over)."""
    kept = [stream for stream in streams_s if len(stream) >= 3]
    found = [stall for stream in kept for stall in _stalls_of_stream(stream)]
    gaps = sum(len(stream) for stream in kept)
    stalls: dict[str, float | int | None] = {
        "gaps": gaps,
        "stalls": len(found),
        "stalls_per_1k_gaps": 1000.0 * len(found) / gaps if gaps else None,
        "multi_gap_share": sum(spans > 1 for _, _, spans in found) / len(found) if found else None,
    }
    for q in STALL_PERCENTILES:
        stalls[f"p{q}_excess_ms"] = percentile([1000.0 * n for n, _, _ in found], q) if found else None
        stalls[f"p{q}_longest_ms"] = percentile([1000.0 * g for _, g, _ in found], q) if found else None
    return stalls


def to_vllm_result(
    result: BenchResult,
    *,
    label: str,
    model_id: str,
    percentiles: Sequence[float] = (50.0, 99.0),
    detailed: bool = False,
) -> dict[str, Any]:
    """One rate's run as `vllm bench serve --save-result` writes it (``--save-detailed`` adds the per-request
    lists, and ``successes``). This tool's own fields: ``slo_ttft_ms`` and ``slo_tpot_ms``, the SLOs goodput
    used, ``itl_tail`` (``itl_tail()`` of every gap), ``itl_stalls`` (``itl_stalls()`` of every successful
    stream), and over the successful requests ``token_chunks`` and ``multi_token_chunks`` (chunks that carried
    more than one token: tokens that were ready together, because the engine applied several steps at once or
    a stream's reader fell behind, go out as one message, and a chunk of k tokens leaves one gap where there
    would have been k, so merging raises the mean ITL; None over OpenAI HTTP, whose chunks are counted as one
    token each)."""
    config = result.config
    metrics = result.metrics
    done = [r for r in result.requests if r.success]
    peak = throughput_timeline(result.requests, metrics.duration_s, 1.0)  # vLLM's peak: 1 s bins
    payload: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S", time.localtime(result.started_at_unix)),
        "endpoint_type": OPENAI_BACKEND if is_openai(result.address) else BACKEND,
        "backend": OPENAI_BACKEND if is_openai(result.address) else BACKEND,
        "label": label,
        "model_id": model_id,
        "tokenizer_id": None,
        "num_prompts": len(result.requests),
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "duration": metrics.duration_s,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input_tokens,
        "total_output_tokens": metrics.total_output_tokens,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.goodput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": max(peak.output_tokens_per_s, default=0.0),
        "slo_ttft_ms": config.slo_ttft_ms,
        "slo_tpot_ms": config.slo_tpot_ms,
        "token_chunks": None if is_openai(result.address) else sum(len(r.chunk_tokens) for r in done),
        "multi_token_chunks": (
            None if is_openai(result.address) else sum(n > 1 for r in done for n in r.chunk_tokens)
        ),
    }
    payload.update(_latency_fields("ttft", [r.ttft_s for r in done if r.ttft_s is not None], percentiles))
    payload.update(_latency_fields("tpot", [r.tpot_s for r in done if r.tpot_s is not None], percentiles))
    payload.update(_latency_fields("itl", [gap for r in done for gap in r.itls_s], percentiles))
    payload["itl_tail"] = itl_tail([gap for r in done for gap in r.itls_s])
    payload["itl_stalls"] = itl_stalls([r.itls_s for r in done])
    payload.update(_latency_fields("e2el", [r.e2el_s for r in done], percentiles))
    if detailed:
        payload.update(
            {
                "input_lens": [r.prompt_tokens for r in result.requests],
                "output_lens": [r.output_tokens for r in result.requests],
                "ttfts": [r.ttft_s or 0.0 for r in result.requests],
                "itls": [r.itls_s for r in result.requests],
                "latencies": [r.e2el_s for r in result.requests],
                "start_times": [r.send_time for r in result.requests],
                # This tool's own: time.perf_counter() at the run's start, to which start_times are relative
                # (one clock for every process of the host: bench/step_gaps.py reads a worker's step log by it).
                "started_perf": result.started_perf,
                "errors": [r.error for r in result.requests],
                # This tool's own too: a stream can end unsuccessfully with no error message.
                "successes": [r.success for r in result.requests],
            }
        )
    return payload


# ---------------------------------------------------------------- the run


def format_rate_line(result: dict[str, Any]) -> str:
    def ms(key: str) -> str:
        return fmt(result.get(key), 1)

    chunks, multi = result.get("token_chunks"), result.get("multi_token_chunks")
    merged = f", {100.0 * multi / chunks:.1f}% of chunks >1 token" if chunks and multi is not None else ""
    stalls = ""
    if found := result.get("itl_stalls"):
        split = found["multi_gap_share"]
        stalls = (
            f" stalls {fmt(found['stalls_per_1k_gaps'], 1)}/1k gaps (net p50 {fmt(found['p50_excess_ms'], 1)}"
            f" ms, {fmt(None if split is None else 100.0 * split, 0)}% over 2+ gaps),"
        )
    return (
        f"rate {str(result['request_rate']):>4}: {result['completed']}/{result['num_prompts']} ok,"
        f" {fmt(result['duration'], 1)} s, out {fmt(result['output_throughput'], 0)} tok/s,"
        f" TTFT p50/p99 {ms('median_ttft_ms')}/{ms('p99_ttft_ms')} ms,"
        f" TPOT p50/p99 {ms('median_tpot_ms')}/{ms('p99_tpot_ms')} ms,"
        f" ITL p50/p99 {ms('median_itl_ms')}/{ms('p99_itl_ms')} ms,{stalls}"
        f" goodput {fmt(result['request_goodput'], 2)} req/s{merged}"
    )


async def served_facts(address: str, args: argparse.Namespace) -> tuple[ModelFacts, str]:
    """The served model's facts, and the model name a request names (empty: the engine's only model)."""
    if is_openai(address):
        if not args.model_config:
            raise SystemExit(f"{address}: an OpenAI-compatible server needs --model-config (its vocabulary)")
        facts = await openai_facts(address, args.model_config)
        return facts, facts.name  # asked once here, not again for every rate
    return await fetch_model_facts(address), ""


async def warm_up(
    address: str, facts: ModelFacts, model: str, args: argparse.Namespace, label: str = ""
) -> None:
    """``--warmup-requests`` short requests at once (not saved); nothing when it is 0. ``label`` heads its line."""
    if args.warmup_requests <= 0:
        return
    warm = BenchConfig(
        num_requests=args.warmup_requests,
        input_len=args.input_len,
        output_len=args.warmup_output_len,
        seed=args.seed + 10_000,
        progress=False,
        model=model,
    )
    started = time.monotonic()
    warmed = await run_benchmark(address, warm, build_random_requests(warm, facts))
    head = f"{label}: " if label else ""
    print(
        f"{head}warm-up: {warmed.metrics.completed}/{args.warmup_requests} ok"
        f" in {time.monotonic() - started:.1f} s",
        flush=True,
    )


async def run_rate(
    address: str,
    facts: ModelFacts,
    model: str,
    rate: float,
    seed: int,
    args: argparse.Namespace,
    label: str,
) -> dict[str, Any]:
    """One rate's run (its arrival schedule and prompts drawn from ``seed``) as a vLLM-style result."""
    config = BenchConfig(
        num_requests=num_prompts(rate, args.seconds, args.inf_prompts, args.min_prompts),
        request_rate=rate,
        burstiness=args.burstiness,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=seed,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        num_channels=args.num_channels,
        request_timeout_s=args.request_timeout,
        progress=False if args.no_progress else None,
        label=f"{label} @ {rate_label(rate)} req/s",
        model=model,
    )
    result = await run_benchmark(address, config, build_random_requests(config, facts))
    saved = to_vllm_result(
        result,
        label=label,
        model_id=facts.name,
        percentiles=args.percentiles,
        detailed=args.save_detailed,
    )
    print(format_rate_line(saved), flush=True)
    if result.metrics.failed:
        print(f"  first errors: {result.errors()[:3]}", flush=True)
    return saved


async def run_rates(address: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The warm-up (not saved), then every rate in turn; returns one vLLM-style result per rate."""
    facts, model = await served_facts(address, args)
    await warm_up(address, facts, model, args)
    results = []
    for index, rate in enumerate(parse_rates(args.rates)):
        # distinct prompts per rate: no rate is served from another's cache
        results.append(await run_rate(address, facts, model, rate, args.seed + index, args, args.label))
        if args.out_json:  # after every rate: a run cut short still leaves the rates it finished
            write_json(args.out_json, results)
    return results


async def _run_and_save(address: str, args: argparse.Namespace) -> int:
    results = await run_rates(address, args)
    if args.out_json:
        print(f"json: {args.out_json}", flush=True)
    return 0 if all(r["failed"] == 0 for r in results) else 1


# ---------------------------------------------------------------- the dummy model folder


def write_model_dir(config_path: str | Path, out: str | Path) -> Path:
    """``out`` with config.json (copied) and a word-level tokenizer of the config's vocab_size: token ``i`` is
    the word ``t<i>``, and bos and eos (from the config) are the special tokens ``<|t<i>|>``, which no other
    word contains. Text of such words encodes to exactly the ids it was decoded from, so both servers see the
    same prompt lengths."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads(Path(config_path).read_text())
    shutil.copyfile(config_path, folder / "config.json")
    vocab_size = int(config["vocab_size"])
    special = {k: int(config[k]) for k in ("bos_token_id", "eos_token_id") if isinstance(config.get(k), int)}

    def word(i: int) -> str:
        return f"<|t{i}|>" if i in special.values() else f"t{i}"

    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": word(i),
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i in sorted(set(special.values()))
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,  # no decoder: tokens are joined with single spaces
        "model": {
            "type": "WordLevel",
            "vocab": {word(i): i for i in range(vocab_size)},
            "unk_token": word(0),
        },
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(config.get("max_position_embeddings", 2048)),
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
    }
    if "bos_token_id" in special:
        tokenizer_config["bos_token"] = word(special["bos_token_id"])
    if "eos_token_id" in special:
        tokenizer_config["eos_token"] = word(special["eos_token_id"])
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    return folder


# ---------------------------------------------------------------- command line


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The load's shape (rates, lengths, SLOs, warm-up), shared by ``run`` and bench/online_ab.py."""
    parser.add_argument(
        "--model-config",
        default=None,
        help="with an http:// address: the served model's config.json (vocabulary)",
    )
    parser.add_argument("--rates", default=DEFAULT_RATES, help="comma-separated req/s; inf = all at once")
    parser.add_argument("--seconds", type=float, default=15.0, help="seconds of arrivals per finite rate")
    parser.add_argument("--inf-prompts", type=int, default=256, help="requests sent at once for rate inf")
    parser.add_argument("--min-prompts", type=int, default=16, help="fewest requests at a finite rate")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    parser.add_argument("--seed", type=int, default=0, help="rate i uses seed + i")
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0)
    parser.add_argument("--percentiles", default="50,99", type=parse_percentiles, help="comma-separated")
    parser.add_argument("--warmup-requests", type=int, default=16, help="sent at once before the rates")
    parser.add_argument("--warmup-output-len", type=int, default=16)
    parser.add_argument("--num-channels", type=int, default=1)
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--save-detailed", action="store_true", help="add the per-request lists")
    parser.add_argument("--no-progress", action="store_true")


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default="127.0.0.1:50061",
        help="the engine's gRPC address, or http://host:port of an OpenAI-compatible server (vllm serve)",
    )
    add_load_arguments(parser)
    parser.add_argument("--label", default="ominix")
    parser.add_argument("--out-json", default=None, help="one JSON list: a result per rate")
    parser.add_argument(
        "--launch",
        action="store_true",
        help="start `ominix-runtime launch` on free ports (unknown arguments go to it) and stop it at the end",
    )
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait with --launch")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_arguments(sub.add_parser("run", help="the rates against a service, results as JSON"))
    count = sub.add_parser("num-prompts", help="print how many requests a rate gets")
    count.add_argument("--rate", type=float, required=True)
    count.add_argument("--seconds", type=float, default=15.0)
    count.add_argument("--inf-prompts", type=int, default=256)
    count.add_argument("--min-prompts", type=int, default=16)
    model = sub.add_parser("model-dir", help="write a dummy model folder with a word-level tokenizer")
    model.add_argument("--config", required=True, help="a Hugging Face config.json")
    model.add_argument("--out", required=True)
    args, extra = parser.parse_known_args(argv)
    if args.command == "num-prompts":
        print(num_prompts(args.rate, args.seconds, args.inf_prompts, args.min_prompts))
        return 0
    if args.command == "model-dir":
        print(write_model_dir(args.config, args.out))
        return 0
    if not args.launch:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return asyncio.run(_run_and_save(args.address, args))
    with launch_service(extra, ready_timeout_s=args.ready_timeout) as service:
        return run_while_alive(_run_and_save(service.address, args), service)


if __name__ == "__main__":
    sys.exit(exit_code_of(main))
