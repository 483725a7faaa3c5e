"""Where the device sat idle in a torch-profiler Chrome trace (``prefix_step.py --trace``, or any trace of one
step): its span from the first device event to the last, the time some kernel, copy or memset ran, and the idle
gaps between them, longest first, each with the event that ended it and its offset into the span. Also how long
the host worked before the first device event (the step's input building and its first launches).

An idle gap on the device inside a step is host time the step could not hide: an input copy waiting for the host
to build it, a launch the host had not issued yet, a synchronization.

    python bench/trace_gaps.py trace.json[.gz] [--top 20] [--min-gap-us 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: bench.* from the repository root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.step_probe import union_length  # noqa: E402

# Device-side event categories in torch profiler traces.
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_CATEGORIES = frozenset({"cpu_op", "python_function", "user_annotation", "cuda_runtime", "cuda_driver"})


@dataclass(frozen=True, slots=True)
class Gap:
    us: float  # idle time before ``before``
    before: str  # the device event that ended the gap
    at_ms: float  # when ``before`` started (the gap's end), from the first device event


@dataclass(frozen=True, slots=True)
class Timeline:
    device_events: int
    span_ms: float  # first device event's start to the last one's end
    busy_ms: float  # union of the device events' intervals
    idle_ms: float  # span - busy
    host_lead_ms: float  # first host event's start to the first device event's start (0 without host events)
    gaps: list[Gap]  # idle gaps of at least the minimum, longest first


def load_events(path: Path) -> list[dict[str, object]]:
    """The trace's complete ('X') events, from a .json or .json.gz file."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]


def timeline(events: list[dict[str, object]], min_gap_us: float = 20.0) -> Timeline:
    """The device's span, busy time and idle gaps; overlapping device events (several streams) count once."""
    device = sorted(
        (e for e in events if e.get("cat") in DEVICE_CATEGORIES),
        key=lambda e: float(e["ts"]),  # type: ignore[arg-type]
    )
    if not device:
        raise ValueError("the trace holds no device events (kernels, copies, memsets)")
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in device]  # type: ignore[arg-type]
    first = intervals[0][0]
    covered_to = first
    gaps: list[Gap] = []
    for event, (start, end) in zip(device, intervals, strict=True):
        if start - covered_to >= min_gap_us:
            gaps.append(Gap(start - covered_to, str(event.get("name", "")), (start - first) / 1e3))
        covered_to = max(covered_to, end)
    busy = union_length(intervals, first, covered_to)
    host_starts = [float(e["ts"]) for e in events if e.get("cat") in HOST_CATEGORIES]  # type: ignore[arg-type]
    host_lead = max(0.0, first - min(host_starts)) if host_starts else 0.0
    span = covered_to - first
    gaps.sort(key=lambda g: g.us, reverse=True)
    return Timeline(len(device), span / 1e3, busy / 1e3, (span - busy) / 1e3, host_lead / 1e3, gaps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=20, help="gaps to print")
    parser.add_argument("--min-gap-us", type=float, default=20.0, help="shorter idle gaps are not listed")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    try:
        line = timeline(load_events(args.trace), args.min_gap_us)
    except (OSError, ValueError, KeyError) as exc:
        print(f"{args.trace}: {exc}", file=sys.stderr)
        return 1
    listed = sum(g.us for g in line.gaps) / 1e3
    print(
        f"{line.device_events} device events: span {line.span_ms:.2f} ms, busy {line.busy_ms:.2f}, idle "
        f"{line.idle_ms:.2f} ({listed:.2f} in {len(line.gaps)} gaps of {args.min_gap_us:g} us or more); host "
        f"before the first device event {line.host_lead_ms:.2f} ms"
    )
    for gap in line.gaps[: args.top]:
        print(f"  {gap.us:8.1f} us idle before {gap.before[:70]} (at {gap.at_ms:.2f} ms)")
    if args.json:
        args.json.write_text(json.dumps(asdict(line), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
