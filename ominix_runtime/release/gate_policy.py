"""The gate's policy: what rolls a candidate back, what holds it, and the numeric tolerances by scope."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ominix_runtime.release.inputs import Fields, ReleaseInputError
from ominix_runtime.release.observations import Segment

EVIDENCE_KINDS = ("route", "scheduler", "streaming", "outputs")


@dataclass(frozen=True, slots=True)
class NumericTolerance:
    """|candidate - baseline| <= abs + rel * |baseline| for every value, within its scope ("*" = any)."""

    model_version: str = "*"
    backend: str = "*"
    accelerator: str = "*"
    abs: float = 0.0
    rel: float = 0.0

    def covers(self, segment: Segment) -> bool:
        return all(
            want in ("*", have)
            for want, have in (
                (self.model_version, segment.model_version),
                (self.backend, segment.backend),
                (self.accelerator, segment.accelerator),
            )
        )

    def accepts(self, baseline: float, candidate: float) -> bool:
        return math.fabs(candidate - baseline) <= self.abs + self.rel * math.fabs(baseline)


@dataclass(frozen=True, slots=True)
class GatePolicy:
    # Rollback.
    max_output_mismatches: int = 0
    max_numeric_drifts: int = 0
    max_error_rate_increase: float = 0.01  # absolute, as a fraction of matched requests
    # Hold.
    max_latency_p95_regression_pct: float = 10.0
    max_ttft_p95_regression_pct: float = 10.0
    max_decode_p95_regression_pct: float = 10.0
    max_kv_pressure_p95_increase_pct: float = 5.0  # percentage points
    min_matched_requests: int = 20
    min_matched_fraction: float = 0.9  # of the larger side
    min_evidence_fraction: float = 1.0  # of matched requests, per evidence kind
    required_evidence: tuple[str, ...] = EVIDENCE_KINDS
    numeric_tolerances: tuple[NumericTolerance, ...] = field(default=())

    def tolerance_for(self, segment: Segment) -> NumericTolerance | None:
        """The most specific tolerance covering ``segment`` (fewest wildcards), or None."""
        covering = [t for t in self.numeric_tolerances if t.covers(segment)]
        if not covering:
            return None
        return min(covering, key=lambda t: (t.model_version, t.backend, t.accelerator).count("*"))

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            name: getattr(self, name) for name in self.__slots__ if name != "numeric_tolerances"
        }
        out["required_evidence"] = list(self.required_evidence)
        out["numeric_tolerances"] = [
            {
                "model_version": t.model_version,
                "backend": t.backend,
                "accelerator": t.accelerator,
                "abs": t.abs,
                "rel": t.rel,
            }
            for t in self.numeric_tolerances
        ]
        return out


def policy_from_json(f: Fields) -> GatePolicy:
    d = GatePolicy()
    evidence = f.value.get("required_evidence")
    if evidence is None:
        required = d.required_evidence
    else:
        if not isinstance(evidence, list) or any(e not in EVIDENCE_KINDS for e in evidence):
            raise ReleaseInputError(
                f"{f.where}.required_evidence must be a list drawn from {list(EVIDENCE_KINDS)}"
            )
        required = tuple(evidence)
    return GatePolicy(
        max_output_mismatches=f.integer("max_output_mismatches", d.max_output_mismatches, minimum=0),
        max_numeric_drifts=f.integer("max_numeric_drifts", d.max_numeric_drifts, minimum=0),
        max_error_rate_increase=f.number("max_error_rate_increase", d.max_error_rate_increase, minimum=0.0),
        max_latency_p95_regression_pct=f.number(
            "max_latency_p95_regression_pct", d.max_latency_p95_regression_pct, minimum=0.0
        ),
        max_ttft_p95_regression_pct=f.number(
            "max_ttft_p95_regression_pct", d.max_ttft_p95_regression_pct, minimum=0.0
        ),
        max_decode_p95_regression_pct=f.number(
            "max_decode_p95_regression_pct", d.max_decode_p95_regression_pct, minimum=0.0
        ),
        max_kv_pressure_p95_increase_pct=f.number(
            "max_kv_pressure_p95_increase_pct", d.max_kv_pressure_p95_increase_pct, minimum=0.0
        ),
        min_matched_requests=f.integer("min_matched_requests", d.min_matched_requests, minimum=0),
        min_matched_fraction=f.number("min_matched_fraction", d.min_matched_fraction, minimum=0.0),
        min_evidence_fraction=f.number("min_evidence_fraction", d.min_evidence_fraction, minimum=0.0),
        required_evidence=required,
        numeric_tolerances=tuple(
            NumericTolerance(
                model_version=t.text("model_version", "*"),
                backend=t.text("backend", "*"),
                accelerator=t.text("accelerator", "*"),
                abs=t.number("abs", 0.0, minimum=0.0),
                rel=t.number("rel", 0.0, minimum=0.0),
            )
            for t in f.objects("numeric_tolerances")
        ),
    )
