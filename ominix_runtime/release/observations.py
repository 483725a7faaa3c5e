"""Per-request observations of one build: the gate's input format (``bench/serve.py --observations``
writes it; :mod:`~ominix_runtime.release.mirror` converts vLLM- and SGLang-style records to it).

A side::

    {"build": "ominix@abc123", "observations": [
      {"request_id": "req-0", "backend": "cuda", "accelerator": "H100", "model_version": "llama-8b@r1",
       "ok": true, "error": "", "latency_ms": 812.0, "ttft_ms": 41.0, "decode_gaps_ms": [6.1, 6.3],
       "output_token_ids": [791, 1917], "output_fingerprint": "sha256:...", "output_values": [-0.12],
       "queue_depth": 3, "kv_pressure_pct": 41.5, "route": "127.0.0.1:50061", "replica": "cuda-0"}]}

``output_fingerprint`` is derived from ``output_token_ids`` when only those are given; ``output_values``
are numbers (logprobs, scores) compared within a numeric tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ominix_runtime.release.fingerprint import token_fingerprint
from ominix_runtime.release.inputs import Fields, ReleaseInputError


@dataclass(frozen=True, slots=True)
class Segment:
    backend: str
    accelerator: str
    model_version: str

    def label(self) -> str:
        return f"{self.backend}/{self.accelerator}/{self.model_version}"


@dataclass(frozen=True, slots=True)
class Observation:
    request_id: str
    segment: Segment
    ok: bool
    error: str = ""
    latency_ms: float | None = None
    ttft_ms: float | None = None
    decode_gaps_ms: tuple[float, ...] = ()
    tpot_ms: float | None = None
    output_fingerprint: str = ""
    output_values: tuple[float, ...] | None = None
    queue_depth: int | None = None
    kv_pressure_pct: float | None = None
    route: str = ""
    replica: str = ""

    @property
    def decode_times_ms(self) -> list[float]:
        """Per-token decode times: the stream's gaps, or the mean TPOT when no gaps were recorded."""
        if self.decode_gaps_ms:
            return list(self.decode_gaps_ms)
        return [self.tpot_ms] if self.tpot_ms is not None else []

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "request_id": self.request_id,
            "backend": self.segment.backend,
            "accelerator": self.segment.accelerator,
            "model_version": self.segment.model_version,
            "ok": self.ok,
            "error": self.error,
            "latency_ms": self.latency_ms,
            "ttft_ms": self.ttft_ms,
            "decode_gaps_ms": list(self.decode_gaps_ms),
            "tpot_ms": self.tpot_ms,
            "output_fingerprint": self.output_fingerprint,
            "queue_depth": self.queue_depth,
            "kv_pressure_pct": self.kv_pressure_pct,
            "route": self.route,
            "replica": self.replica,
        }
        if self.output_values is not None:
            out["output_values"] = list(self.output_values)
        return out


@dataclass(frozen=True, slots=True)
class BuildObservations:
    build: str
    observations: tuple[Observation, ...] = field(default=())

    def by_request(self) -> dict[str, Observation]:
        return {o.request_id: o for o in self.observations}

    def to_json(self) -> dict[str, object]:
        return {"build": self.build, "observations": [o.to_json() for o in self.observations]}


def observation_from_json(f: Fields) -> Observation:
    ids = f.integers("output_token_ids")
    fp = f.text("output_fingerprint", "")
    if ids is not None:
        derived = token_fingerprint(ids)
        if fp and fp != derived:
            raise ReleaseInputError(f"{f.where}: output_fingerprint does not match output_token_ids")
        fp = derived
    values = f.numbers("output_values")
    return Observation(
        request_id=f.text("request_id"),
        segment=Segment(f.text("backend", ""), f.text("accelerator", ""), f.text("model_version", "")),
        ok=f.flag("ok", True),
        error=f.text("error", ""),
        latency_ms=f.optional_number("latency_ms", minimum=0.0),
        ttft_ms=f.optional_number("ttft_ms", minimum=0.0),
        decode_gaps_ms=tuple(f.numbers("decode_gaps_ms") or ()),
        tpot_ms=f.optional_number("tpot_ms", minimum=0.0),
        output_fingerprint=fp,
        output_values=tuple(values) if values is not None else None,
        queue_depth=f.optional_integer("queue_depth", minimum=0),
        kv_pressure_pct=f.optional_number("kv_pressure_pct", minimum=0.0),
        route=f.text("route", ""),
        replica=f.text("replica", ""),
    )


def build_from_json(f: Fields) -> BuildObservations:
    observations = [observation_from_json(o) for o in f.objects("observations", required=True)]
    seen: set[str] = set()
    for o in observations:
        if o.request_id in seen:
            raise ReleaseInputError(f"{f.where}: request id {o.request_id!r} is observed twice")
        seen.add(o.request_id)
    return BuildObservations(f.text("build", ""), tuple(observations))
