"""Turn vLLM- and SGLang-style observations of a mirrored run into gate input, and evaluate it.

Mirror JSON::

    {"policy": {...},
     "baseline":  {"format": "vllm", "build": "vllm-0.26.0", "backend": "vllm", "accelerator": "H100",
                   "model_version": "llama-8b@r1", "route": "mirror-a", "records": [...]},
     "candidate": {"format": "sglang", ..., "records": [...]}}

Formats (one reader class each):

- ``vllm``: per-request records shaped like vLLM's ``RequestOutput``: ``request_id``, ``outputs[0].token_ids``
  (or ``text``), ``metrics`` (``arrival_time``, ``first_token_time``, ``last_token_time``, ``finished_time``),
  optional ``stream_events`` (``timestamp`` per chunk), ``num_requests_waiting`` and ``kv_cache_usage_perc``
  (0-1, the engine gauges sampled at arrival), ``replica_id``, ``error``.
- ``sglang``: records shaped like SGLang's ``/generate`` answer: ``rid`` or ``meta_info.id``, ``output_ids``
  (or ``text``), ``meta_info.e2e_latency`` (s), ``sent_at`` and ``stream_events`` (``timestamp``),
  ``num_queue_reqs`` and ``token_usage`` (0-1), ``dp_rank`` or ``replica_id``, ``error``.
- ``bench-serve``: a ``vllm bench serve --save-result --save-detailed`` or SGLang ``bench_serving
  --output-details`` result (``ttfts``, ``itls``, ``generated_texts``, ``errors``) under ``result``; request
  ``i`` is ``req-i``, as bench/serve.py names its requests.
- ``ominix``: already in gate format (``observations``), e.g. from ``bench/serve.py --observations``.

Timestamps are seconds; TTFT = first stream event - arrival, decode gaps = gaps between stream events.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from ominix_runtime.release.fingerprint import fingerprint, token_fingerprint
from ominix_runtime.release.gate import evaluate
from ominix_runtime.release.gate_policy import policy_from_json
from ominix_runtime.release.inputs import Fields, ReleaseInputError
from ominix_runtime.release.observations import BuildObservations, Observation, Segment, build_from_json


def text_fingerprint(text: str) -> str:
    """Fingerprint of an output known only as text; never equal to a token fingerprint (other scheme)."""
    return "text-" + fingerprint(text)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 6)


def _gaps_ms(times: list[float]) -> tuple[float, ...]:
    return tuple(_ms(b - a) for a, b in zip(times, times[1:], strict=False))


def _event_times(f: Fields) -> list[float]:
    return [e.number("timestamp") for e in f.objects("stream_events")]


def _output_fingerprint(token_ids: list[int] | None, text: str | None) -> str:
    if token_ids is not None:
        return token_fingerprint(token_ids)
    return text_fingerprint(text) if text is not None else ""


def _pct(fraction: float | None) -> float | None:
    return None if fraction is None else round(fraction * 100.0, 6)


class ObservationSource(ABC):
    """Reads one side of a mirrored run written by some server's client into gate observations."""

    def __init__(self, side: Fields) -> None:
        self.side = side
        self.segment = Segment(
            side.text("backend", ""), side.text("accelerator", ""), side.text("model_version", "")
        )
        self.route = side.text("route", "")

    @abstractmethod
    def observations(self) -> list[Observation]: ...

    def build(self) -> BuildObservations:
        observations = self.observations()
        seen: set[str] = set()
        for o in observations:
            if o.request_id in seen:
                raise ReleaseInputError(f"{self.side.where}: request id {o.request_id!r} appears twice")
            seen.add(o.request_id)
        return BuildObservations(self.side.text("build", ""), tuple(observations))


class VllmRecords(ObservationSource):
    def observations(self) -> list[Observation]:
        return [self._one(r) for r in self.side.objects("records", required=True)]

    def _one(self, r: Fields) -> Observation:
        metrics = r.obj("metrics")
        arrival = metrics.number("arrival_time") if metrics.has("arrival_time") else r.number("arrival_time")
        events = _event_times(r)
        first = events[0] if events else metrics.optional_number("first_token_time")
        end = metrics.optional_number("finished_time") or metrics.optional_number("last_token_time")
        if end is None and events:
            end = events[-1]
        outputs = r.objects("outputs")
        output = outputs[0] if outputs else Fields({}, f"{r.where}.outputs[0]")
        error = r.text("error", "")
        return Observation(
            request_id=r.text("request_id"),
            segment=self._segment(r),
            ok=not error,
            error=error,
            latency_ms=_ms(end - arrival) if end is not None else None,
            ttft_ms=_ms(first - arrival) if first is not None else None,
            decode_gaps_ms=_gaps_ms(events),
            output_fingerprint=_output_fingerprint(
                output.integers("token_ids"), output.text("text", "") if output.has("text") else None
            ),
            queue_depth=r.optional_integer("num_requests_waiting", minimum=0),
            kv_pressure_pct=_pct(r.optional_number("kv_cache_usage_perc", minimum=0.0)),
            route=r.text("route", self.route),
            replica=r.text("replica_id", ""),
        )

    def _segment(self, r: Fields) -> Segment:
        return Segment(
            self.segment.backend, self.segment.accelerator, r.text("model", self.segment.model_version)
        )


class SglangRecords(ObservationSource):
    def observations(self) -> list[Observation]:
        return [self._one(r) for r in self.side.objects("records", required=True)]

    def _one(self, r: Fields) -> Observation:
        meta = r.obj("meta_info")
        rid = r.text("rid", "") or meta.text("id")
        events = _event_times(r)
        sent = r.optional_number("sent_at")
        latency_s = meta.optional_number("e2e_latency", minimum=0.0)
        if latency_s is None and sent is not None and events:
            latency_s = events[-1] - sent
        error = r.text("error", "")
        replica = r.text("replica_id", "") or (r.text("dp_rank") if r.has("dp_rank") else "")
        return Observation(
            request_id=rid,
            segment=Segment(
                self.segment.backend,
                self.segment.accelerator,
                r.text("model_version", self.segment.model_version),
            ),
            ok=not error,
            error=error,
            latency_ms=_ms(latency_s) if latency_s is not None else None,
            ttft_ms=_ms(events[0] - sent) if events and sent is not None else None,
            decode_gaps_ms=_gaps_ms(events),
            output_fingerprint=_output_fingerprint(
                r.integers("output_ids"), r.text("text", "") if r.has("text") else None
            ),
            queue_depth=r.optional_integer("num_queue_reqs", minimum=0),
            kv_pressure_pct=_pct(r.optional_number("token_usage", minimum=0.0)),
            route=r.text("route", self.route),
            replica=replica,
        )


class BenchServeResult(ObservationSource):
    def observations(self) -> list[Observation]:
        result = self.side.obj("result", required=True)
        ttfts = result.numbers("ttfts")
        if ttfts is None:
            raise ReleaseInputError(f"{result.where}.ttfts is missing")
        itls = result.value.get("itls") or [[] for _ in ttfts]
        texts = result.value.get("generated_texts") or [None for _ in ttfts]
        errors = result.value.get("errors") or ["" for _ in ttfts]
        if not (len(itls) == len(texts) == len(errors) == len(ttfts)):
            raise ReleaseInputError(
                f"{result.where}: ttfts, itls, generated_texts and errors differ in length"
            )
        out = []
        for i, ttft in enumerate(ttfts):
            gaps = Fields({"itl": itls[i]}, f"{result.where}.itls[{i}]").numbers("itl") or []
            error = str(errors[i] or "")
            text = texts[i]
            out.append(
                Observation(
                    request_id=f"req-{i}",
                    segment=self.segment,
                    ok=not error,
                    error=error,
                    latency_ms=_ms(ttft + sum(gaps)) if not error else None,
                    ttft_ms=_ms(ttft) if not error else None,
                    decode_gaps_ms=tuple(_ms(g) for g in gaps),
                    output_fingerprint=text_fingerprint(text) if isinstance(text, str) and not error else "",
                    route=self.route,
                )
            )
        return out


class NativeObservations(ObservationSource):
    def observations(self) -> list[Observation]:
        return list(build_from_json(self.side).observations)


_SOURCES: dict[str, type[ObservationSource]] = {
    "vllm": VllmRecords,
    "sglang": SglangRecords,
    "bench-serve": BenchServeResult,
    "ominix": NativeObservations,
}


def read_side(side: Fields) -> BuildObservations:
    source: type[ObservationSource] = side.choice("format", _SOURCES, "ominix")
    return source(side).build()


def mirror_gate(document: dict[str, object]) -> tuple[dict[str, object], dict[str, object]]:
    """(gate input, decision) for a mirror document."""
    root = Fields(document, "mirror")
    baseline = read_side(root.obj("baseline", required=True))
    candidate = read_side(root.obj("candidate", required=True))
    policy = root.obj("policy")
    gate_input: dict[str, object] = {
        "policy": dict(policy.value),
        "baseline": baseline.to_json(),
        "candidate": candidate.to_json(),
    }
    return gate_input, evaluate(baseline, candidate, policy_from_json(policy))
