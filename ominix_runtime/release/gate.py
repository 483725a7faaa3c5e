"""Promote, hold or roll back a candidate build from mirrored baseline and candidate observations.

Observations are joined by request id. Rollback: output mismatches (exact token fingerprints), numeric drift
(values outside the tolerance scoped to model version, backend and accelerator) or an error-rate increase
above policy. Hold: p95 regressions of latency, TTFT, decode time per token or KV pressure, missing route /
scheduler / streaming / output evidence, or too little matched traffic. Promote otherwise. The same rules
run per segment (backend, accelerator, model version of the candidate), and every fired signal becomes a
triage item.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum

from ominix_runtime.release.gate_policy import GatePolicy, policy_from_json
from ominix_runtime.release.inputs import Fields
from ominix_runtime.release.observations import (
    BuildObservations,
    Observation,
    Segment,
    build_from_json,
)
from ominix_runtime.release.stats import percentile

_EXAMPLES = 5  # request ids named per triage item


class Decision(Enum):
    PROMOTE = "promote"
    HOLD = "hold"
    ROLLBACK = "rollback"


@dataclass(frozen=True, slots=True)
class _Triage:
    response: Decision
    owner_hint: str
    next_step: str


_TRIAGE = {
    "output_mismatch": _Triage(
        Decision.ROLLBACK,
        "model loading / worker kernels",
        "diff the token streams of the listed requests against the baseline (greedy, same prompts)",
    ),
    "numeric_drift": _Triage(
        Decision.ROLLBACK,
        "worker numerics (kernels, dtype, attention backend)",
        "compare the listed requests' values with the scope's tolerance; bisect kernel and dtype changes",
    ),
    "error_rate": _Triage(
        Decision.ROLLBACK,
        "engine and front API",
        "read the candidate's errors for the listed requests; replay them against the candidate alone",
    ),
    "latency_p95": _Triage(
        Decision.HOLD,
        "engine step loop and scheduler",
        "replay the workload on both builds (ominix-runtime replay) and compare traces; profile the step loop",
    ),
    "ttft_p95": _Triage(
        Decision.HOLD,
        "scheduler admission and prefill chunking",
        "compare queue depth at arrival and prefill chunk sizes in a replay of the mirrored workload",
    ),
    "decode_p95": _Triage(
        Decision.HOLD,
        "worker decode path",
        "profile steady decode (bench/step_probe.py) on both builds at the mirrored batch sizes",
    ),
    "kv_pressure": _Triage(
        Decision.HOLD,
        "KV registry and cache sizing",
        "compare kv_num_blocks and prefix-cache hit rates; replay to see peak KV blocks per tick",
    ),
    "missing_evidence": _Triage(
        Decision.HOLD,
        "benchmark and observability",
        "record route and replica, queue depth and KV usage, stream timestamps and outputs for every request",
    ),
    "too_little_traffic": _Triage(
        Decision.HOLD,
        "release (mirror coverage)",
        "mirror more traffic, or the same request ids on both builds, and gate again",
    ),
}


@dataclass(slots=True)
class Signal:
    name: str
    detail: str
    request_ids: list[str] = field(default_factory=list)

    @property
    def response(self) -> Decision:
        return _TRIAGE[self.name].response


_Measured = tuple[str, list[float], list[float]]  # request id, baseline values, candidate values


@dataclass(frozen=True, slots=True)
class _Pair:
    baseline: Observation
    candidate: Observation


def _regression_pct(baseline: float, candidate: float) -> float:
    return round(100.0 * (candidate - baseline) / baseline, 3) if baseline > 0 else 0.0


def _decision(signals: list[Signal]) -> Decision:
    if any(s.response == Decision.ROLLBACK for s in signals):
        return Decision.ROLLBACK
    if signals:
        return Decision.HOLD
    return Decision.PROMOTE


def _comparable_fingerprints(a: str, b: str) -> bool:
    """Both present and of one scheme (token ids vs text fingerprints cannot be compared)."""
    return bool(a and b) and a.split(":", 1)[0] == b.split(":", 1)[0]


def _has_evidence(kind: str, b: Observation, c: Observation) -> bool:
    """Whether both sides of a pair carry this kind of evidence (outputs: in a form that can be compared)."""
    if kind == "outputs":
        both_values = b.output_values is not None and c.output_values is not None
        return both_values or _comparable_fingerprints(b.output_fingerprint, c.output_fingerprint)
    return all(_has_own_evidence(kind, o) for o in (b, c))


def _has_own_evidence(kind: str, o: Observation) -> bool:
    if kind == "route":
        return bool(o.route)
    if kind == "scheduler":
        return o.queue_depth is not None and o.kv_pressure_pct is not None
    return o.ttft_ms is not None  # streaming


class _Assessment:
    """Figures and signals for a set of matched pairs under one policy."""

    def __init__(self, pairs: list[_Pair], policy: GatePolicy) -> None:
        self.pairs = pairs
        self.policy = policy
        self.signals: list[Signal] = []
        self.figures: dict[str, object] = {"matched": len(pairs)}
        self._outputs()
        self._errors()
        self._latency()
        self._evidence()

    def _outputs(self) -> None:
        exact = within = unchecked = 0
        mismatched: list[str] = []
        drifted: list[str] = []
        max_delta = 0.0
        for p in self.pairs:
            b, c = p.baseline, p.candidate
            if not (b.ok and c.ok):
                continue
            tolerance = self.policy.tolerance_for(c.segment)
            if b.output_values is not None and c.output_values is not None:
                same_shape = len(b.output_values) == len(c.output_values)
                deltas = [abs(x - y) for x, y in zip(b.output_values, c.output_values, strict=False)]
                max_delta = max([max_delta, *deltas])
                if same_shape and b.output_values == c.output_values:
                    exact += 1
                elif (
                    same_shape
                    and tolerance is not None
                    and all(
                        tolerance.accepts(x, y) for x, y in zip(b.output_values, c.output_values, strict=True)
                    )
                ):
                    within += 1
                elif tolerance is not None:
                    drifted.append(c.request_id)
                else:
                    mismatched.append(c.request_id)
            elif _comparable_fingerprints(b.output_fingerprint, c.output_fingerprint):
                if b.output_fingerprint == c.output_fingerprint:
                    exact += 1
                else:
                    mismatched.append(c.request_id)
            else:
                unchecked += 1
        self.figures["outputs"] = {
            "exact_matches": exact,
            "within_tolerance": within,
            "mismatches": len(mismatched),
            "numeric_drifts": len(drifted),
            "unchecked": unchecked,
            "max_abs_delta": round(max_delta, 9),
        }
        if len(mismatched) > self.policy.max_output_mismatches:
            self.signals.append(
                Signal("output_mismatch", f"{len(mismatched)} outputs differ from the baseline", mismatched)
            )
        if len(drifted) > self.policy.max_numeric_drifts:
            self.signals.append(
                Signal(
                    "numeric_drift", f"{len(drifted)} outputs drift beyond their numeric tolerance", drifted
                )
            )

    def _errors(self) -> None:
        n = len(self.pairs)
        base = sum(1 for p in self.pairs if not p.baseline.ok)
        cand = sum(1 for p in self.pairs if not p.candidate.ok)
        base_rate = base / n if n else 0.0
        cand_rate = cand / n if n else 0.0
        increase = cand_rate - base_rate
        self.figures["errors"] = {
            "baseline": base,
            "candidate": cand,
            "baseline_rate": round(base_rate, 6),
            "candidate_rate": round(cand_rate, 6),
            "rate_increase": round(increase, 6),
        }
        if increase > self.policy.max_error_rate_increase:
            failed = [p.candidate.request_id for p in self.pairs if not p.candidate.ok and p.baseline.ok]
            self.signals.append(
                Signal(
                    "error_rate",
                    f"error rate {cand_rate:.1%} vs baseline {base_rate:.1%} "
                    f"(+{increase:.1%} > {self.policy.max_error_rate_increase:.1%})",
                    failed,
                )
            )

    def _compare_p95(
        self, key: str, signal: str, limit: float, values: list[_Measured], points: bool
    ) -> None:
        base = [v for _, b, _ in values for v in b]
        cand = [v for _, _, c in values for v in c]
        if not base or not cand:
            self.figures[key] = None
            return
        base_p95, cand_p95 = percentile(base, 95), percentile(cand, 95)
        change = round(cand_p95 - base_p95, 3) if points else _regression_pct(base_p95, cand_p95)
        self.figures[key] = {
            "baseline_p95": round(base_p95, 3),
            "candidate_p95": round(cand_p95, 3),
            ("increase_points" if points else "regression_pct"): change,
        }
        if change > limit:
            unit = " points" if points else "%"
            # The requests that got worst, by their own p95, as examples.
            worst = sorted(values, key=lambda m: percentile(m[2], 95) - percentile(m[1], 95), reverse=True)
            self.signals.append(
                Signal(
                    signal,
                    f"{key} p95 {cand_p95:.2f} vs {base_p95:.2f} (+{change:.1f}{unit} > {limit}{unit})",
                    [rid for rid, _, _ in worst],
                )
            )

    def _latency(self) -> None:
        both_ok = [p for p in self.pairs if p.baseline.ok and p.candidate.ok]

        def scalar(name: str) -> list[_Measured]:
            out = []
            for p in both_ok:
                b, c = getattr(p.baseline, name), getattr(p.candidate, name)
                if b is not None and c is not None:
                    out.append((p.candidate.request_id, [float(b)], [float(c)]))
            return out

        policy = self.policy
        self._compare_p95(
            "latency_ms", "latency_p95", policy.max_latency_p95_regression_pct, scalar("latency_ms"), False
        )
        self._compare_p95("ttft_ms", "ttft_p95", policy.max_ttft_p95_regression_pct, scalar("ttft_ms"), False)
        decode = [
            (p.candidate.request_id, p.baseline.decode_times_ms, p.candidate.decode_times_ms) for p in both_ok
        ]
        decode = [(rid, b, c) for rid, b, c in decode if b and c]
        self._compare_p95(
            "decode_ms_per_token", "decode_p95", policy.max_decode_p95_regression_pct, decode, False
        )
        self._compare_p95(
            "kv_pressure_pct",
            "kv_pressure",
            policy.max_kv_pressure_p95_increase_pct,
            scalar("kv_pressure_pct"),
            True,
        )

    def _evidence(self) -> None:
        # A failed request has no stream or output to show; the error-rate rule judges it instead.
        both_ok = [p for p in self.pairs if p.baseline.ok and p.candidate.ok]
        n = len(both_ok)
        evidence: dict[str, float] = {}
        for kind in self.policy.required_evidence:
            lacking = [
                p.candidate.request_id for p in both_ok if not _has_evidence(kind, p.baseline, p.candidate)
            ]
            evidence[kind] = round((n - len(lacking)) / n, 6) if n else 0.0
            if n and evidence[kind] < self.policy.min_evidence_fraction:
                self.signals.append(
                    Signal(
                        "missing_evidence",
                        f"{kind} evidence on {evidence[kind]:.0%} of matched requests "
                        f"(< {self.policy.min_evidence_fraction:.0%})",
                        lacking,
                    )
                )
        self.figures["evidence"] = evidence

    def summary(self) -> dict[str, object]:
        return {"decision": _decision(self.signals).value, **self.figures}


def _triage(signals: list[Signal], segment: str) -> list[dict[str, object]]:
    return [
        {
            "signal": s.name,
            "response": s.response.value,
            "segment": segment,
            "detail": s.detail,
            "owner_hint": _TRIAGE[s.name].owner_hint,
            "next_step": _TRIAGE[s.name].next_step,
            "example_request_ids": s.request_ids[:_EXAMPLES],
        }
        for s in signals
    ]


def evaluate(
    baseline: BuildObservations, candidate: BuildObservations, policy: GatePolicy
) -> dict[str, object]:
    """The gate decision document for ``candidate`` against ``baseline``."""
    base = baseline.by_request()
    cand = candidate.by_request()
    pairs = [_Pair(base[rid], cand[rid]) for rid in sorted(cand) if rid in base]
    overall = _Assessment(pairs, policy)
    larger = max(len(base), len(cand))
    matched_fraction = len(pairs) / larger if larger else 0.0
    if len(pairs) < policy.min_matched_requests or matched_fraction < policy.min_matched_fraction:
        overall.signals.append(
            Signal(
                "too_little_traffic",
                f"{len(pairs)} matched requests ({matched_fraction:.0%} of {larger}); policy needs "
                f"{policy.min_matched_requests} and {policy.min_matched_fraction:.0%}",
            )
        )
    grouped: dict[Segment, list[_Pair]] = defaultdict(list)
    for p in pairs:
        grouped[p.candidate.segment].append(p)
    segments = []
    triage = _triage(overall.signals, "all")
    for segment in sorted(grouped, key=lambda s: s.label()):
        assessment = _Assessment(grouped[segment], policy)
        segments.append(
            {
                "backend": segment.backend,
                "accelerator": segment.accelerator,
                "model_version": segment.model_version,
                **assessment.summary(),
            }
        )
        if len(grouped) > 1:
            triage += _triage(assessment.signals, segment.label())
    decision = _decision(overall.signals)
    return {
        "decision": decision.value,
        "reasons": [f"{s.response.value}: {s.name}: {s.detail}" for s in overall.signals],
        "baseline_build": baseline.build,
        "candidate_build": candidate.build,
        "traffic": {
            "baseline_requests": len(base),
            "candidate_requests": len(cand),
            "matched": len(pairs),
            "matched_fraction": round(matched_fraction, 6),
            "baseline_only": sorted(set(base) - set(cand))[:_EXAMPLES],
            "candidate_only": sorted(set(cand) - set(base))[:_EXAMPLES],
        },
        "summary": overall.summary(),
        "segments": segments,
        "triage": triage,
        "policy": policy.to_json(),
    }


def gate_from_json(document: dict[str, object]) -> dict[str, object]:
    """Evaluate a gate document ``{"policy": {...}, "baseline": side, "candidate": side}``."""
    root = Fields(document, "gate")
    return evaluate(
        build_from_json(root.obj("baseline", required=True)),
        build_from_json(root.obj("candidate", required=True)),
        policy_from_json(root.obj("policy")),
    )
