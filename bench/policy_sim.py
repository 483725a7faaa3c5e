"""Scheduling settings compared off the device: the engine's own Scheduler under Poisson arrivals, on a simulated
clock where each step takes the time of a linear cost model.

Each variant is a set of ``SchedulerConfig`` fields. Requests arrive as bench/online.py sends them (its request
count and gaps: ``--seconds`` of Poisson arrivals at each rate, or ``--inf-prompts`` at once for ``inf``), each
with ``--input-len`` random prompt tokens and exactly ``--output-len`` output tokens. Steps go out as the engine
sends them: while fewer than its in-flight depth are out (``max_inflight_steps``, ``LIGHT_LOAD_INFLIGHT_STEPS``
while fewer than ``light_load_below_running`` requests run and none waits), else the oldest is answered and the
clock advances by its cost. A token's time is its step's answer.

The default cost (``--base-ms 5 --decode-ms 0.047 --prefill-ms 0.0235``) is fitted to an H200 serving the
Llama-3.1-8B shape in bf16 (bench/RESULTS.md, 2026-11-30): ITL p50 about 5 ms with a few decodes a step, 17 ms
at 32 req/s without the prefill limit (256 decodes a step), ITL p99 204 ms with 256 prompts at once (256 decodes
beside a 7,936-token prefill). ``--cost overlapped`` takes the larger of the fixed part and the prefill instead
of their sum, as the GEMMs of a prefill of a few hundred rows or more hide the weight reads (closer for a step
of one prompt beside a few decodes). ``--cost measured --bucket-ms FILE`` takes a step's rows from a table
measured on the device, padded as the worker pads them (``MeasuredRowsCost``). None knows attention length or
the host, so the figures say which setting shortens which gaps, not what a device will measure; a setting is
kept only after an A/B on a device (bench/online_service.sh, stages ab-start / ab-run).

    python bench/policy_sim.py --rates 4,8,16,32,inf --variant default= \\
        --variant nosplit=prefill_tokens_beside_decodes=0 --variant whole=max_batch_tokens_with_decodes=0
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import statistics
import sys
from collections import deque
from dataclasses import dataclass, fields, replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.common import fmt, format_table, percentile  # noqa: E402
from bench.online import num_prompts, parse_rates  # noqa: E402
from bench.serve import arrival_delays  # noqa: E402
from ominix_runtime.contract import (  # noqa: E402
    BackendCapability,
    DecodeStep,
    Done,
    Error,
    GenerateRequest,
    Granularity,
    SamplingParams,
    StepResult,
    Token,
)
from ominix_runtime.engine.config import EngineCoreConfig, SchedulerConfig  # noqa: E402
from ominix_runtime.engine.scheduler import Scheduler  # noqa: E402
from ominix_runtime.release.cost_model import StepCostModel, StepShape  # noqa: E402
from ominix_runtime.release.simulated_worker import SimulatedWorker  # noqa: E402
from ominix_runtime.testing.fake_backend import FakeConfig, fake_capability  # noqa: E402


class LinearStepCost(StepCostModel):
    """A step's milliseconds: a fixed part, plus a cost per decode and per prefill token."""

    name = "linear"

    def __init__(self, base_ms: float, decode_ms: float, prefill_ms: float) -> None:
        self.base_ms = base_ms
        self.decode_ms = decode_ms
        self.prefill_ms = prefill_ms

    def step_ms(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:  # only finished ids: the worker drops state, nothing runs on the device
            return 0.0
        return self.base_ms + self.decode_ms * shape.decode_tokens + self.prefill_ms * shape.prefill_tokens

    @property
    def idle_ms(self) -> float:
        return self.base_ms


class OverlappedStepCost(LinearStepCost):
    """The fixed part (a step's weight reads) overlaps a prefill's GEMMs, which are compute-bound from a few
    hundred rows on: a step takes the larger of the two, plus its decodes. On one H200 the Llama-3.1-8B shape's
    layer GEMMs took 5.6 / 10.1 / 21.0 / 43.5 ms at 256 / 512 / 1,024 / 2,048 rows (bench/RESULTS.md,
    2026-11-30), near proportional past 256; a 1,032-row mixed step (8 decodes) took 25.4 ms, where the linear
    model says 29.4 and this one 24.4."""

    name = "overlapped"

    def step_ms(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:
            return 0.0
        return max(self.base_ms, self.prefill_time_ms(shape)) + self.decode_ms * shape.decode_tokens

    def prefill_time_ms(self, shape: StepShape) -> float:
        """What the step's prefill costs beside the fixed part it overlaps."""
        return self.prefill_ms * shape.prefill_tokens


class MeasuredRowsCost(OverlappedStepCost):
    """The step's rows (prompt tokens and decodes) cost what a measured table says for the smallest row count
    in it that holds them, as the worker pads a step to its piecewise bucket; past the table's largest count,
    its rate per row. cuBLAS runs some row counts much slower than a few rows fewer (an H200 timed the 544-row
    bucket at 13.25 ms and the 512 at 10.29), which is what a split prompt pays for and no straight line
    shows. The weights' floor and the decodes' cost are as in ``overlapped``: a step takes the larger of the
    fixed part and its rows' time, plus its decodes (their attention; their rows' GEMMs count twice, ~0.02 ms
    a row). The table: ``--bucket-ms FILE``, bench/prefix_step.py's JSON (``piecewise_bucket_ms``, with
    ``--piecewise-fastest-bucket``) or a plain {rows: ms} object."""

    name = "measured"

    def __init__(
        self, base_ms: float, decode_ms: float, prefill_ms: float, rows_ms: dict[int, float]
    ) -> None:
        super().__init__(base_ms, decode_ms, prefill_ms)
        if not rows_ms or min(rows_ms) < 1 or not all(0 < ms < math.inf for ms in rows_ms.values()):
            raise ValueError("the measured table needs positive row counts with positive, finite times")
        self.rows = sorted(rows_ms)
        self.rows_ms = dict(rows_ms)

    def rows_time_ms(self, rows: int) -> float:
        """What ``rows`` rows cost: the smallest measured count that holds them, or past the table the largest
        count's rate per row."""
        at = bisect.bisect_left(self.rows, rows)
        if at < len(self.rows):
            return self.rows_ms[self.rows[at]]
        top = self.rows[-1]
        return self.rows_ms[top] * rows / top

    def prefill_time_ms(self, shape: StepShape) -> float:
        return self.rows_time_ms(shape.num_tokens) if shape.prefill_tokens else 0.0


def read_rows_ms(path: Path) -> dict[int, float]:
    """{rows: ms} from bench/prefix_step.py's JSON (its ``piecewise_bucket_ms``) or from a plain object."""
    data = json.loads(path.read_text())
    table = data.get("piecewise_bucket_ms", data) if isinstance(data, dict) else None
    refused = ValueError(
        f"{path}: no {{rows: ms}} table of row counts and milliseconds (prefix_step.py writes one with "
        "--piecewise-fastest-bucket)"
    )
    if not isinstance(table, dict) or not table:
        raise refused
    try:
        return {int(rows): float(ms) for rows, ms in table.items()}
    except (TypeError, ValueError):
        raise refused from None


COSTS: dict[str, type[LinearStepCost]] = {c.name: c for c in (LinearStepCost, OverlappedStepCost)}


@dataclass(frozen=True, slots=True)
class Workload:
    rate: float  # requests per second; math.inf: inf_prompts at once
    seconds: float
    inf_prompts: int
    input_len: int
    output_len: int
    seed: int


@dataclass(frozen=True, slots=True)
class SimResult:
    """One simulated run; times in ms."""

    requests: int
    duration_ms: float
    steps: int
    steps_with_prefill: int
    max_tokens_beside_decodes: int  # the most tokens in one step that carried a decode
    ttft_ms: list[float]
    tpot_ms: list[float]
    itl_ms: list[float]


def capability(max_batch_tokens: int, max_running: int, kv_blocks: int) -> BackendCapability:
    """A worker with the A/B's limits (``--max-batch-tokens 8192 --max-running-requests 256`` by default)."""
    config = FakeConfig(
        vocab_size=32_000, max_model_len=4096, kv_num_blocks=kv_blocks, kv_block_size=16,
        max_batch_tokens=max_batch_tokens, max_running_requests=max_running,
    )  # fmt: skip
    return fake_capability(config, Granularity.STEP)


def arrivals_ms(workload: Workload) -> list[float]:
    """Send times as bench/online.py's: its request count, and its gaps scaled to end at count / rate."""
    count = num_prompts(workload.rate, workload.seconds, workload.inf_prompts, min_prompts=16)
    times, t = [], 0.0
    for gap in arrival_delays(count, workload.rate, burstiness=1.0, seed=workload.seed):
        t += gap * 1e3
        times.append(t)
    return times


def simulate(
    cap: BackendCapability,
    config: SchedulerConfig,
    engine: EngineCoreConfig,
    cost: StepCostModel,
    w: Workload,
) -> SimResult:
    now_ms = 0.0
    scheduler = Scheduler(cap, config, clock=lambda: now_ms / 1e3, seed=0)
    worker = SimulatedWorker(
        scheduler.registry.num_blocks, cap.kv_block_size, cap.model.vocab_size, frozenset()
    )
    rng = random.Random(w.seed + 1)
    pending = deque(arrivals_ms(w))
    arrived: dict[str, float] = {}
    token_times: dict[str, list[float]] = {}
    inflight: deque[tuple[DecodeStep, StepResult, StepShape]] = deque()
    steps = steps_with_prefill = max_beside = ended = 0
    total = len(pending)
    while ended < total:
        while pending and pending[0] <= now_ms:
            rid = f"r{len(arrived)}"
            arrived[rid] = pending.popleft()
            scheduler.add_request(
                GenerateRequest(
                    request_id=rid,
                    prompt_token_ids=[rng.randrange(3, cap.model.vocab_size) for _ in range(w.input_len)],
                    sampling=SamplingParams(
                        max_tokens=w.output_len, temperature=0.0, ignore_eos=True, seed=0
                    ),
                    arrival_time=arrived[rid] / 1e3,
                )
            )
        step = (
            scheduler.schedule()
            if len(inflight) < engine.inflight_limit(scheduler.num_running, scheduler.num_waiting)
            else None
        )
        # A request schedule() ended (one it can never compute) ends here, not in an update.
        ended += sum(isinstance(event, Done | Error) for event in scheduler.take_events())
        if step is not None:
            plan = scheduler.last_plan
            assert plan is not None
            shape = StepShape(
                plan.num_prefill_tokens, plan.num_decode_tokens, scheduler.registry.num_leased_blocks
            )
            inflight.append((step, worker.execute(step), shape))
            steps += shape.num_tokens > 0
            steps_with_prefill += plan.num_prefill_tokens > 0
            if plan.num_decode_tokens:
                max_beside = max(max_beside, shape.num_tokens)
            continue  # the engine sends while its depth allows
        if not inflight:  # nothing to run until the next arrival
            if not pending:
                raise RuntimeError(
                    f"scheduler stalled: {scheduler.num_waiting} waiting, {scheduler.num_running} running, "
                    "nothing scheduled and nothing left to arrive"
                )
            now_ms = max(now_ms, pending[0])
            continue
        answered, result, shape = inflight.popleft()
        now_ms += cost.step_ms(shape)
        for event in scheduler.update(answered, result):
            if isinstance(event, Token):
                token_times.setdefault(event.request_id, []).extend([now_ms] * len(event.token_ids))
            elif isinstance(event, Done | Error):
                ended += 1
    ttft: list[float] = []
    tpot: list[float] = []
    itl: list[float] = []
    for rid, times in token_times.items():
        ttft.append(times[0] - arrived[rid])
        if len(times) > 1:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
            itl.extend(b - a for a, b in zip(times, times[1:], strict=False))
    return SimResult(total, now_ms, steps, steps_with_prefill, max_beside, ttft, tpot, itl)


def parse_variant(text: str) -> tuple[str, SchedulerConfig]:
    """``LABEL=`` or ``LABEL=field=value,field=value`` with ``SchedulerConfig`` integer or true/false fields."""
    label, sep, body = text.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"variant {text!r} is not LABEL=[field=value,...]")
    known = {f.name: f for f in fields(SchedulerConfig)}
    values: dict[str, int | bool] = {}
    defaults = SchedulerConfig()
    for item in filter(None, body.split(",")):
        name, sep, raw = item.partition("=")
        if not sep or name not in known:
            raise argparse.ArgumentTypeError(
                f"variant {label}: {item!r} is not a SchedulerConfig field=value"
            )
        if isinstance(getattr(defaults, name), bool):
            if raw not in ("true", "false"):
                raise argparse.ArgumentTypeError(f"variant {label}: {name} is true or false, got {raw!r}")
            values[name] = raw == "true"
            continue
        try:
            values[name] = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"variant {label}: {name}={raw!r} is not an integer") from None
    return label, replace(SchedulerConfig(), **values)  # type: ignore[arg-type]


def summary_row(label: str, rate: float, runs: list[SimResult]) -> dict[str, float | str]:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    return {
        "variant": label,
        "rate": "inf" if math.isinf(rate) else f"{rate:g}",
        "duration_s": med([r.duration_ms / 1e3 for r in runs]),
        "ttft_p50": med([percentile(r.ttft_ms, 50) for r in runs]),
        "ttft_p99": med([percentile(r.ttft_ms, 99) for r in runs]),
        "tpot_p50": med([percentile(r.tpot_ms, 50) for r in runs]),
        "itl_p50": med([percentile(r.itl_ms, 50) for r in runs]),
        "itl_p99": med([percentile(r.itl_ms, 99) for r in runs]),
        "steps_with_prefill": med([r.steps_with_prefill / max(r.steps, 1) for r in runs]),
        "max_tokens_beside_decodes": med([r.max_tokens_beside_decodes for r in runs]),
    }


def cell(value: float | str) -> str:
    if isinstance(value, str):
        return value
    return fmt(value, 2 if abs(value) < 10 else 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", type=parse_variant, help="LABEL=[field=value,...] (repeat)")
    p.add_argument("--rates", default="4,8,16,32,inf")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--inf-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--seeds", type=int, default=5, help="runs per rate and variant; the table shows medians")
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument(
        "--kv-blocks", type=int, default=22_000, help="16-token blocks (0.45 of an H200 for Llama-8B)"
    )
    p.add_argument("--base-ms", type=float, default=5.0)
    p.add_argument("--decode-ms", type=float, default=0.047)
    p.add_argument("--prefill-ms", type=float, default=0.0235)
    p.add_argument(
        "--cost",
        choices=sorted([*COSTS, MeasuredRowsCost.name]),
        default="linear",
        help="linear: base + decodes + prefill; overlapped: max(base, prefill) + decodes; measured: max(base, "
        "the step's rows from --bucket-ms) + decodes",
    )
    p.add_argument(
        "--bucket-ms", type=Path, help="with --cost measured: the {rows: ms} table (see MeasuredRowsCost)"
    )
    p.add_argument("--out-json", type=Path)
    args = p.parse_args(argv)
    variants = args.variant or [("default", SchedulerConfig())]
    cap = capability(args.max_batch_tokens, args.max_running_requests, args.kv_blocks)
    if (args.cost == MeasuredRowsCost.name) != (args.bucket_ms is not None):
        p.error("--cost measured and --bucket-ms FILE go together")
    cost: LinearStepCost
    if args.bucket_ms is not None:
        try:
            rows_ms = read_rows_ms(args.bucket_ms)
            cost = MeasuredRowsCost(args.base_ms, args.decode_ms, args.prefill_ms, rows_ms)
        except (OSError, ValueError) as exc:
            p.error(str(exc))
    else:
        cost = COSTS[args.cost](args.base_ms, args.decode_ms, args.prefill_ms)
    rows: list[dict[str, float | str]] = []
    for rate in parse_rates(args.rates):
        for label, config in variants:
            runs = [
                simulate(
                    cap,
                    config,
                    EngineCoreConfig(),
                    cost,
                    Workload(rate, args.seconds, args.inf_prompts, args.input_len, args.output_len, seed),
                )  # fmt: skip
                for seed in range(args.seeds)
            ]
            rows.append(summary_row(label, rate, runs))
    header = list(rows[0])
    print(format_table([[cell(v) for v in row.values()] for row in rows], header))
    if args.out_json:
        args.out_json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
