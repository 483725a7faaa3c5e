"""Paired online comparison: several servers, resident on one GPU at once, driven in turn with the same load.

A single online run per system cannot separate a few percent of difference from the machine's own drift: the
same code read 18 and 31 ms of ITL p99 at 4 req/s on two machines of one day. Here every server (ours with
different flags, `vllm serve`) is loaded at the same time and idles while another is driven, so the runs of one
round follow each other within minutes on one device. In each round and at each rate every server gets the
same arrival schedule and the same prompts (drawn from ``seed + 1000 * round + rate index``); the order of
the servers turns by one each rate and round, so none always runs first (each still follows the same
neighbour). ``table`` compares each server with
the baseline round by round: the median of the paired ratios, their range, and in how many rounds the
server was at least as good. With ``--steps LABEL=URL`` (a server's Prometheus endpoint) each run of that
server also records the steps it ran and their tokens (bench/step_mix.py), and the table adds them. Every
run's result carries its ``itl_tail`` (bench/online.py: the share of gaps at or above 10 – 200 ms), and the
table adds those too: two servers with one ITL p99 can stall more gaps or stall them for longer; and its
``itl_stalls`` (runs of long gaps counted as one stall each), which tells a server that spreads one stall over
two gaps (a lower ITL p99) from one that stalls its streams for less.

    python bench/online_ab.py run --server ominix=127.0.0.1:50061 --server vllm=http://127.0.0.1:8000 \\
        --steps ominix=http://127.0.0.1:9400/metrics --steps vllm=http://127.0.0.1:8000/metrics \\
        --model-config /tmp/m/config.json --rates 4,8,16 --rounds 2 --seconds 25 --out-json ab.json
    python bench/online_ab.py table ab.json ab_more.json --baseline vllm --out-md ab.md --png ab.png

bench/online_service.sh runs it on a GPU machine (stages ab-start, ab-run, ab-stop, ab-table).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import math
import statistics
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.common import (  # noqa: E402
    WatchedProcess,
    exit_code_of,
    format_table,
    median_range,
    read_json,
    run_while_all_alive,
    watch_spec,
    write_json,
)
from bench.online import (  # noqa: E402
    ITL_TAIL_MS,
    STALL_FACTOR,
    add_load_arguments,
    itl_stalls,
    parse_rates,
    rate_label,
    run_rate,
    served_facts,
    warm_up,
)
from bench.plot_online import COLUMNS, Series, rate_of, write_png  # noqa: E402
from bench.serve import ModelFacts  # noqa: E402
from bench.step_mix import StepTotals, scrape_step_totals, step_mix  # noqa: E402

T = TypeVar("T")

ROUND_SEED_STRIDE = 1000  # round r, rate i: seed + 1000 * r + i (no two runs of a round share prompts)
HIGHER_IS_BETTER = frozenset({"output_throughput", "request_goodput"})


@dataclass(frozen=True, slots=True)
class Server:
    """One server under comparison: a label and an address (gRPC host:port, or http:// for OpenAI)."""

    label: str
    address: str


def _labelled(text: str, usage: str) -> Server:
    label, sep, address = text.partition("=")
    if not sep or not label or not address:
        raise argparse.ArgumentTypeError(f"{usage}, got {text!r}")
    return Server(label, address)


def parse_server(text: str) -> Server:
    return _labelled(text, "a server is LABEL=ADDRESS")


def parse_steps_endpoint(text: str) -> Server:
    """--steps LABEL=URL: the labelled server's Prometheus endpoint (as its address)."""
    return _labelled(text, "--steps is LABEL=URL (a server's Prometheus endpoint)")


def run_order(servers: Sequence[Server], round_index: int, rate_index: int) -> list[Server]:
    """The servers in the order they run at one rate of one round: turned by one per rate and per round."""
    shift = (round_index + rate_index) % len(servers)
    return [*servers[shift:], *servers[:shift]]


def round_seed(seed: int, round_index: int, rate_index: int) -> int:
    return seed + ROUND_SEED_STRIDE * round_index + rate_index


async def read_steps(url: str) -> StepTotals | str:
    """A server's step totals now, or why they could not be read (the run goes on without them)."""
    try:
        totals = await asyncio.to_thread(scrape_step_totals, url)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return f"{url}: {exc!r}"
    return totals if totals is not None else f"{url}: no step-token histogram"


def steps_of_run(before: StepTotals | str, after: StepTotals | str) -> dict[str, Any]:
    """The record's ``steps``: the run's step mix, or ``error`` with why there is none."""
    if isinstance(before, str):
        return {"error": before}
    if isinstance(after, str):
        return {"error": after}
    try:
        return step_mix(before, after)
    except ValueError as exc:
        return {"error": str(exc)}


async def run_rounds(servers: Sequence[Server], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every round, rate and server in turn; one record per run: label, round, rate index, position, result,
    and the step mix of servers with a metrics endpoint (``--steps``)."""
    labels = [s.label for s in servers]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"server labels must differ: {labels}")
    metrics = {endpoint.label: endpoint.address for endpoint in args.steps}
    if set(metrics) - set(labels):
        raise SystemExit(f"--steps names servers that are not compared: {sorted(set(metrics) - set(labels))}")
    facts: dict[str, tuple[ModelFacts, str]] = {}
    for server in servers:
        facts[server.label] = await served_facts(server.address, args)
    vocabularies = {(f.vocab_size, f.special_ids) for f, _ in facts.values()}
    if len(vocabularies) != 1:  # the prompts are drawn from the vocabulary: they must be the same for all
        raise SystemExit("the servers report different vocabularies: they do not serve the same model")
    for server in servers:
        await warm_up(server.address, *facts[server.label], args, label=server.label)
    rates = parse_rates(args.rates)
    records: list[dict[str, Any]] = []
    for round_index in range(args.first_round, args.first_round + args.rounds):
        for rate_index, rate in enumerate(rates):
            seed = round_seed(args.seed, round_index, rate_index)
            for position, server in enumerate(run_order(servers, round_index, rate_index)):
                url = metrics.get(server.label)
                before = await read_steps(url) if url else None
                print(f"round {round_index}, {server.label}: ", end="", flush=True)
                result = await run_rate(server.address, *facts[server.label], rate, seed, args, server.label)
                record = {
                    "label": server.label,
                    "round": round_index,
                    "rate_index": rate_index,
                    "position": position,
                    "seed": seed,
                    "result": result,
                }
                if url and before is not None:
                    record["steps"] = steps_of_run(before, await read_steps(url))
                    if "error" in record["steps"]:
                        print(
                            f"  {server.label}: no step mix for this run ({record['steps']['error']})",
                            flush=True,
                        )
                records.append(record)
                if args.out_json:  # after every run: a call cut short keeps what it finished
                    write_json(args.out_json, records)
    return records


# ---------------------------------------------------------------- the table


def load_records(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Every run of the given files (gzip-compressed where the name ends in .gz: ``--save-detailed`` runs are
    large); a server, round and rate found twice is an error (two runs that reused round numbers, hence seeds:
    the second could be served from the first's prefix cache)."""
    records: list[dict[str, Any]] = []
    seen: dict[tuple[str, int, float], str] = {}
    for path in paths:
        for record in read_json(path):
            run = (record["label"], record["round"], rate_of(record["result"]))
            if run in seen:
                raise SystemExit(
                    f"{path}: {run[0]} ran round {run[1]} at {rate_label(run[2])} req/s already in {seen[run]}"
                )
            seen[run] = str(path)
            records.append(record)
    return records


def results_of(records: Sequence[dict[str, Any]], label: str, rate: float) -> list[dict[str, Any]]:
    return [r["result"] for r in records if r["label"] == label and rate_of(r["result"]) == rate]


def paired_ratios(
    records: Sequence[dict[str, Any]], label: str, baseline: str, rate: float, key: str
) -> list[tuple[float, bool]]:
    """Per round where both ran this rate: label's figure over the baseline's, and whether label was at least
    as good (lower latency, higher throughput)."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for record in records:
        if rate_of(record["result"]) == rate and record["label"] in (label, baseline):
            by_round.setdefault(record["round"], {})[record["label"]] = record["result"]
    pairs = []
    for runs in by_round.values():
        if label not in runs or baseline not in runs:
            continue
        ours, base = runs[label].get(key), runs[baseline].get(key)
        if ours is None or base is None:
            continue
        better = ours >= base if key in HIGHER_IS_BETTER else ours <= base
        if base:
            pairs.append((ours / base, better))
        else:  # e.g. a goodput of 0: the ratio is infinite (or level at 0 / 0)
            pairs.append((math.inf if ours else 1.0, better))
    return pairs


def format_ab_table(records: Sequence[dict[str, Any]], baseline: str) -> str:
    """Per rate: each server's median over rounds (range in brackets), then each server against the baseline:
    the median paired ratio (range) and in how many rounds it was at least as good."""
    labels = list(dict.fromkeys(r["label"] for r in records))
    if baseline not in labels:
        raise SystemExit(f"baseline {baseline!r} is not among the servers {labels}")
    rates = sorted({rate_of(r["result"]) for r in records})
    header = ["server", "rate", "rounds", "failed", *[c[0] for c in COLUMNS]]
    rows = []
    for rate in rates:
        for label in labels:
            runs = results_of(records, label, rate)
            if not runs:
                continue
            cells = []
            for _, key, digits in COLUMNS:
                values = [run[key] for run in runs if run.get(key) is not None]
                cells.append(median_range(values, digits))
            failed = sum(run.get("failed", 0) for run in runs)
            rows.append([label, rate_label(rate), str(len(runs)), str(failed), *cells])
        for label in labels:
            if label == baseline:
                continue
            cells = []
            for _, key, _ in COLUMNS:
                pairs = paired_ratios(records, label, baseline, rate, key)
                if not pairs:
                    cells.append("-")
                    continue
                wins = sum(better for _, better in pairs)
                cells.append(f"{median_range([r for r, _ in pairs], 2, '×')} {wins}/{len(pairs)}")
            rows.append([f"{label}/{baseline}", rate_label(rate), "", "", *cells])
    return format_table(rows, header)


def by_rate_and_server(items: Sequence[tuple[dict[str, Any], T]]) -> Iterator[tuple[float, str, list[T]]]:
    """(rate, server, values) of (record, value) pairs: rates ascending, servers in the order first seen, and
    only where a server has values at that rate."""
    for rate in sorted({rate_of(r["result"]) for r, _ in items}):
        for label in dict.fromkeys(r["label"] for r, _ in items):
            values = [v for r, v in items if r["label"] == label and rate_of(r["result"]) == rate]
            if values:
                yield rate, label, values


def format_steps_table(records: Sequence[dict[str, Any]]) -> str | None:
    """Per rate and server with step readings: the runs read and not read, and the median over the runs read
    (range) of the steps run, steps a second, tokens per step, preemptions and the KV capacity in tokens; None
    when no run tried a reading."""
    tried = [(r, r) for r in records if "steps" in r]
    if not tried:
        return None
    rows = []
    for rate, label, runs in by_rate_and_server(tried):
        read = [r for r in runs if "error" not in r["steps"]]
        steps = [r["steps"]["steps"] for r in read]
        per_s = [r["steps"]["steps"] / r["result"]["duration"] for r in read if r["result"].get("duration")]
        tokens = [r["steps"]["tokens_per_step"] for r in read if r["steps"]["tokens_per_step"] is not None]
        preempted = [r["steps"]["preemptions"] for r in read if r["steps"].get("preemptions") is not None]
        kv_tokens = [r["steps"]["kv_tokens"] for r in read if r["steps"].get("kv_tokens") is not None]
        rows.append(
            [
                label,
                rate_label(rate),
                str(len(read)),
                str(len(runs) - len(read)),
                median_range(steps, 0),
                median_range(per_s, 1),
                median_range(tokens, 1),
                median_range(preempted, 0),
                median_range(kv_tokens, 0),
            ]
        )
    header = [
        "server", "rate", "runs read", "not read", "steps", "steps/s", "tokens/step", "preemptions", "KV tokens",
    ]  # fmt: skip
    return format_table(rows, header)


def format_itl_tail_table(records: Sequence[dict[str, Any]]) -> str | None:
    """Per rate and server: the median over rounds (range) of the share of ITL gaps at or above each threshold of
    ITL_TAIL_MS, in percent, and the gaps counted; None when no run recorded its ``itl_tail``. Two servers with
    one ITL p99 can differ here: one stalls more gaps, the other stalls them for longer."""
    kept = [(r, r["result"]["itl_tail"]) for r in records if "itl_tail" in r["result"]]
    if not kept:
        return None
    rows = []
    for rate, label, tails in by_rate_and_server(kept):
        shares = [median_range([100.0 * t[f"share_at_least_{ms}ms"] for t in tails], 2) for ms in ITL_TAIL_MS]
        rows.append([label, rate_label(rate), median_range([t["gaps"] for t in tails], 0), *shares])
    header = ["server", "rate", "gaps", *(f"≥ {ms} ms, %" for ms in ITL_TAIL_MS)]
    return format_table(rows, header)


def stalls_of(result: dict[str, Any]) -> dict[str, Any] | None:
    """A run's ``itl_stalls``; where it was recorded before that field was, from its per-request gaps
    (``--save-detailed``) of the successful requests (``successes``, or in older files those without an
    ``errors`` message); None when it has neither."""
    if "itl_stalls" in result:
        return dict(result["itl_stalls"])
    if "itls" not in result:
        return None
    itls = result["itls"]
    if "successes" in result:
        kept = result["successes"]
    else:
        kept = [not error for error in result.get("errors") or [""] * len(itls)]
    if len(kept) != len(itls):
        raise SystemExit(
            f"a run at {rate_label(rate_of(result))} req/s lists {len(itls)} requests' gaps"
            f" but {len(kept)} outcomes"
        )
    return itl_stalls([gaps for gaps, ok in zip(itls, kept, strict=True) if ok])


def _median_of(runs: Sequence[dict[str, Any]], key: str, scale: float = 1.0, digits: int = 1) -> str:
    """``median_range`` of ``key`` over the runs that have a value for it, times ``scale``."""
    return median_range([scale * run[key] for run in runs if run[key] is not None], digits)


def format_itl_stalls_table(records: Sequence[dict[str, Any]]) -> str | None:
    """Per rate and server, the median over rounds (range) of its ``itl_stalls`` (bench/online.py): stalls per
    1,000 gaps, a stall's net excess and its longest gap at p50 and p90, and the share of stalls spread over
    more than one gap, in percent; None when no run recorded them. A server that splits each stall over two
    gaps reads a lower ITL p99 than one that keeps it in one gap, for as long a wait."""
    kept = [(r, found) for r in records if (found := stalls_of(r["result"])) is not None]
    if not kept:
        return None
    keys = ("stalls_per_1k_gaps", "p50_excess_ms", "p90_excess_ms", "p50_longest_ms", "p90_longest_ms")
    rows = []
    for rate, label, found in by_rate_and_server(kept):
        cells = [_median_of(found, key) for key in keys]
        rows.append([label, rate_label(rate), *cells, _median_of(found, "multi_gap_share", 100.0, 0)])
    header = [
        "server", "rate", "stalls / 1k gaps", "net excess p50, ms", "net excess p90, ms", "longest gap p50, ms",
        "longest gap p90, ms", "over 2+ gaps, %",
    ]  # fmt: skip
    return format_table(rows, header)


def median_series(records: Sequence[dict[str, Any]]) -> list[Series]:
    """One plot series per server: at each rate, the median over rounds of every figure the table shows."""
    series = []
    for label in dict.fromkeys(r["label"] for r in records):
        results = []
        for rate in sorted({rate_of(r["result"]) for r in records if r["label"] == label}):
            runs = results_of(records, label, rate)
            merged: dict[str, Any] = {
                "request_rate": "inf" if math.isinf(rate) else rate,
                "completed": runs[0]["completed"],
                "total_input_tokens": runs[0].get("total_input_tokens", 0),
                "total_output_tokens": runs[0].get("total_output_tokens", 0),
            }
            for _, key, _ in COLUMNS:
                values = [run[key] for run in runs if run.get(key) is not None]
                merged[key] = statistics.median(values) if values else None
            results.append(merged)
        series.append(Series(label, results))
    return series


# ---------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="drive every server in turn, round after round")
    run.add_argument("--server", action="append", type=parse_server, required=True, metavar="LABEL=ADDRESS")
    run.add_argument(
        "--steps",
        action="append",
        default=[],
        type=parse_steps_endpoint,
        metavar="LABEL=URL",
        help="a server's Prometheus endpoint: each run also records the steps it ran and their tokens",
    )
    add_load_arguments(run)
    run.add_argument("--rounds", type=int, default=2)
    run.add_argument("--first-round", type=int, default=0, help="round numbers (and seeds) start here")
    run.add_argument("--out-json", default=None, help="one JSON list: a record per run")
    run.add_argument(
        "--watch",
        action="append",
        default=[],
        type=watch_spec,
        metavar="NAME:PID:LOG",
        help="a server process: the run stops at once, with its log tail, when it has died",
    )
    table = sub.add_parser("table", help="the paired comparison of one or more run JSONs")
    table.add_argument("paths", nargs="+")
    table.add_argument("--baseline", required=True, help="the label every other server is compared with")
    table.add_argument("--out-md", default=None, help="also write the table here")
    table.add_argument("--png", default=None, help="also plot every server's medians over rounds here")
    table.add_argument("--slo-ttft-ms", type=float, default=500.0)
    table.add_argument("--slo-tpot-ms", type=float, default=50.0)
    args = parser.parse_args(argv)
    if args.command == "table":
        records = load_records(args.paths)
        text = format_ab_table(records, args.baseline)
        steps = format_steps_table(records)
        if steps is not None:
            text += "\n\nSteps each server ran (from its metrics endpoint; bench/step_mix.py):\n\n" + steps
        tail = format_itl_tail_table(records)
        if tail is not None:
            text += "\n\nShare of ITL gaps at or above each length (median over rounds, range):\n\n" + tail
        stalls = format_itl_stalls_table(records)
        if stalls is not None:
            text += (
                f"\n\nStalls: runs of gaps of at least {STALL_FACTOR:g}x the stream's median gap, one stall each"
                " (median over rounds, range):\n\n" + stalls
            )
        print(text)
        if args.out_md:
            Path(args.out_md).write_text(text + "\n")
        if args.png:
            write_png(args.png, median_series(records), args.slo_ttft_ms, args.slo_tpot_ms)
            print(f"png: {args.png}")
        return 0
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.out_json and Path(args.out_json).exists():
        parser.error(
            f"{args.out_json} exists: an earlier call's runs; name another (or another --first-round)"
        )
    watched: list[WatchedProcess] = args.watch
    records = run_while_all_alive(run_rounds(args.server, args), watched)
    if args.out_json:
        print(f"json: {args.out_json}", flush=True)
    return 0 if all(r["result"]["failed"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(exit_code_of(main))
