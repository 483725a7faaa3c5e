"""Table of the service-path targets from one ``bench/gpu_service.sh`` output folder.

Reads offline.json (bench/offline.py), peer_hf.json (bench/peer_hf.py), roofline.json and probe.json
(bench/step_probe.py) and prints each figure beside its target, then where a worker's decode step goes.

    python bench/service_summary.py OUT_FOLDER
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path[0] = str(
        Path(__file__).resolve().parent.parent
    )  # run as a script: bench.* from the repository root

from bench.step_probe import is_prefill  # noqa: E402


def _load(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _gpu_name() -> str:
    """The first GPU's name from nvidia-smi (MoE runs have no roofline file naming it), else "?"."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "?"
    return done.stdout.splitlines()[0].strip() if done.stdout.strip() else "?"


ALLOCATOR_COUNTS = (("device_allocs", "cudaMalloc"), ("host_allocs", "pinned"), ("alloc_retries", "retries"))


def allocator_calls(steps: list[dict[str, Any]], index: int) -> str:
    """The allocator calls made from the step before's exit to step ``index``'s (the running counts' difference,
    on any thread of the worker), e.g. ", 2 cudaMalloc": what may have held the device thread in a long step.
    Empty when none or not logged (``OMINIX_PROFILE_ALLOCATOR``)."""
    if index == 0:
        return ""
    cur, prev = steps[index], steps[index - 1]
    made = [(cur[k] - prev[k], name) for k, name in ALLOCATOR_COUNTS if k in cur and k in prev]
    return "".join(f", {n} {name}" for n, name in made if n)


def slowest_steps(steps: list[dict[str, Any]], count: int = 3) -> str:
    """The longest worker steps (a Triton compile mid-run shows up here as a step of a second or more), with
    the allocator calls each made."""
    order = sorted(range(len(steps)), key=lambda i: steps[i]["exit"] - steps[i]["enter"], reverse=True)
    return "; ".join(
        f"{(steps[i]['exit'] - steps[i]['enter']) * 1e3:.0f} ms ({steps[i]['tokens']} tokens, batch "
        f"{steps[i]['batch']}{allocator_calls(steps, i)})"
        for i in order[:count]
    )


def prefill_rate(steps: list[dict[str, Any]], min_tokens: int) -> dict[str, float] | None:
    """The prefill steps of a step log (``step_probe.is_prefill``: not pure decode, ``min_tokens`` or more): how
    many, the median worker time, and tokens per second over all of them."""
    rows = [s for s in steps if is_prefill(s["decode"], s["tokens"], min_tokens)]
    if not rows:
        return None
    seconds = [s["exit"] - s["enter"] for s in rows]
    return {
        "steps": float(len(rows)),
        "median_ms": statistics.median(seconds) * 1e3,
        "tokens_per_s": sum(s["tokens"] for s in rows) / sum(seconds) if sum(seconds) > 0 else 0.0,
    }


def step_breakdown(steps: list[dict[str, Any]], batch: int) -> dict[str, float] | None:
    """Means over consecutive pure-decode steps of one batch size: worker time, gap before the next, phases."""
    rows = []
    for prev, cur in zip(steps, steps[1:], strict=False):
        if cur["decode"] and prev["decode"] and cur["batch"] == batch and prev["batch"] == batch:
            rows.append((prev, cur))
    if len(rows) < 3:
        return None
    rows = rows[2:]  # first steps of a run carry one-off costs
    out = {
        "steps": float(len(rows)),
        "step_ms": statistics.mean((c["exit"] - c["enter"]) * 1e3 for _, c in rows),
        "gap_ms": statistics.mean((c["enter"] - p["exit"]) * 1e3 for p, c in rows),
    }
    for phase in (
        "prepare_inputs",
        "forward",
        "post_early",
        "sample",
        "graph_run",
        "sample_logits",
        "update_states",
    ):
        out[phase + "_ms"] = statistics.mean(c.get(phase, 0.0) * 1e3 for _, c in rows)
    return out


def mark_spans(probe: dict[str, Any], kind: str) -> dict[int, tuple[float, float]]:
    """Step id → (start, end) of the worker's ``kind`` marks (``step_from_pb``, ``result_to_pb``)."""
    return {m[1]: (m[2], m[3]) for m in probe.get("marks", []) if m[0] == kind}


def gap_parts(probe: dict[str, Any], batch: int, run: str | None = None) -> dict[str, float] | None:
    """Medians (ms) over consecutive decode steps of one batch size (of one run label, when given), from the
    worker's marks: result → protobuf and step ← protobuf durations, and ``next_ready`` = when the next step
    had been converted relative to when the worker returned from the previous one (a pipelined worker returns
    once it has launched step N, i.e. when N-1 ended on the device; ≤ 0: step N+1 was already waiting)."""
    result_pb, step_pb = mark_spans(probe, "result_to_pb"), mark_spans(probe, "step_from_pb")
    steps = probe.get("steps", [])
    parts: dict[str, list[float]] = {k: [] for k in ("result_pb", "step_pb", "next_ready", "gap")}
    for prev, cur in zip(steps, steps[1:], strict=False):
        if not (prev["decode"] and cur["decode"] and prev["batch"] == batch == cur["batch"]):
            continue
        if run is not None and not (prev.get("run", "") == run == cur.get("run", "")):
            continue
        r, n = result_pb.get(prev.get("id")), step_pb.get(cur.get("id"))
        if r is None or n is None:
            continue
        parts["result_pb"].append(r[1] - r[0])
        parts["step_pb"].append(n[1] - n[0])
        parts["next_ready"].append(n[1] - prev["exit"])
        parts["gap"].append(cur["enter"] - prev["exit"])
    if not parts["gap"]:
        return None
    return {k: statistics.median(v) * 1e3 for k, v in parts.items()}


def prefix_hops(probe: dict[str, Any], offline: dict[str, Any]) -> dict[str, float] | None:
    """Where a warm shared-prefix TTFT goes (medians, ms), from the client's send and first-token times
    (``runs.shared_prefix.warm_timeline_s``) against the worker's step log and marks on the same clock: to the
    worker (client send → the step's protobuf taken up), handed to the step (→ ``execute_step`` entered), the
    step, handed back (→ its result's protobuf begun), back to the client (→ first token). The step is the one
    single-request, not pure-decode step that entered inside the request's TTFT."""
    timeline = offline.get("runs", {}).get("shared_prefix", {}).get("warm_timeline_s", [])
    result_pb, step_pb = mark_spans(probe, "result_to_pb"), mark_spans(probe, "step_from_pb")
    steps = [s for s in probe.get("steps", []) if s["batch"] == 1 and not s["decode"]]
    names = ("ttft", "to_worker", "handed_to_step", "step", "handed_back", "back_to_client")
    parts: dict[str, list[float]] = {k: [] for k in names}
    for sent, first in timeline:
        inside = [s for s in steps if sent <= s["enter"] <= first]
        if len(inside) != 1:
            continue
        step = inside[0]
        taken, left = step_pb.get(step["id"]), result_pb.get(step["id"])
        if taken is None or left is None:
            continue
        spans = (
            first - sent,
            taken[0] - sent,
            step["enter"] - taken[0],
            step["exit"] - step["enter"],
            left[0] - step["exit"],
            first - left[0],
        )
        for name, value in zip(names, spans, strict=True):
            parts[name].append(value)
    if not parts["ttft"]:
        return None
    out = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
    out["requests"] = float(len(parts["ttft"]))
    return out


def run_timeline(probe: dict[str, Any], run: dict[str, Any]) -> dict[str, float] | None:
    """Where one offline run's wall time went (ms), from its clock span (``clock_s``, bench/serve.py) against
    the worker's step log and marks on the same clock: from the clock's start to the first step's protobuf
    taken up (sends, engine admission, scheduling), the steps until the last result left (each step's share is
    the time from the previous result leaving to its own; split into pure-decode steps and the rest), and from
    the last result to the client's last token. ``worker_waited`` sums the times the worker had returned from
    a step before the next step's protobuf had been converted (the engine late; the device may still have been
    busy with the step in flight)."""
    clock = run.get("clock_s") or {}
    if "last_end" not in clock:
        return None
    origin, end = clock["origin"], clock["last_end"]
    result_pb, step_pb = mark_spans(probe, "result_to_pb"), mark_spans(probe, "step_from_pb")
    # The run's steps: taken up after its clock started, their result gone before its last token arrived.
    steps = [
        s
        for s in probe.get("steps", [])
        if s["id"] in result_pb
        and s["id"] in step_pb
        and origin <= s["enter"]
        and result_pb[s["id"]][1] <= end
    ]
    if not steps:
        return None
    left = [result_pb[s["id"]][1] for s in steps]
    first_taken = step_pb[steps[0]["id"]][0]
    shares = [left[0] - first_taken] + [b - a for a, b in zip(left, left[1:], strict=False)]
    shared = list(zip(steps, shares, strict=True))
    decode_ms = sum(t for s, t in shared if s["decode"]) * 1e3
    other_ms = sum(t for s, t in shared if not s["decode"]) * 1e3
    top = max(s["batch"] for s in steps)
    full = [t for s, t in shared if s["decode"] and s["batch"] == top]
    waited = sum(
        max(0.0, step_pb[cur["id"]][1] - prev["exit"]) for prev, cur in zip(steps, steps[1:], strict=False)
    )
    return {
        "wall_ms": (end - origin) * 1e3,
        "sends_ms": (clock.get("last_send", origin) - origin) * 1e3,
        "to_first_step_ms": (first_taken - origin) * 1e3,
        "steps": float(len(steps)),
        "decode_steps": float(sum(s["decode"] for s in steps)),
        "decode_steps_ms": decode_ms,
        "other_steps_ms": other_ms,
        "full_batch": float(top),
        "full_batch_from_ms": (step_pb[next(s for s in steps if s["batch"] == top)["id"]][0] - origin) * 1e3,
        "full_batch_step_median_ms": statistics.median(full) * 1e3 if full else math.nan,
        "after_last_result_ms": (end - left[-1]) * 1e3,
        "worker_waited_ms": waited * 1e3,
    }


def print_run_timelines(probe: dict[str, Any], offline: dict[str, Any]) -> None:
    """One line per timed offline run that has a clock span and steps in the probe's log."""
    for key, run in offline.get("runs", {}).items():
        t = run_timeline(probe, run) if isinstance(run, dict) else None
        if t is None:
            continue
        median = t["full_batch_step_median_ms"]
        median_text = "-" if math.isnan(median) else f"{median:.2f}"
        print(
            f"{key} timeline, ms: wall {t['wall_ms']:.1f} = to first step {t['to_first_step_ms']:.1f} (sends "
            f"{t['sends_ms']:.1f}) + {int(t['steps'])} steps {t['decode_steps_ms'] + t['other_steps_ms']:.1f} "
            f"({int(t['decode_steps'])} pure decode {t['decode_steps_ms']:.1f}, the rest "
            f"{t['other_steps_ms']:.1f}; batch {int(t['full_batch'])} from {t['full_batch_from_ms']:.1f}, its "
            f"median {median_text}) + after the last result {t['after_last_result_ms']:.1f}; "
            f"worker waited for the engine {t['worker_waited_ms']:.1f}"
        )


def print_overhead_runs(probe: dict[str, Any], runs: list[str]) -> None:
    """One line per run label and profiled batch size: GPU busy (target >= 97% at batch 256) and the median
    next_ready of that run's steady decode steps of that size (target <= 0.5 ms)."""
    windows = probe.get("windows", {})
    for run in runs:
        for key, window in sorted(windows.items()):
            if not key.startswith(f"{run}/decode_batch_"):
                continue
            batch = int(key.rsplit("_", 1)[1])
            g = gap_parts(probe, batch, run)
            share = window.get("gpu_busy_share")
            idle = window.get("idle_us_per_step")
            busy_text = "-" if share is None else f"{share:.1%} over {window.get('num_steps')} steps"
            idle_text = "-" if idle is None else f"{idle / 1e3:.2f} ms"
            ready_text = "-" if g is None else f"{g['next_ready']:.2f} ms"
            print(
                f"overhead {run} at batch {batch}: GPU busy {busy_text} (idle per step {idle_text}), "
                f"next_ready median {ready_text}{gc_text(window)}"
            )


def gc_text(window: dict[str, Any]) -> str:
    """The worker's collector pauses (>= 1 ms) inside a window, where the probe logged them."""
    pauses = window.get("gc_pauses_ms")
    if pauses is None:
        return ""
    if not pauses:
        return ", no GC pause >= 1 ms"
    return f", GC pauses {len(pauses)} ({sum(pauses):.1f} ms, largest {max(pauses):.1f})"


def main(argv: list[str]) -> int:
    folder = Path(argv[1] if len(argv) > 1 else ".")
    offline = _load(folder / "offline.json")
    figures: dict[str, Any] = offline.get("figures", {})
    peer = _load(folder / "peer_hf.json")
    roof = _load(folder / "roofline.json")
    probe = _load(folder / "probe.json")
    card = roof.get("device") or peer.get("device") or _gpu_name()
    print(f"card: {card}; model {offline.get('model', '?')} on {offline.get('device', '?')}")
    if roof:
        print(f"ceilings: {roof['bandwidth'] / 1e12:.2f} TB/s copy, {roof['flops'] / 1e12:.0f} TFLOP/s bf16")
    rows: list[tuple[str, str, str]] = []
    cold = figures.get("w1_cold_out_tok_s")
    hf = peer.get("out_tok_s")
    rows.append(("W1 cold out tok/s", _fmt(cold), ""))
    rows.append(("HF static batch 128 out tok/s (same call)", _fmt(hf), ""))
    rows.append(("P1 W1 cold / HF static", _fmt(cold / hf if cold and hf else None, 2), ">= 4.0"))
    rows.append(("W1 roofline out tok/s", _fmt(figures.get("w1_roofline_out_tok_s")), ""))
    rows.append(("W1 cold / roofline", _fmt(figures.get("w1_cold_over_roofline"), 2), ""))
    rows.append(("W1 again out tok/s", _fmt(figures.get("w1_cached_out_tok_s")), ""))
    rows.append(("P5 W1 again / cold", _fmt(figures.get("w1_cached_over_cold"), 2), ">= 1.6"))
    rows.append(("W1 cold TTFT median ms", _fmt(figures.get("w1_cold_ttft_p50_ms")), ""))
    rows.append(("W1 cold TPOT median ms", _fmt(figures.get("w1_cold_tpot_p50_ms"), 2), ""))
    rows.append(("P2 batch-1 TPOT ms", _fmt(figures.get("batch1_tpot_ms"), 2), "<= 6.0"))
    rows.append(("batch-1 TPOT floor ms", _fmt(figures.get("batch1_tpot_floor_ms"), 2), ""))
    rows.append(("TTFT cold ms (2048+64)", _fmt(figures.get("prefix_ttft_cold_ms"), 2), ""))
    rows.append(("TTFT warm ms (prefix shared)", _fmt(figures.get("prefix_ttft_warm_ms"), 2), ""))
    rows.append(("P5 TTFT cold / warm", _fmt(figures.get("prefix_ttft_cold_over_warm"), 2), ">= 5"))
    windows = probe.get("windows", {})
    for key, window in sorted(windows.items()):
        if "gpu_busy_share" in window:
            share = window["gpu_busy_share"]
            target = ">= 97%" if key.endswith("_256") else ""
            steps_text = f"{window.get('num_steps', '?')} steps" + (
                "" if window.get("complete", True) else ", cut"
            )
            rows.append((f"GPU busy, {key} ({steps_text}{gc_text(window)})", f"{share:.1%}", target))
            idle = window.get("idle_us_per_step")
            idle_text = f"{idle / 1e3:.2f}" if idle is not None else "-"
            rows.append(
                (
                    f"  profiled step / GPU idle per step ms, {key}",
                    f"{window['step_us_mean'] / 1e3:.2f} / {idle_text}",
                    "",
                )
            )
    width = max(len(r[0]) for r in rows)
    for name, value, target in rows:
        print(f"{name.ljust(width)}  {value:>12}  {target}")
    steps = probe.get("steps", [])
    for batch in (256, 1):
        b = step_breakdown(steps, batch)
        if b is None:
            continue
        parts = ", ".join(f"{k[:-3]} {v:.2f}" for k, v in b.items() if k.endswith("_ms"))
        print(f"worker decode steps at batch {batch} (n={int(b['steps'])}), ms: {parts}")
    runs = sorted({s.get("run", "") for s in steps} - {""})
    for batch in (256, 1):
        for run in [None, *runs]:
            g = gap_parts(probe, batch, run)
            if g is not None:
                parts = ", ".join(f"{k} {v:.2f}" for k, v in g.items())
                where = f", run {run}" if run else ", all runs"
                print(f"between decode steps at batch {batch}{where}, medians in ms: {parts}")
    print_overhead_runs(probe, runs)
    threshold = int(probe.get("prefill_tokens") or 0)  # the probe's prefill window threshold; 0: off
    prefill = prefill_rate(steps, threshold)
    if prefill is not None:
        print(
            f"worker prefill steps (>= {threshold} tokens, n={int(prefill['steps'])}): median "
            f"{prefill['median_ms']:.1f} ms, {prefill['tokens_per_s']:,.0f} tokens/s"
        )
    print_run_timelines(probe, offline)
    hops = prefix_hops(probe, offline)
    if hops is not None:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in hops.items() if k != "requests")
        print(f"warm shared-prefix TTFT by hop (n={int(hops['requests'])}), medians in ms: {parts}")
    if steps:
        print(f"slowest worker steps: {slowest_steps(steps)}")
    for key, window in sorted(windows.items()):
        top = window.get("top_kernels_us_per_step", [])[:6]
        if top:
            print(f"top kernels per step, {key}: " + "; ".join(f"{n[:40]} {t:.0f}us" for n, t in top))
    for key, window in sorted(windows.items()):
        gaps = window.get("idle_gaps_us_per_step", [])[:4]
        if gaps:
            print(
                f"GPU idle per step, {key}, by the activity before / after: "
                + "; ".join(f"{b[:32]} / {a[:32]} {t:.0f}us ({c:.1f}x)" for b, a, t, c in gaps)
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
