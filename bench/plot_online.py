"""One figure and one table for online serving: several systems' results at the same request rates.

Reads results in the format `vllm bench serve --save-result` writes (a JSON object per run) and
``bench/online.py`` writes (a JSON list of such objects, one per rate); a folder means every ``*.json`` in it.
Plots TTFT p50/p99, TPOT p50/p99 (with the SLO lines), ITL p50/p99 and goodput against the request rate, one
line per system, and prints a table with ours/peer ratios beside the first two systems.

    python bench/plot_online.py --series ominix=ours.json --series vllm=vllm_results/ --png online.png

Matplotlib is needed for ``--png`` only (the ``bench`` extra); the table needs nothing beyond the standard library.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.common import fmt, format_table  # noqa: E402

INF_X_GAP = 2.0  # the unbounded rate is drawn this many times the largest finite rate to its right


@dataclass(frozen=True, slots=True)
class Series:
    """One system's results, one per request rate, in increasing rate order (inf last)."""

    name: str
    results: list[dict[str, Any]]


def rate_of(result: dict[str, Any]) -> float:
    rate = result.get("request_rate")
    return math.inf if rate in ("inf", None) else float(rate)


def load_results(path: str | Path) -> list[dict[str, Any]]:
    """Results from a file (one object or a list of them) or a folder of such files, sorted by rate."""
    source = Path(path)
    files = sorted(source.glob("*.json")) if source.is_dir() else [source]
    results: list[dict[str, Any]] = []
    for file in files:
        payload = json.loads(file.read_text())
        items = payload if isinstance(payload, list) else [payload]
        for item in items:
            if not isinstance(item, dict) or "request_rate" not in item:
                raise ValueError(f"{file}: not a serving result (no request_rate)")
            results.append(item)
    if not results:
        raise ValueError(f"{source}: no results")
    return sorted(results, key=rate_of)


def parse_series(spec: str) -> Series:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {spec!r}")
    return Series(name, load_results(path))


def rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _x_positions(series: Sequence[Series]) -> dict[float, float]:
    """Where each rate sits on the x axis: finite rates as they are, inf past the largest."""
    finite = sorted({rate_of(r) for s in series for r in s.results if not math.isinf(rate_of(r))})
    top = finite[-1] if finite else 1.0
    positions = {rate: rate for rate in finite}
    positions[math.inf] = top * INF_X_GAP
    return positions


def _value(result: dict[str, Any], key: str) -> float:
    value = result.get(key)
    return math.nan if value is None else float(value)


def write_png(path: str | Path, series: Sequence[Series], slo_ttft_ms: float, slo_tpot_ms: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positions = _x_positions(series)
    ticks = sorted(positions.values())
    labels = [rate_text(r) for r in sorted(positions, key=lambda r: positions[r])]
    fig, axes = plt.subplots(1, 4, figsize=(21, 5))
    panels = (
        ("TTFT (ms)", ("median_ttft_ms", "p99_ttft_ms"), slo_ttft_ms, True),
        ("TPOT (ms)", ("median_tpot_ms", "p99_tpot_ms"), slo_tpot_ms, True),
        ("ITL (ms)", ("median_itl_ms", "p99_itl_ms"), None, True),
        ("goodput (req/s within SLOs)", ("request_goodput",), None, False),
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (title, keys, slo, log_y) in zip(axes, panels, strict=True):
        for index, system in enumerate(series):
            xs = [positions[rate_of(r)] for r in system.results]
            for key in keys:
                style = ":" if key.startswith("p99") else "-"
                tag = "" if len(keys) == 1 else (" p99" if key.startswith("p99") else " p50")
                axis.plot(
                    xs,
                    [_value(r, key) for r in system.results],
                    style,
                    marker="o",
                    color=colors[index % len(colors)],
                    label=f"{system.name}{tag}",
                )
        if slo is not None:
            axis.axhline(slo, color="red", lw=0.8, ls="--", label=f"SLO {slo:g} ms")
        if log_y:
            axis.set_yscale("log")
        axis.set_xscale("log", base=2)
        axis.set_xticks(ticks, labels)
        axis.minorticks_off()
        axis.set_xlabel("request rate (req/s, Poisson; inf = all at once)")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    names = " vs ".join(s.name for s in series)
    first = series[0].results[0]
    fig.suptitle(
        f"online serving, {names}: {first.get('total_input_tokens', 0) // max(1, first.get('completed', 1))} in /"
        f" {first.get('total_output_tokens', 0) // max(1, first.get('completed', 1))} out tokens per request"
    )
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


COLUMNS = (
    ("out tok/s", "output_throughput", 0),
    ("TTFT p50", "median_ttft_ms", 1),
    ("TTFT p99", "p99_ttft_ms", 1),
    ("TPOT p50", "median_tpot_ms", 2),
    ("TPOT p99", "p99_tpot_ms", 2),
    ("ITL p50", "median_itl_ms", 2),
    ("ITL p99", "p99_itl_ms", 2),
    ("goodput", "request_goodput", 2),
)


def format_comparison(series: Sequence[Series]) -> str:
    """A row per system and rate (latencies in ms, goodput in req/s); with two or more systems, a ratio row
    per rate: the first system's figure over the second's (lower is better for latency, higher for the rest)."""
    header = ["system", "rate", "ok/sent", *[c[0] for c in COLUMNS]]
    by_rate: dict[float, dict[str, dict[str, Any]]] = {}
    for system in series:
        for result in system.results:
            by_rate.setdefault(rate_of(result), {})[system.name] = result
    rows = []
    for rate in sorted(by_rate):
        for system in series:
            result = by_rate[rate].get(system.name)
            if result is None:
                continue
            rows.append(
                [
                    system.name,
                    rate_text(rate),
                    f"{result.get('completed', 0)}/{result.get('num_prompts', '?')}",
                    *[fmt(result.get(key), digits) for _, key, digits in COLUMNS],
                ]
            )
        if len(series) >= 2 and all(s.name in by_rate[rate] for s in series[:2]):
            ours, peer = (by_rate[rate][s.name] for s in series[:2])
            ratios = []
            for _, key, _ in COLUMNS:
                a, b = ours.get(key), peer.get(key)
                ratios.append(f"{a / b:.2f}x" if a is not None and b else "-")
            rows.append([f"{series[0].name}/{series[1].name}", rate_text(rate), "", *ratios])
    return format_table(rows, header)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--series", action="append", type=parse_series, required=True, metavar="NAME=PATH", help="repeatable"
    )
    parser.add_argument("--png", default=None, help="write the figure here")
    parser.add_argument("--table", default=None, help="also write the table to this file")
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0)
    args = parser.parse_args(argv)
    table = format_comparison(args.series)
    print(table)
    if args.table:
        Path(args.table).write_text(table + "\n")
    if args.png:
        print(f"png: {write_png(args.png, args.series, args.slo_ttft_ms, args.slo_tpot_ms)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
