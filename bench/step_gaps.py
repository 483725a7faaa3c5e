"""The longest gaps in a client's token streams, beside the worker steps whose results had just left.

Reads a step probe's JSON (bench/step_probe.py: every step's arrival at the worker, its launch, the moment its
result left) and bench/online.py's result with per-request lists (``--save-detailed``), both from one run on
one host (their times are ``time.perf_counter()``, one clock for every process there). Each token chunk a
client received is matched with the last step whose result left the worker before the chunk arrived: the step
that most likely carried it. When two results leave within the delivery time (~2 ms), a chunk of the earlier one
can be matched with the later; ``close`` counts the tail gaps where that could have happened. For the gaps at or
above a percentile (the ITL p99 by default) it prints what those steps were (tokens, prefill or not) and where
their time went:

- ``queued``: from the step's arrival at the worker to the start of its launch (the device thread was busy
  with the step before);
- ``launch``: the host launching it (``execute_step``);
- ``to post``: from the end of its launch to its result leaving (the device finishing it, or the thread
  launching the next step first);
- ``delivery``: from its result leaving the worker to the client's chunk (engine, front, gRPC).

    python bench/step_gaps.py probe.json online.json [--percentile 99]
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.common import median_range, percentile  # noqa: E402
from bench.service_summary import mark_spans  # noqa: E402

# Two results that left the worker within this long of each other: a chunk may be matched with the later one.
CLOSE_S = 0.003


@dataclass(frozen=True, slots=True)
class Step:
    step_id: int
    tokens: int
    batch: int
    decode: bool
    arrived: float  # perf_counter seconds: the worker took the step's message
    entered: float  # its launch began
    exited: float  # its launch ended
    posted: float  # its result left the worker

    @property
    def prefill(self) -> bool:
        return not self.decode and self.tokens > self.batch


@dataclass(frozen=True, slots=True)
class Gap:
    seconds: float
    ended_at: float  # perf_counter seconds: the chunk that ended it reached the client
    step: Step  # the last step whose result had left before that chunk
    previous: Step | None  # the step whose result left before that one
    close: bool  # another result left within CLOSE_S of ``step``'s: the match may be one step off


def load_steps(probe: dict[str, Any]) -> list[Step]:
    """Steps with every timestamp known, in the order their results left."""
    arrived = mark_spans(probe, "step_from_pb")
    posted = mark_spans(probe, "result_to_pb")
    steps = [
        Step(
            step_id=s["id"],
            tokens=s["tokens"],
            batch=s["batch"],
            decode=s["decode"],
            arrived=arrived[s["id"]][1],
            entered=s["enter"],
            exited=s["exit"],
            posted=posted[s["id"]][0],
        )
        for s in probe["steps"]
        if s["id"] in arrived and s["id"] in posted
    ]
    return sorted(steps, key=lambda s: s.posted)


def client_gaps(run: dict[str, Any], steps: list[Step]) -> list[Gap]:
    """Every gap between two chunks of one stream, with the step matched with the chunk that ended it."""
    missing = [key for key in ("started_perf", "start_times", "ttfts", "itls") if key not in run]
    if missing:
        raise ValueError(
            f"the online result lacks {', '.join(missing)}: run bench/online.py with --save-detailed"
        )
    base = float(run["started_perf"])
    posts = [s.posted for s in steps]
    gaps: list[Gap] = []
    for start, ttft, itls in zip(run["start_times"], run["ttfts"], run["itls"], strict=True):
        at = base + start + ttft
        for itl in itls:
            at += itl
            i = bisect.bisect_right(posts, at) - 1
            if i < 0:
                continue
            close = (i >= 1 and posts[i] - posts[i - 1] < CLOSE_S) or (
                i + 1 < len(posts) and posts[i + 1] - posts[i] < CLOSE_S
            )
            gaps.append(Gap(itl, at, steps[i], steps[i - 1] if i >= 1 else None, close))
    return gaps


def _ms(values: list[float]) -> str:
    return median_range([v * 1e3 for v in values], 2)


def _kind(gap: Gap) -> str:
    if gap.step.prefill:
        return "prefill step"
    return "decode after a prefill step" if gap.previous is not None and gap.previous.prefill else "decode"


def report(gaps: list[Gap], q: float) -> list[str]:
    seconds = [g.seconds for g in gaps]
    cut = percentile(seconds, q)
    tail = [g for g in gaps if g.seconds >= cut]
    lines = [
        f"{len(gaps)} gaps; p50 {percentile(seconds, 50) * 1e3:.2f} ms, p{q:g} {cut * 1e3:.2f} ms;"
        f" {len(tail)} at or above p{q:g} ({sum(g.close for g in tail)} close), by the step matched with their end",
    ]
    kinds: dict[str, list[Gap]] = {}
    for g in tail:
        kinds.setdefault(_kind(g), []).append(g)
    for name, group in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        st = [g.step for g in group]
        lines.append(
            f"  {name}: {len(group)} gaps, {len({s.step_id for s in st})} steps;"
            f" gap {_ms([g.seconds for g in group])} ms; step tokens {statistics.median([s.tokens for s in st]):.0f}"
        )
        lines.append(
            f"    queued {_ms([s.entered - s.arrived for s in st])}; launch {_ms([s.exited - s.entered for s in st])};"
            f" to post {_ms([s.posted - s.exited for s in st])};"
            f" delivery {_ms([g.ended_at - g.step.posted for g in group])}"
        )
        after = [g.step.posted - g.previous.posted for g in group if g.previous is not None]
        if after:
            lines.append(f"    posted after the step before: {_ms(after)}")
    prefill_steps = [s for s in {g.step.step_id: g.step for g in gaps}.values() if s.prefill]
    lines.append(
        f"prefill steps matched with a chunk: {len(prefill_steps)}; launch {_ms([s.exited - s.entered for s in prefill_steps])},"
        f" queued {_ms([s.entered - s.arrived for s in prefill_steps])}, to post {_ms([s.posted - s.exited for s in prefill_steps])}"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("probe", type=Path, help="the step probe's JSON")
    parser.add_argument("online", type=Path, help="bench/online.py's result (--save-detailed)")
    parser.add_argument("--percentile", type=float, default=99.0, help="report gaps at or above this one")
    args = parser.parse_args(argv)
    steps = load_steps(json.loads(args.probe.read_text()))
    if not steps:
        print("step_gaps: the probe logged no step with its arrival and result", file=sys.stderr)
        return 1
    runs = json.loads(args.online.read_text())
    for run in runs if isinstance(runs, list) else [runs]:
        try:
            gaps = client_gaps(run, steps)
        except ValueError as exc:
            print(f"step_gaps: {exc}", file=sys.stderr)
            return 2
        print(
            f"rate {run.get('request_rate')}: ITL p99 {run.get('p99_itl_ms', float('nan')):.2f} ms (client)"
        )
        for line in report(gaps, args.percentile):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
