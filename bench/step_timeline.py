"""A worker's step log (bench/step_probe.py's ``OMINIX_PROFILE_OUT``) cut into runs, and where each run's wall
time went: the steps that carried prompt tokens, the pure-decode steps, and the batch's ramp.

Runs are told apart by an idle stretch between steps (``--gap-s``; a bench pauses between its runs, a busy
worker never does). A step's time depends on how the worker ran it:

- pipelined (the CUDA worker's default: a call launches its step, then waits for the step before it to finish
  on the device): step k ran on the device from call k's exit to call k+1's exit, so that is its time; the first
  step also gets its own call (input building and launch, before anything ran), the last its own exit;
- ``--synchronous`` (a call returns once its own step is done): from its entry to the next call's entry; the
  last step ends at its exit.

Either way the times add up to the run's wall time. For each run: its wall time from the first entry to the last exit, the prompt-side steps
(count, time, their token counts), the pure-decode steps (count, time, the median at the run's largest batch),
how many steps and how long until the batch first reached its largest size (a burst's intake), and how much
of the wall the worker spent between step calls (waiting for the engine's next step, or on a result), which the
steps' times include.

    python bench/step_timeline.py probe.json [--gap-s 0.5] [--min-steps 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class RunTimeline:
    steps: int
    wall_ms: float  # first step's entry to the last step's exit
    prompt_steps: int  # steps with requests that were not pure decode
    prompt_ms: float
    prompt_tokens: list[int]  # each prompt-side step's scheduled tokens, in order
    decode_steps: int
    decode_ms: float
    empty_steps: int  # steps with no request (they only carry finished ids)
    empty_ms: float
    max_batch: int
    decode_median_ms_at_max_batch: float | None  # None when no pure-decode step ran at the largest batch
    ramp_steps: int  # steps before the first at the largest batch
    ramp_ms: float  # their time
    between_calls_ms: float  # of the wall, the time between one step call's exit and the next one's entry


def split_runs(steps: list[dict[str, Any]], gap_s: float) -> list[list[dict[str, Any]]]:
    """Consecutive steps (by entry time) with no idle stretch of ``gap_s`` or more between one's exit and the
    next one's entry."""
    ordered = sorted(steps, key=lambda s: float(s["enter"]))
    runs: list[list[dict[str, Any]]] = []
    for step in ordered:
        if runs and float(step["enter"]) - float(runs[-1][-1]["exit"]) < gap_s:
            runs[-1].append(step)
        else:
            runs.append([step])
    return runs


def step_times_ms(run: list[dict[str, Any]], pipelined: bool) -> list[float]:
    """Each step's time (the module docstring says how it is counted); they add up to the run's wall time."""
    if pipelined:
        marks = [float(run[0]["enter"])] + [float(s["exit"]) for s in run[1:]] + [float(run[-1]["exit"])]
        if len(run) == 1:
            marks = [float(run[0]["enter"]), float(run[0]["exit"])]
    else:
        marks = [float(s["enter"]) for s in run] + [float(run[-1]["exit"])]
    return [(b - a) * 1e3 for a, b in zip(marks, marks[1:], strict=False)][: len(run)]


def run_timeline(run: list[dict[str, Any]], pipelined: bool = True) -> RunTimeline:
    """Where one run's wall time went."""
    times = step_times_ms(run, pipelined)
    between = sum(
        max(0.0, float(b["enter"]) - float(a["exit"])) * 1e3 for a, b in zip(run, run[1:], strict=False)
    )
    batches = [int(s["batch"]) for s in run]
    kinds = [
        "empty" if b == 0 else "decode" if s["decode"] else "prompt"
        for s, b in zip(run, batches, strict=True)
    ]

    def of(kind: str) -> list[float]:
        return [t for t, k in zip(times, kinds, strict=True) if k == kind]

    max_batch = max(batches)
    ramp = batches.index(max_batch)
    at_max = [t for t, k, b in zip(times, kinds, batches, strict=True) if k == "decode" and b == max_batch]
    return RunTimeline(
        steps=len(run),
        wall_ms=(float(run[-1]["exit"]) - float(run[0]["enter"])) * 1e3,
        prompt_steps=kinds.count("prompt"),
        prompt_ms=sum(of("prompt")),
        prompt_tokens=[int(s["tokens"]) for s, k in zip(run, kinds, strict=True) if k == "prompt"],
        decode_steps=kinds.count("decode"),
        decode_ms=sum(of("decode")),
        empty_steps=kinds.count("empty"),
        empty_ms=sum(of("empty")),
        max_batch=max_batch,
        decode_median_ms_at_max_batch=statistics.median(at_max) if at_max else None,
        ramp_steps=ramp,
        ramp_ms=sum(times[:ramp]),
        between_calls_ms=between,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("probe", type=Path, help="the step probe's JSON")
    parser.add_argument("--gap-s", type=float, default=0.5, help="an idle stretch this long starts a new run")
    parser.add_argument("--min-steps", type=int, default=8, help="shorter runs (warm-ups) are not reported")
    parser.add_argument(
        "--synchronous",
        action="store_true",
        help="the worker ran each step to its end before returning (not pipelined: OMINIX_PIPELINE=0 or a CPU "
        "worker)",
    )
    parser.add_argument("--json", type=Path, help="write every reported run's figures here")
    args = parser.parse_args(argv)
    try:
        steps = json.loads(args.probe.read_text())["steps"]
        runs = [r for r in split_runs(steps, args.gap_s) if len(r) >= args.min_steps]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"{args.probe}: not a step probe's log ({exc})", file=sys.stderr)
        return 1
    if not runs:
        print(f"{args.probe}: no run of {args.min_steps} steps or more", file=sys.stderr)
        return 1
    figures = [run_timeline(run, pipelined=not args.synchronous) for run in runs]
    for i, t in enumerate(figures):
        median = "-" if t.decode_median_ms_at_max_batch is None else f"{t.decode_median_ms_at_max_batch:.2f}"
        tokens = t.prompt_tokens
        shown = ", ".join(str(n) for n in tokens[:6]) + (", ..." if len(tokens) > 6 else "")
        print(
            f"run {i}: {t.steps} steps in {t.wall_ms:,.1f} ms: {t.prompt_steps} with prompt tokens "
            f"{t.prompt_ms:,.1f} ms ({shown}), {t.decode_steps} pure decode {t.decode_ms:,.1f} ms (median at "
            f"batch {t.max_batch}: {median} ms), {t.empty_steps} with no request {t.empty_ms:,.1f} ms; batch "
            f"{t.max_batch} first in the step after {t.ramp_steps} steps, "
            f"{t.ramp_ms:,.1f} ms; between step calls {t.between_calls_ms:,.1f} ms"
        )
    if args.json:
        args.json.write_text(json.dumps([asdict(t) for t in figures], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
