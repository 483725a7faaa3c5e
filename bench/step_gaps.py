"""The longest gaps in a client's token streams, matched with the worker steps that ended them.

Reads a step probe's JSON (bench/step_probe.py: every step's arrival at the worker, its launch, the moment its
result left) and bench/online.py's result with per-request lists (``--save-detailed``), both from one run on
one machine. Each token chunk a client received is matched with the last step whose result left the worker
before it; each gap between two chunks of a stream then has the step that ended it. For the gaps at or above
a percentile (the ITL p99 by default) it prints what those steps were (tokens, prefill or not) and where their
time went:

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


@dataclass(frozen=True, slots=True)
class Step:
    step_id: int
    tokens: int
    batch: int
    decode: bool
    arrived: float  # Unix seconds: the worker took the step's message
    entered: float  # its launch began
    exited: float  # its launch ended
    posted: float  # its result left the worker

    @property
    def prefill(self) -> bool:
        return not self.decode and self.tokens > self.batch


@dataclass(frozen=True, slots=True)
class Gap:
    seconds: float
    ended_at: float  # Unix seconds: the chunk that ended it reached the client
    step: Step | None  # the step whose result that chunk carried (None: none matched)
    previous: Step | None  # the step before it


def load_steps(probe: dict[str, Any]) -> list[Step]:
    """Steps with every timestamp known, in the order their results left (Unix seconds)."""
    offset = float(probe["unix_minus_perf"])
    arrived: dict[int, float] = {}
    posted: dict[int, float] = {}
    for kind, step_id, start, end in probe["marks"]:
        if kind == "step_from_pb":
            arrived[step_id] = end + offset
        elif kind == "result_to_pb":
            posted.setdefault(step_id, start + offset)
    steps = [
        Step(
            step_id=s["id"],
            tokens=s["tokens"],
            batch=s["batch"],
            decode=s["decode"],
            arrived=arrived[s["id"]],
            entered=s["enter"] + offset,
            exited=s["exit"] + offset,
            posted=posted[s["id"]],
        )
        for s in probe["steps"]
        if s["id"] in arrived and s["id"] in posted
    ]
    return sorted(steps, key=lambda s: s.posted)


def client_gaps(run: dict[str, Any], steps: list[Step]) -> list[Gap]:
    """Every gap between two chunks of one stream, with the step that ended it."""
    if "started_at_unix" not in run or "itls" not in run:
        raise ValueError(
            "the online result has no per-request lists: run bench/online.py with --save-detailed"
        )
    base = float(run["started_at_unix"])
    posts = [s.posted for s in steps]
    gaps: list[Gap] = []
    for start, ttft, itls in zip(run["start_times"], run["ttfts"], run["itls"], strict=True):
        at = base + start + ttft
        for itl in itls:
            at += itl
            i = bisect.bisect_right(posts, at) - 1
            gaps.append(Gap(itl, at, steps[i] if i >= 0 else None, steps[i - 1] if i >= 1 else None))
    return gaps


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _ms(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values) * 1e3:.2f} ({min(values) * 1e3:.2f}–{max(values) * 1e3:.2f})"


def report(gaps: list[Gap], q: float) -> list[str]:
    seconds = [g.seconds for g in gaps]
    cut = percentile(seconds, q)
    tail = [g for g in gaps if g.seconds >= cut and g.step is not None]
    lines = [
        f"{len(gaps)} gaps; p50 {percentile(seconds, 50) * 1e3:.2f} ms, p{q:g} {cut * 1e3:.2f} ms;"
        f" {len(tail)} at or above p{q:g}, by the step that ended them",
    ]
    kinds: dict[str, list[Gap]] = {}
    for g in tail:
        assert g.step is not None
        before = g.previous is not None and g.previous.prefill
        name = "prefill step" if g.step.prefill else ("decode after a prefill step" if before else "decode")
        kinds.setdefault(name, []).append(g)
    for name, group in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        st = [g.step for g in group if g.step is not None]
        lines.append(
            f"  {name}: {len(group)} gaps, {len({s.step_id for s in st})} steps;"
            f" gap {_ms([g.seconds for g in group])} ms; step tokens"
            f" {statistics.median([s.tokens for s in st]):.0f}"
        )
        lines.append(
            f"    queued {_ms([s.entered - s.arrived for s in st])}; launch {_ms([s.exited - s.entered for s in st])};"
            f" to post {_ms([s.posted - s.exited for s in st])};"
            f" delivery {_ms([g.ended_at - g.step.posted for g in group if g.step is not None])}"
        )
        prev = [g.previous for g in group if g.previous is not None]
        if prev:
            lines.append(
                f"    posted after the step before: {_ms([g.step.posted - p.posted for g, p in zip(group, prev, strict=False) if g.step is not None])}"
            )
    prefill_steps = [
        s for s in {g.step.step_id: g.step for g in gaps if g.step is not None}.values() if s.prefill
    ]
    lines.append(
        f"prefill steps that ended a gap: {len(prefill_steps)}; launch {_ms([s.exited - s.entered for s in prefill_steps])},"
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
    probe = json.loads(args.probe.read_text())
    runs = json.loads(args.online.read_text())
    steps = load_steps(probe)
    if not steps:
        print("the probe logged no step with its arrival and result", file=sys.stderr)
        return 1
    for run in runs if isinstance(runs, list) else [runs]:
        print(
            f"rate {run.get('request_rate')}: ITL p99 {run.get('p99_itl_ms', float('nan')):.2f} ms (client)"
        )
        for line in report(client_gaps(run, steps), args.percentile):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
