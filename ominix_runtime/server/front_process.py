"""A front process of ``--front-procs``: serves clients' Engine calls on the engine port; the engine runs in
the process that started it (server/front_hub.py).

Generate runs the same path as in the engine process (EngineServiceBase: validation, tokenization,
detokenization, stop strings), over ``EngineLink``, which stands for the engine core: submit, abort and
finish go over the link, the requests' events come back in one frame per engine loop turn. Admin calls
(GetLoad, GetStats, ListBackends, Drain, Undrain, Abort of a request another front streams) are forwarded
over gRPC to the engine process with the caller's metadata, so its API-key check answers them.

The process exits when the engine process says stop (StopServing, once its drain is over) or when its link
closes (the engine process is gone: the open streams end with UNAVAILABLE errors). SIGINT and SIGTERM are
ignored: a signal to the whole process group (Ctrl-C, ``kill -- -PGID``, systemd's KillMode=control-group)
reaches the fronts too, and the engine process leads the shutdown; a front that stopped on its own would cut
streams the engine is still draining. SIGKILL still ends a front (the engine starts it again unless stopping).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import pickle
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health

from ominix_runtime import memory
from ominix_runtime.contract import (
    BackendCapability,
    Error,
    FinishReason,
    GenerateRequest,
    OminixError,
    RuntimeErrorKind,
    Usage,
    is_terminal,
)
from ominix_runtime.engine.core import EventInbox, ReaderWaker, RequestHandle
from ominix_runtime.pb import engine_pb2, engine_pb2_grpc
from ominix_runtime.server import front_link as link
from ominix_runtime.server.app import (
    HEALTH_REFRESH_INTERVAL_S,
    SHUTDOWN_FLUSH_S,
    bind_grpc_front,
    build_grpc_front,
    has_tokenizer,
    load_tokenizer,
    model_source,
    run_event_loop,
    set_health,
)
from ominix_runtime.server.call_errors import ERROR_KIND_METADATA_KEY, error_metadata
from ominix_runtime.server.engine_service import READY_METADATA_KEY, AlreadyLive, EngineServiceBase
from ominix_runtime.server.front_hub import FrontSpec
from ominix_runtime.server.logging import configure_logging, get_logger
from ominix_runtime.server.tracing import RequestSpan, RequestTracer, tracer_from_environment

FORWARD_TIMEOUT_S = 30.0
# Client metadata an admin call keeps when forwarded: the API key and the trace context.
_FORWARDED_METADATA = frozenset({"authorization", "traceparent", "tracestate"})

_log = get_logger("ominix.front")

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Context = grpc.aio.ServicerContext


class EngineLink:
    """The engine core as a front process sees it (server/engine_service.py's EngineAccess)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hello: link.Hello) -> None:
        self._reader = reader
        self.frames = link.FrameWriter(writer)
        self.model_name = hello.model_name
        self.engine_address = hello.engine_address
        self._ready = hello.ready
        self._capabilities = hello.capabilities
        self._inboxes: dict[str, EventInbox] = {}
        self._admissions: dict[str, asyncio.Future[None]] = {}
        self._waker = ReaderWaker()
        self.closed = False
        self.stop_requested = asyncio.Event()
        # The front's answer to an Abort that came through another front for a request it still resolves.
        self.on_abort_resolving: Callable[[str], object] | None = None

    @classmethod
    async def connect(cls, path: str) -> tuple[EngineLink, list[object]]:
        """Connect and read the engine's Hello; also the rest of its first frame."""
        reader, writer = await asyncio.open_unix_connection(path)
        messages = await link.read_frame(reader)
        if not messages or not isinstance(messages[0], link.Hello):
            raise OminixError(RuntimeErrorKind.BACKEND_UNAVAILABLE, "the engine process sent no Hello")
        return cls(reader, writer, messages[0]), messages[1:]

    # ---- EngineAccess -----------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready and not self.closed and not self.stop_requested.is_set()

    def capabilities(self) -> list[BackendCapability]:
        return list(self._capabilities)

    def note_readiness(self, ready: bool) -> None:
        """The engine's readiness as an answer of the engine process stated it (ahead of its Readiness frame)."""
        self._ready = ready

    def submit(self, request: GenerateRequest) -> RequestHandle:
        rid = request.request_id
        if self.closed:
            raise OminixError(RuntimeErrorKind.BACKEND_UNAVAILABLE, "the engine process is gone")
        inbox = EventInbox(self._waker)
        admission: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inboxes[rid] = inbox
        self._admissions[rid] = admission
        self.frames.send(link.Submit(request))
        return RequestHandle(rid, inbox, self, coalesce=not request.sampling.stop, admission=admission)

    def abort(self, request_id: str) -> bool:
        if request_id not in self._inboxes:
            return False
        self.frames.send(link.AbortRequest(request_id))
        return True

    def holds(self, request_id: str) -> bool:
        # An id's inbox stays until its terminal event comes back over the link: until then its events and
        # admission answer are keyed by the id, so a new request of the same id must not be sent.
        return request_id in self._inboxes

    def finish(self, request_id: str, reason: FinishReason, matched_stop: str) -> bool:
        if request_id not in self._inboxes:
            return False
        self.frames.send(link.FinishRequest(request_id, reason, matched_stop))
        return True

    def settle(self, request_id: str, matched_stop: str) -> bool:
        # Sent after the request's terminal event came back (its inbox is gone by then).
        self.frames.send(link.SettleRequest(request_id, matched_stop))
        return True

    # ---- the engine's messages --------------------------------------------------------------------------

    async def run(self, first: list[object]) -> None:
        """Apply the engine's messages until it closes the link; then end every open request."""
        try:
            self._apply(first)
            while (messages := await link.read_frame(self._reader)) is not None:
                self._apply(messages)
        finally:
            self.closed = True
            self._end_all("the engine process is gone")

    def _apply(self, messages: list[object]) -> None:
        for message in messages:
            match message:
                case link.Events(events):
                    inboxes = self._inboxes
                    for event in events:
                        inbox = inboxes.get(event.request_id)
                        if inbox is None:
                            continue
                        inbox.put(event)
                        if is_terminal(event):
                            del inboxes[event.request_id]
                case link.Admitted(rid):
                    admission = self._admissions.pop(rid, None)
                    if admission is not None and not admission.done():
                        admission.set_result(None)
                case link.Refused(rid, kind, text, duplicate):
                    self._inboxes.pop(rid, None)
                    admission = self._admissions.pop(rid, None)
                    if admission is not None and not admission.done():
                        admission.set_exception(AlreadyLive(text) if duplicate else OminixError(kind, text))
                case link.Readiness(ready, capabilities):
                    self._ready, self._capabilities = ready, capabilities
                case link.AbortResolving(rid):
                    if self.on_abort_resolving is not None:
                        self.on_abort_resolving(rid)
                case link.StopServing():
                    self.stop_requested.set()
                case _:
                    raise ValueError(f"unexpected front link message {type(message).__name__}")

    def _end_all(self, why: str) -> None:
        for admission in self._admissions.values():
            if not admission.done():
                admission.set_exception(OminixError(RuntimeErrorKind.BACKEND_UNAVAILABLE, why))
        self._admissions.clear()
        for rid, inbox in self._inboxes.items():
            inbox.put(Usage(rid, 0, 0))
            inbox.put(Error(rid, RuntimeErrorKind.BACKEND_UNAVAILABLE, why))
        self._inboxes.clear()

    def refused(self, message: str, reason: str, model: str = "") -> None:
        self.frames.send(link.FrontRefusal(message, reason, model))


# A forwarded call the engine process did not answer: the kind its status stands for.
_TRANSPORT_KINDS = {
    grpc.StatusCode.UNAVAILABLE: RuntimeErrorKind.BACKEND_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: RuntimeErrorKind.TIMEOUT,
    grpc.StatusCode.CANCELLED: RuntimeErrorKind.CANCELLED,
}


def _metadata_pairs(metadata: grpc.aio.Metadata | None) -> tuple[tuple[str, str | bytes], ...]:
    """The engine's trailing metadata as ``context.abort`` takes it: a tuple of pairs (a grpc.aio.Metadata
    there fails the call with a TypeError, which the client sees as UNKNOWN instead of the engine's status)."""
    return tuple((key, value) for key, value in metadata or ())


class FrontService(EngineServiceBase):
    """The Engine service of a front process: Generate over the link, admin calls forwarded."""

    def __init__(self, engine: EngineLink, spec: FrontSpec, tracer: RequestTracer | None = None) -> None:
        config = spec.config
        super().__init__(
            engine,
            None,
            engine.model_name,
            None,
            config.front,
            tracer=tracer,
            served_names=config.model.served_model_names,
            queue_limit=config.engine.max_waiting_requests,
        )
        self._link = engine
        engine.on_abort_resolving = self.abort_live
        self._channel = grpc.aio.insecure_channel(engine.engine_address)
        self._engine_stub = engine_pb2_grpc.EngineStub(self._channel)

    def _reject(
        self,
        message: str,
        reason: str,
        counted_by_engine: bool,
        span: RequestSpan | None = None,
        model: str = "",
    ) -> None:
        super()._reject(message, reason, counted_by_engine, span, model)
        if not counted_by_engine:  # the engine process counts what it refused itself
            self._link.refused(message, reason, model)

    async def _resolve(self, pb: engine_pb2.GenerateRequest, request_id: str) -> GenerateRequest:
        """As the base resolves it; a prompt that waits for the tokenizer is announced to the engine process
        meanwhile (Resolving), so an Abort that reaches another front finds it. Resolved goes out before the
        Submit that follows, in the same frame."""
        if pb.WhichOneof("input") == "input_ids":
            return await super()._resolve(pb, request_id)
        self._link.frames.send(link.Resolving(request_id, self._owners.get(request_id, "")))
        try:
            return await super()._resolve(pb, request_id)
        finally:
            self._link.frames.send(link.Resolved(request_id))

    async def _forward(
        self,
        call: Callable[..., Awaitable[Resp]],
        request: Req,
        context: Context[Req, Resp],
    ) -> Resp:
        metadata = tuple(
            (key, value)
            for key, value in context.invocation_metadata() or ()
            if key.lower() in _FORWARDED_METADATA
        )
        try:
            return await call(request, metadata=metadata, timeout=FORWARD_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            trailers = _metadata_pairs(exc.trailing_metadata())
            if not any(key == ERROR_KIND_METADATA_KEY for key, _ in trailers):
                # The engine process did not answer (gone, or past FORWARD_TIMEOUT_S): the error kind of that.
                kind = _TRANSPORT_KINDS.get(exc.code(), RuntimeErrorKind.INTERNAL)
                trailers += error_metadata(kind)
            await context.abort(exc.code(), exc.details() or "", trailing_metadata=trailers)
            raise  # not reached: abort raises

    async def _abort_elsewhere(
        self,
        request: engine_pb2.AbortRequest,
        context: Context[engine_pb2.AbortRequest, engine_pb2.AbortResponse],
    ) -> engine_pb2.AbortResponse:
        return await self._forward(self._engine_stub.Abort, request, context)

    async def GetLoad(
        self,
        request: engine_pb2.GetLoadRequest,
        context: Context[engine_pb2.GetLoadRequest, engine_pb2.GetLoadResponse],
    ) -> engine_pb2.GetLoadResponse:
        return await self._forward(self._engine_stub.GetLoad, request, context)

    async def GetStats(
        self,
        request: engine_pb2.GetStatsRequest,
        context: Context[engine_pb2.GetStatsRequest, engine_pb2.GetStatsResponse],
    ) -> engine_pb2.GetStatsResponse:
        return await self._forward(self._engine_stub.GetStats, request, context)

    async def ListBackends(
        self,
        request: engine_pb2.ListBackendsRequest,
        context: Context[engine_pb2.ListBackendsRequest, engine_pb2.ListBackendsResponse],
    ) -> engine_pb2.ListBackendsResponse:
        return await self._forward(self._engine_stub.ListBackends, request, context)

    async def Drain(
        self,
        request: engine_pb2.DrainRequest,
        context: Context[engine_pb2.DrainRequest, engine_pb2.DrainResponse],
    ) -> engine_pb2.DrainResponse:
        return await self._forward_drain(self._engine_stub.Drain, request, context)

    async def Undrain(
        self,
        request: engine_pb2.DrainRequest,
        context: Context[engine_pb2.DrainRequest, engine_pb2.DrainResponse],
    ) -> engine_pb2.DrainResponse:
        return await self._forward_drain(self._engine_stub.Undrain, request, context)

    async def _forward_drain(
        self,
        call: Callable[..., grpc.aio.UnaryUnaryCall[engine_pb2.DrainRequest, engine_pb2.DrainResponse]],
        request: engine_pb2.DrainRequest,
        context: Context[engine_pb2.DrainRequest, engine_pb2.DrainResponse],
    ) -> engine_pb2.DrainResponse:
        """Drain or Undrain, forwarded. This front takes the engine's readiness from the answer before the
        client has it (the client's next request on this connection comes here, maybe before the link's
        Readiness frame is read); the other fronts get that frame."""
        ready: list[bool] = []

        async def call_and_read(req: engine_pb2.DrainRequest, **kwargs: object) -> engine_pb2.DrainResponse:
            invocation = call(req, **kwargs)
            response = await invocation
            ready.extend(
                v == "true" for k, v in await invocation.trailing_metadata() or () if k == READY_METADATA_KEY
            )
            return response

        response = await self._forward(call_and_read, request, context)
        if ready:
            self._link.note_readiness(ready[-1])
        return response

    async def aclose(self) -> None:
        self.close()
        await self._channel.close()


async def serve_front(spec: FrontSpec) -> int:
    config = spec.config
    memory.map_large_allocations()  # prompts of megabytes arrive here first, as in the engine process
    engine, first = await EngineLink.connect(spec.link_path)
    reading = asyncio.create_task(engine.run(first), name="ominix-front-link")
    # The requests' spans start where they are admitted, so a front traces as the engine process does: off
    # unless the OTEL_* variables (inherited from the engine process) configure it.
    tracer = tracer_from_environment()
    service = FrontService(engine, spec, tracer)
    source = model_source(config)
    if source is not None and has_tokenizer(source):
        service.tokenizer = await asyncio.to_thread(load_tokenizer, source)
    health_servicer = health.aio.HealthServicer()
    # Several fronts bind the port together (SO_REUSEPORT); a single one binds it alone, so a server that took
    # the port meanwhile fails the bind instead of sharing the connections.
    server = build_grpc_front(config, service, health_servicer, share_port=(config.front.procs or 0) > 1)
    await set_health(health_servicer, serving=False)
    port = bind_grpc_front(server, config)
    await server.start()
    # As the engine process does once started: every stream's tokens pass through this process, and with
    # Python's collector settings it ran two full collections (the longer 33 - 48 ms) and ~220 young ones of
    # 0.5 ms or more in each all-at-once run of 256 streams (bench/RESULTS.md, 2026-11-30), each pause
    # holding back every stream's tokens.
    memory.freeze_startup_heap()
    engine.frames.send(link.Bound(spec.index, port))
    _log.info(
        "front serving",
        front=spec.index,
        port=port,
        frozen_objects=gc.get_freeze_count(),
        gc_threshold=gc.get_threshold()[0],
    )
    serving = False
    # Only the engine process ends a front: it says stop once its drain is over, or its link closes.
    stop_waits = [asyncio.ensure_future(engine.stop_requested.wait()), reading]
    while not any(w.done() for w in stop_waits):
        if engine.ready != serving:
            serving = engine.ready
            await set_health(health_servicer, serving=serving)
        await asyncio.wait(stop_waits, timeout=HEALTH_REFRESH_INTERVAL_S, return_when="FIRST_COMPLETED")
    if reading.done():
        error = None if reading.cancelled() else reading.exception()
        _log.warning("engine link closed", front=spec.index, error=repr(error) if error else None)
    await set_health(health_servicer, serving=False)
    # The engine ended every request before it said stop (or the link is gone and they ended with an
    # error): their last events are still on their way to the clients.
    await service.wait_idle(SHUTDOWN_FLUSH_S)
    with contextlib.suppress(Exception):
        await server.stop(grace=SHUTDOWN_FLUSH_S)
    await service.aclose()
    tracer.shutdown()  # exports the spans of the last requests before the process exits
    engine.frames.close()
    for waiting in stop_waits:
        waiting.cancel()
    with contextlib.suppress(BaseException):
        await reading
    return 0


def main() -> int:
    # First: a group-wide signal during start-up must not end a front either (see the module docstring).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if len(sys.argv) != 2:
        print("ominix-runtime front: started by the engine process (serve --front-procs)", file=sys.stderr)
        return 2
    with open(sys.argv[1], "rb") as f:
        spec = pickle.load(f)
    with contextlib.suppress(OSError):  # it may hold API keys: gone once read
        os.unlink(sys.argv[1])
    if not isinstance(spec, FrontSpec):
        print("ominix-runtime front: the spec file holds no FrontSpec", file=sys.stderr)
        return 2
    config = spec.config
    configure_logging(config.log.level, config.log.json, component="front", front=spec.index)
    try:
        return run_event_loop(serve_front(spec))
    except OminixError as exc:
        # A front that cannot start (its port taken): one line, not a traceback; the engine process reports
        # the exit status with the port.
        print(f"ominix-runtime front {spec.index}: error: {exc.message}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
