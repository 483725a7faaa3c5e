"""OpenTelemetry request traces: off by default (nothing imported), on by the standard OTEL_* variables; the
span tree of a request through a real daemon (SDK in-memory exporter); the traceparent reaches the worker step."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "server"))  # the in-thread daemon harness

from server_harness import SMOLLM2_VOCAB, RunningDaemon, start_daemon, stop_daemon  # noqa: E402

from ominix_runtime import wire  # noqa: E402
from ominix_runtime.config import FrontConfig  # noqa: E402
from ominix_runtime.contract import DecodeStep, NewRequestData, SamplingParams  # noqa: E402
from ominix_runtime.engine import EngineCore, EngineCoreConfig  # noqa: E402
from ominix_runtime.pb import common_pb2, engine_pb2  # noqa: E402
from ominix_runtime.server import app as app_module  # noqa: E402
from ominix_runtime.server.engine_service import EngineService  # noqa: E402
from ominix_runtime.server.tracing import (  # noqa: E402
    OtelRequestTracer,
    RequestTracer,
    parse_traceparent,
    traceparent_from_grpc_metadata,
    traceparent_from_http_headers,
    tracing_configured,
)
from ominix_runtime.testing.fake_backend import FakeConfig, FakeStepBackend  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"
_NO_OTEL_ENV = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}


def test_parse_traceparent() -> None:
    assert parse_traceparent(TRACEPARENT) == TRACEPARENT
    assert parse_traceparent(TRACEPARENT.upper().encode()) == TRACEPARENT
    for bad in (
        "",
        None,
        "00-abc-def-01",
        f"ff-{TRACE_ID}-{PARENT_SPAN}-01",
        f"00-{'0' * 32}-{PARENT_SPAN}-01",
    ):
        assert parse_traceparent(bad) == ""
    assert traceparent_from_grpc_metadata([("user-agent", "x"), ("traceparent", TRACEPARENT)]) == TRACEPARENT
    assert traceparent_from_grpc_metadata(None) == ""
    assert traceparent_from_http_headers({"TraceParent": TRACEPARENT}) == TRACEPARENT
    assert traceparent_from_http_headers([("traceparent", "garbage")]) == ""


def test_tracing_is_configured_only_by_otel_variables() -> None:
    assert not tracing_configured({})
    assert tracing_configured({"OTEL_TRACES_EXPORTER": "console"})
    assert not tracing_configured({"OTEL_TRACES_EXPORTER": "none"})
    assert tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert not tracing_configured({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"})


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, check=False
    )


def test_off_by_default_imports_no_opentelemetry() -> None:
    code = (
        "import sys\n"
        "from ominix_runtime.server import app\n"
        "from ominix_runtime.server.tracing import tracer_from_environment\n"
        "assert not tracer_from_environment().enabled\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    result = _python(code, _NO_OTEL_ENV)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_console_exporter_from_the_environment() -> None:
    code = (
        "from ominix_runtime.server.tracing import tracer_from_environment\n"
        "tracer = tracer_from_environment()\n"
        "assert tracer.enabled\n"
        f"span = tracer.start('r1', '{TRACEPARENT}', 'm')\n"
        "span.end('done')\n"
        "tracer.shutdown()\n"
    )
    env = {**_NO_OTEL_ENV, "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "engine-a"}
    result = _python(code, env)
    assert result.returncode == 0, result.stderr
    assert '"name": "ominix.generate"' in result.stdout and TRACE_ID in result.stdout
    assert '"service.name": "engine-a"' in result.stdout


def test_an_exporter_that_is_not_installed_leaves_tracing_off() -> None:
    code = "from ominix_runtime.server.tracing import tracer_from_environment\nprint(tracer_from_environment().enabled)"
    result = _python(code, {**_NO_OTEL_ENV, "OTEL_TRACES_EXPORTER": "no-such-exporter"})
    assert result.returncode == 0 and result.stdout.strip().endswith("False"), result.stderr


def test_worker_step_carries_the_traceparent_over_the_wire() -> None:
    step = DecodeStep(
        1, new_requests=[NewRequestData("r", [1, 2], SamplingParams(), [0], 0, 2, 7, [], TRACEPARENT)]
    )
    assert wire.step_from_pb(wire.step_to_pb(step)).new_requests[0].traceparent == TRACEPARENT


# ---- through a real daemon (fake backend, real gRPC on loopback) ----------------------------------------


def _fake() -> FakeConfig:
    return FakeConfig(vocab_size=SMOLLM2_VOCAB, eos_token_ids=(2,), max_model_len=2048, kv_num_blocks=64)


@pytest.fixture(scope="module")
def traced() -> Iterator[tuple[RunningDaemon, object]]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    patch = pytest.MonkeyPatch()
    patch.setattr(app_module, "tracer_from_environment", lambda: OtelRequestTracer(provider))
    try:
        running, thread = start_daemon(_fake())
    finally:
        patch.undo()
    try:
        yield running, exporter
    finally:
        stop_daemon(running, thread)


def _generate(daemon: RunningDaemon, rid: str, metadata: tuple = (), **fields: object) -> list:
    sampling = common_pb2.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    request = engine_pb2.GenerateRequest(request_id=rid, prompt="trace me", sampling=sampling, **fields)
    return list(daemon.stub.Generate(request, metadata=metadata, timeout=30))


def _spans_of(exporter: object, rid: str) -> tuple[object, dict[str, object]]:
    spans = exporter.get_finished_spans()  # type: ignore[attr-defined]  # an InMemorySpanExporter, imported lazily
    (root,) = [s for s in spans if s.name == "ominix.generate" and s.attributes["ominix.request_id"] == rid]
    children = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id}
    return root, children


def _new_request(daemon: RunningDaemon, rid: str) -> NewRequestData:
    return next(n for step in daemon.backend.steps_seen for n in step.new_requests if n.request_id == rid)


def test_request_span_tree_under_the_callers_trace(traced: tuple[RunningDaemon, object]) -> None:
    daemon, exporter = traced
    events = _generate(daemon, "traced-1", metadata=(("traceparent", TRACEPARENT),))
    assert events[-1].HasField("done")
    root, children = _spans_of(exporter, "traced-1")
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    assert f"{root.parent.span_id:016x}" == PARENT_SPAN and root.parent.is_remote
    assert root.kind.name == "SERVER"
    assert root.attributes["gen_ai.request.model"] == "SmolLM2-135M-Instruct"
    assert root.attributes["gen_ai.usage.output_tokens"] == 5 and root.attributes["ominix.outcome"] == "done"
    assert set(children) == {"queue", "prefill", "decode", "detokenize"}
    q, p, d, t = (children[n] for n in ("queue", "prefill", "decode", "detokenize"))
    assert root.start_time <= q.start_time <= q.end_time <= p.start_time <= p.end_time <= d.start_time
    assert d.end_time <= root.end_time and t.end_time <= root.end_time
    assert p.end_time <= t.start_time  # detokenization starts with the first token
    assert t.attributes["ominix.detokenize.busy_seconds"] > 0
    # The worker step names the request span as the parent for the worker's own spans.
    sent = _new_request(daemon, "traced-1").traceparent
    assert sent == f"00-{TRACE_ID}-{root.context.span_id:016x}-01"


def test_untraced_caller_starts_a_new_trace(traced: tuple[RunningDaemon, object]) -> None:
    daemon, exporter = traced
    _generate(daemon, "traced-2", metadata=(("traceparent", "not-a-traceparent"),))
    root, children = _spans_of(exporter, "traced-2")
    assert root.parent is None and len(children) == 4
    ctx = root.context
    expected = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    assert _new_request(daemon, "traced-2").traceparent == expected


def test_rejected_and_cancelled_requests_end_their_spans(traced: tuple[RunningDaemon, object]) -> None:
    daemon, exporter = traced
    with pytest.raises(grpc.RpcError):
        _generate(daemon, "traced-3", model="no-such-model")
    root, children = _spans_of(exporter, "traced-3")
    assert root.attributes["ominix.outcome"] == "rejected" and root.status.status_code.name == "ERROR"
    assert children == {}
    sampling = common_pb2.SamplingParams(max_tokens=1000, ignore_eos=True)
    call = daemon.stub.Generate(
        engine_pb2.GenerateRequest(request_id="traced-4", prompt="long", sampling=sampling), timeout=30
    )
    for event in call:
        if event.HasField("token"):
            break
    call.cancel()
    deadline = __import__("time").monotonic() + 10
    while not [
        s for s in exporter.get_finished_spans() if s.attributes.get("ominix.request_id") == "traced-4"
    ]:
        assert __import__("time").monotonic() < deadline, "the cancelled request's span did not end"
        __import__("time").sleep(0.05)
    root, children = _spans_of(exporter, "traced-4")
    assert root.attributes["ominix.outcome"] == "cancelled"
    assert root.attributes["ominix.finish_reason"] == "abort"
    assert {"queue", "prefill", "decode"} <= set(children)


def test_tracing_off_passes_the_callers_traceparent_on() -> None:
    assert not RequestTracer().enabled
    daemon, thread = start_daemon(_fake())
    try:
        assert not daemon.daemon.tracer.enabled
        _generate(daemon, "plain-1", metadata=(("traceparent", TRACEPARENT),))
        _generate(daemon, "plain-2", metadata=(("traceparent", "00-zz-zz-01"),))
        assert _new_request(daemon, "plain-1").traceparent == TRACEPARENT
        assert _new_request(daemon, "plain-2").traceparent == ""
    finally:
        stop_daemon(daemon, thread)


def test_request_level_backend_gets_the_traceparent_header() -> None:
    """SGLang (request level) receives the request's trace context as a W3C traceparent HTTP header."""
    from ominix_runtime.backends.sglang import SGLangBackend
    from ominix_runtime.contract import GenerateRequest
    from ominix_runtime.testing.fake_sglang import FakeSGLangServer, FakeSGLangState

    async def main() -> list[str]:
        state = FakeSGLangState()
        async with FakeSGLangServer(state) as server:
            backend = SGLangBackend(server.url, timeout=5.0)
            try:
                for rid, traceparent in (("s-1", TRACEPARENT), ("s-2", "")):
                    request = GenerateRequest(
                        rid, [5, 6, 7], SamplingParams(max_tokens=2), traceparent=traceparent
                    )
                    events = [e async for e in backend.generate(request)]
                    assert type(events[-1]).__name__ == "Done"
            finally:
                await backend.close()
        return state.generate_traceparents

    assert asyncio.run(asyncio.wait_for(main(), 60)) == [TRACEPARENT, ""]


# ---- spans that end early ----------------------------------------------------------------------------------


@dataclass
class _FailingTokenizer:
    """Just enough of a Tokenizer for the front's tokenization pool; encoding raises (a tokenizer bug)."""

    max_token_chars: int = 64
    vocab_size: int = SMOLLM2_VOCAB

    def encode(self, text: str, parse_special: bool = False) -> list[int]:
        raise RuntimeError("tokenizer blew up")


@pytest.mark.parametrize("how", ["tokenizer_raises", "pool_closed"])
def test_a_span_ends_when_resolving_the_prompt_fails_unexpectedly(how: str) -> None:
    """When resolving the prompt raises something other than an OminixError (a tokenizer bug, or the
    tokenization pool closed at shutdown under a request already past the serving check), the request span
    still ends, with outcome error and an ERROR status, and the tracer forgets it."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = OtelRequestTracer(provider)

    async def main() -> None:
        core = EngineCore([FakeStepBackend(replace(_fake(), model_name="m"))], EngineCoreConfig())
        await core.start()
        service = EngineService(core, _FailingTokenizer(), "m", tracer=tracer)  # type: ignore[arg-type]
        if how == "pool_closed":
            service.close()
        pb = engine_pb2.GenerateRequest(
            request_id="s1", prompt="hello", sampling=common_pb2.SamplingParams(max_tokens=3)
        )
        try:
            with pytest.raises(RuntimeError):
                await service.admit(pb, "s1")
        finally:
            await core.stop()
            service.close()

    asyncio.run(asyncio.wait_for(main(), 30))
    (root,) = [s for s in exporter.get_finished_spans() if s.name == "ominix.generate"]
    assert root.attributes["ominix.request_id"] == "s1" and root.attributes["ominix.outcome"] == "error"
    assert root.status.status_code.name == "ERROR"
    assert not tracer._live  # nothing left for a run report to attach to


def test_front_processes_trace_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """With --front-procs the front process that admits a request traces it when the OTEL_* variables say so:
    the worker gets the front span's own traceparent (the caller's trace, a new span id), and the front's
    exporter writes the ominix.generate span by the time the front has exited."""
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")  # the front processes inherit the environment
    monkeypatch.setenv("OTEL_SERVICE_NAME", "ominix-front-test")
    daemon, thread = start_daemon(_fake(), front=FrontConfig(procs=1))
    try:
        events = _generate(daemon, "front-traced-1", metadata=(("traceparent", TRACEPARENT),))
        assert events[-1].HasField("done")
        sent = parse_traceparent(_new_request(daemon, "front-traced-1").traceparent)
    finally:
        stop_daemon(daemon, thread)
    assert sent.startswith(f"00-{TRACE_ID}-") and PARENT_SPAN not in sent, sent
    out = capfd.readouterr().out
    assert '"name": "ominix.generate"' in out and '"ominix.request_id": "front-traced-1"' in out


def test_shutdown_waits_for_an_exporter_that_hangs_only_so_long() -> None:
    """A collector that never answers must not hold the engine's exit past its kill timeout: the last spans are
    given SHUTDOWN_TIMEOUT_S, then dropped (shutdown's bound counts it)."""
    import threading
    import time

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from ominix_runtime.server import tracing

    released = threading.Event()

    class HangingExporter(SpanExporter):
        def export(self, spans: object) -> SpanExportResult:
            released.wait(30)  # a collector that does not answer
            return SpanExportResult.FAILURE

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(HangingExporter()))
    tracer = OtelRequestTracer(provider)
    tracer.start("r1").end("finished")
    started = time.monotonic()
    try:
        tracer.shutdown()
        took = time.monotonic() - started
    finally:
        released.set()
    assert tracing.SHUTDOWN_TIMEOUT_S - 0.1 <= took < tracing.SHUTDOWN_TIMEOUT_S + 1.0, took
