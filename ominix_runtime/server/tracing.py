"""OpenTelemetry traces of requests: a span per request with queue, prefill, decode and detokenize children.

Off unless the standard variables turn it on: ``OTEL_TRACES_EXPORTER`` (``console``, ``otlp``, ... — any
exporter registered under the ``opentelemetry_traces_exporter`` entry point; ``none`` is off) or an
``OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT``; ``OTEL_SDK_DISABLED=true`` wins. ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` name the resource. This module imports nothing from opentelemetry unless
tracing is on (the base install does not have it; ``pip install 'ominix-runtime[otel]'`` does).

A W3C ``traceparent`` from the caller (gRPC metadata, or an HTTP header on the v0 front) parents the
request span; the request then carries the span's own traceparent to the worker (NewRequest.traceparent).
With tracing off an incoming traceparent is passed on unchanged, so a traced worker still joins the trace.

Fronts use it in three calls: ``span = tracer.start(request_id, traceparent, model)`` when the request
arrives (``traceparent_from_grpc_metadata`` / ``traceparent_from_http_headers`` read the header), set
``request.traceparent = span.traceparent`` before submitting, and ``span.end(outcome)`` after its terminal
event; ``span.first_token()`` and ``span.detokenized(seconds)`` time the detokenization. The engine's run
report (``tracer.on_run_report``) adds the queue, prefill and decode children.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterable, Mapping
from importlib.metadata import entry_points
from typing import Any

from ominix_runtime.engine.stats import RunReport
from ominix_runtime.server.logging import get_logger

TRACEPARENT_HEADER = "traceparent"
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_EXPORTER_ENTRY_POINTS = "opentelemetry_traces_exporter"
# How long shutdown waits for the exporter to send the last spans: an unreachable collector would hold it for
# the exporter's own timeouts (10 s an attempt for OTLP), past a supervisor's kill timeout.
SHUTDOWN_TIMEOUT_S = 2.0

_log = get_logger("ominix.tracing")


def parse_traceparent(value: str | bytes | None) -> str:
    """``value`` if it is a valid W3C traceparent (version 00-fe, non-zero ids), else ""."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not value:
        return ""
    value = value.strip().lower()
    match = _TRACEPARENT.match(value)
    if match is None:
        return ""
    version, trace_id, span_id, _flags = match.groups()
    if version == "ff" or trace_id == "0" * 32 or span_id == "0" * 16:
        return ""
    return value


def traceparent_from_grpc_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The traceparent of a gRPC call's invocation metadata ("" if absent or malformed)."""
    for key, value in metadata or ():
        if key.lower() == TRACEPARENT_HEADER:
            return parse_traceparent(value)
    return ""


def traceparent_from_http_headers(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> str:
    """The traceparent of an HTTP request's headers, matched case-insensitively (for the v0 HTTP front)."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    for key, value in items:
        if key.lower() == TRACEPARENT_HEADER:
            return parse_traceparent(value)
    return ""


def tracing_configured(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard OTEL_* variables ask for traces."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def _wall_ns(monotonic_s: float, offset_ns: int) -> int:
    return int(monotonic_s * 1e9) + offset_ns


def _monotonic_to_wall_offset_ns() -> int:
    return time.time_ns() - time.monotonic_ns()


class RequestSpan:
    """One request's trace handle. This base records nothing: it only passes the caller's traceparent on."""

    def __init__(self, traceparent: str = "") -> None:
        self.traceparent = traceparent  # what the request carries to the worker

    def first_token(self) -> None:
        """The front received the request's first token (detokenization starts)."""

    def detokenized(self, seconds: float) -> None:
        """The front spent ``seconds`` turning tokens into text."""

    def add_phases(self, report: RunReport) -> None:
        """The engine's run report: queue, prefill and decode times."""

    def end(self, outcome: str, error: str = "") -> None:
        """The terminal event went out (``outcome``: done, error, rejected, cancelled)."""


class RequestTracer:
    """Starts request spans. This base is tracing off: spans only carry the incoming traceparent."""

    enabled = False

    def start(self, request_id: str, traceparent: str = "", model: str = "") -> RequestSpan:
        return RequestSpan(traceparent)

    def on_run_report(self, report: RunReport) -> None:
        """Engine run-report listener: adds the phases to the request's live span, if any."""

    def shutdown(self) -> None:
        """Flush and stop exporting."""


class OtelRequestSpan(RequestSpan):
    def __init__(self, tracer: OtelRequestTracer, request_id: str, root: Any, traceparent: str) -> None:
        super().__init__(traceparent)
        self._tracer = tracer
        self._request_id = request_id
        self._root = root
        self._first_token_ns: int | None = None
        self._detokenize_s = 0.0
        self._ended = False

    def first_token(self) -> None:
        if self._first_token_ns is None:
            self._first_token_ns = time.time_ns()

    def detokenized(self, seconds: float) -> None:
        self._detokenize_s += seconds

    def add_phases(self, report: RunReport) -> None:
        offset = _monotonic_to_wall_offset_ns()
        arrival = report.arrival_time
        end = _wall_ns(arrival + report.e2e, offset)
        scheduled = _wall_ns(arrival + report.queue_time, offset) if report.queue_time is not None else end
        first = _wall_ns(arrival + report.ttft, offset) if report.ttft is not None else end
        phases = (
            ("queue", _wall_ns(arrival, offset), scheduled),
            ("prefill", scheduled, max(scheduled, first)),
            ("decode", max(scheduled, first), end),
        )
        for name, start, stop in phases:
            if report.queue_time is None and name != "queue":
                break  # never scheduled: it only queued
            self._tracer.child(self._root, name, start, stop)
        self._root.set_attributes(
            {
                "ominix.worker_id": report.worker_id,
                "ominix.finish_reason": report.finish_reason.name.lower(),
                "ominix.preemptions": report.num_preemptions,
                "gen_ai.usage.input_tokens": report.prompt_tokens,
                "gen_ai.usage.output_tokens": report.output_tokens,
                "ominix.cached_tokens": report.cached_tokens,
            }
        )

    def end(self, outcome: str, error: str = "") -> None:
        if self._ended:
            return
        self._ended = True
        now = time.time_ns()
        if self._first_token_ns is not None:
            attributes = {"ominix.detokenize.busy_seconds": self._detokenize_s}
            self._tracer.child(self._root, "detokenize", self._first_token_ns, now, attributes)
        self._root.set_attribute("ominix.outcome", outcome)
        if error:
            self._tracer.mark_error(self._root, error)
        self._root.end(end_time=now)
        self._tracer.forget(self._request_id)


class OtelRequestTracer(RequestTracer):
    """Request spans through an OpenTelemetry TracerProvider (from the environment, or given by a test)."""

    enabled = True

    def __init__(self, provider: Any) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        self._provider = provider
        self._tracer = provider.get_tracer("ominix_runtime")
        self._propagator = TraceContextTextMapPropagator()
        self._live: dict[str, OtelRequestSpan] = {}

    def start(self, request_id: str, traceparent: str = "", model: str = "") -> RequestSpan:
        parent = self._propagator.extract({TRACEPARENT_HEADER: traceparent}) if traceparent else None
        root = self._tracer.start_span(
            "ominix.generate",
            context=parent,
            kind=self._trace.SpanKind.SERVER,
            attributes={"ominix.request_id": request_id, "gen_ai.request.model": model},
        )
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(root))
        span = OtelRequestSpan(self, request_id, root, carrier.get(TRACEPARENT_HEADER, traceparent))
        self._live[request_id] = span
        return span

    def on_run_report(self, report: RunReport) -> None:
        span = self._live.get(report.request_id)
        if span is not None:
            span.add_phases(report)

    def child(
        self, root: Any, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any] | None = None
    ) -> None:
        """A finished child span of ``root`` (phases are known only once they are over)."""
        span = self._tracer.start_span(
            name, context=self._trace.set_span_in_context(root), start_time=start_ns, attributes=attributes
        )
        span.end(end_time=max(start_ns, end_ns))

    def mark_error(self, span: Any, message: str) -> None:
        span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, message))

    def forget(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def shutdown(self) -> None:
        """Flush and stop exporting, for at most SHUTDOWN_TIMEOUT_S; spans still unsent then are dropped."""
        flushing = threading.Thread(target=self._provider.shutdown, name="otel-shutdown", daemon=True)
        flushing.start()
        flushing.join(SHUTDOWN_TIMEOUT_S)
        if flushing.is_alive():
            _log.warning(
                "trace export did not finish; the last spans are dropped", timeout_s=SHUTDOWN_TIMEOUT_S
            )


def tracer_from_environment(environ: Mapping[str, str] = os.environ) -> RequestTracer:
    """The tracer the OTEL_* variables ask for; tracing off (with a warning saying why) when it cannot be."""
    if not tracing_configured(environ):
        return RequestTracer()
    name = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() or "otlp"
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        _log.warning(
            "tracing is configured but opentelemetry-sdk is missing: pip install 'ominix-runtime[otel]'"
        )
        return RequestTracer()
    found = list(entry_points(group=_EXPORTER_ENTRY_POINTS, name=name))
    if not found:
        _log.warning(
            "tracing is configured but no trace exporter is installed under that name", exporter=name
        )
        return RequestTracer()
    exporter = found[0].load()()
    service = environ.get("OTEL_SERVICE_NAME", "").strip() or "ominix-runtime"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _log.info("tracing on", exporter=name)
    return OtelRequestTracer(provider)
