"""The ``ominix.worker.v0`` HTTP/SSE front: OminiX-API drives the engine as it drives its worker shim.

Runs in the engine process on the same event loop, engine and admission path as the gRPC front
(:meth:`EngineService.admit`), so both fronts share validation, ids, aborts and metrics. Protocol parsing
and record shapes live in :mod:`ominix_runtime.server.v0_protocol`; this module is the HTTP plumbing:
bearer auth on every route (before routing, like the shim), JSON errors, SSE streaming, client
disconnects (the request is aborted at once) and the control routes. The readiness routes
(``/server_info``, ``/get_model_info``) answer from memory so they stay fast under load.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import socket
from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from aiohttp import web
from google.protobuf import struct_pb2

from ominix_runtime.contract import OminixError, RuntimeErrorKind, is_retryable
from ominix_runtime.pb import common_pb2, engine_pb2
from ominix_runtime.server.engine_service import EngineService
from ominix_runtime.server.logging import get_logger, request_context
from ominix_runtime.server.tracing import traceparent_from_http_headers
from ominix_runtime.server.v0_protocol import (
    DONE_FRAME,
    V0EventWriter,
    V0GenerateRequest,
    V0ProtocolError,
    error_body,
    parse_abort_request,
    parse_generate_request,
    parse_json_object,
    server_info,
    sse_frame,
    token_logprobs,
)

MAX_BODY_BYTES = 32 * 1024 * 1024  # OminiX-API itself refuses public bodies over 20 MiB
LARGE_BODY_BYTES = 1 << 20  # a generate body past this is parsed in a thread
# On stop, aiohttp gives each open connection this long to finish its handler, then as long again for the
# cancelled handler: up to twice this in all.
SHUTDOWN_TIMEOUT_S = 2.0
# HTTP status of a request refused before streaming, by error kind. OminiX-API shows 400/422 as "the model
# does not support this request", 401/403/429/503 as "unavailable", 408/504 as "timeout".
HTTP_STATUS_OF_ERROR: dict[RuntimeErrorKind, int] = {
    RuntimeErrorKind.INVALID_ARGUMENT: 400,
    RuntimeErrorKind.CAPABILITY_MISMATCH: 400,
    RuntimeErrorKind.KV_CAPACITY_EXCEEDED: 400,
    RuntimeErrorKind.ADMISSION_REJECTED: 429,
    RuntimeErrorKind.BACKEND_UNAVAILABLE: 503,
    RuntimeErrorKind.TIMEOUT: 504,
    RuntimeErrorKind.CANCELLED: 409,
    RuntimeErrorKind.INTERNAL: 500,
}
_FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}

# Owner of requests admitted here (the gRPC front's callers are API-key digests, so they never match it).
V0_CALLER = "ominix.worker.v0"

_log = get_logger("ominix.v0")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _package_version() -> str:
    try:
        return version("ominix-runtime")
    except PackageNotFoundError:
        return "unknown"


def json_error(status: int, message: str, kind: RuntimeErrorKind | None = None) -> web.Response:
    code = kind.name.lower() if kind is not None else ""
    retryable = is_retryable(kind) if kind is not None else False
    return web.json_response(error_body(message, code, retryable), status=status)


class V0Front:
    """The v0 HTTP server of one engine daemon."""

    def __init__(self, service: EngineService, engine: Any, token: str, served_model_name: str = "") -> None:
        if not token:
            raise ValueError("the ominix.worker.v0 front needs a bearer token")
        self._service = service
        self._engine = engine
        self._expected_auth = f"Bearer {token}".encode()
        self._served_model_name = served_model_name
        self._version = _package_version()
        self._runner: web.AppRunner | None = None
        self.port = 0

    # ---- identity -------------------------------------------------------------------------------------

    @property
    def served_model_name(self) -> str:
        """What OminiX-API must configure as OMINIX_V0_SERVED_MODEL (and sends as ``model``)."""
        return self._served_model_name or self._service.model_name

    def _model_info(self) -> dict[str, Any]:
        model = self._service.model_name
        caps = [c for c in self._engine.capabilities() or [] if c.model.name == model]
        cap = caps[0] if caps else None
        return {
            "model_path": model,
            "tokenizer_path": model if self._service.tokenizer is not None else "",
            "served_model_name": self.served_model_name,
            "served_model_aliases": sorted(self._service.served_names),
            "is_generation": True,
            "context_length": cap.model.max_model_len if cap else 0,
            "vocab_size": cap.model.vocab_size if cap else 0,
            "architectures": [a for a in (cap.model.architecture if cap else "").split(",") if a],
            "backend_kind": cap.kind.contract_name if cap else "",
        }

    # ---- server ---------------------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._auth])
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/get_server_info", self._server_info)
        app.router.add_get("/get_model_info", self._get_model_info)
        app.router.add_get("/model_info", self._get_model_info)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_get("/health_generate", self._health)
        app.router.add_get("/health", self._health)
        app.router.add_get("/get_loads", self._get_loads)
        app.router.add_post("/flush_cache", self._flush_cache)
        app.router.add_route("*", "/{tail:.*}", self._unknown)
        return app

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (port 0: a free one); returns the bound port."""
        # handler_cancellation: a client that disconnects cancels its handler, which aborts the request.
        self._runner = web.AppRunner(
            self.make_app(), handle_signals=False, access_log=None, handler_cancellation=True
        )
        await self._runner.setup()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            await self._runner.cleanup()
            raise OminixError(
                RuntimeErrorKind.BACKEND_UNAVAILABLE, f"cannot bind the v0 front on {host}:{port}: {exc}"
            ) from exc
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock, shutdown_timeout=SHUTDOWN_TIMEOUT_S).start()
        _log.info("ominix.worker.v0 front listening", address=f"{host}:{self.port}")
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- middleware and small routes ------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every route, known or not, wants the exact bearer token (as the shim: auth before routing)."""
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, self._expected_auth):
            return json_error(401, "missing or invalid scheduler bearer token")
        try:
            return await handler(request)
        except web.HTTPClientError as exc:
            # aiohttp's own refusals (a body over MAX_BODY_BYTES) in the protocol's error shape.
            return json_error(exc.status, exc.reason if exc.text is None else exc.text)

    async def _unknown(self, request: web.Request) -> web.Response:
        return json_error(404, f"unknown route: {request.path}")

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response(server_info(self.served_model_name, self._version))

    async def _get_model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self._model_info())

    async def _health(self, request: web.Request) -> web.Response:
        ready = bool(self._engine.ready)
        body = {"status": "ok" if ready else "not_ready", "worker": "ominix-runtime"}
        return web.json_response(body, status=200 if ready else 503)

    async def _get_loads(self, request: web.Request) -> web.Response:
        workers = []
        for load in self._engine.load():
            workers.append(
                {
                    "worker_id": load.worker_id,
                    "backend": load.backend_kind,
                    "health": load.health.name.lower(),
                    "model_ids": list(load.model_ids),
                    "capabilities": list(load.capabilities),
                    "running_requests": load.running_requests,
                    "waiting_requests": load.queued_requests,
                    "waiting_tokens": load.waiting_tokens,
                    "kv_bytes_used": load.kv_bytes_used,
                    "kv_bytes_capacity": load.kv_bytes_capacity,
                    "estimated_decode_tokens_per_second": load.estimated_decode_tokens_per_second,
                    "timestamp_ms": load.timestamp_ms,
                }
            )
        return web.json_response({"workers": workers, "loads_source": "ominix-runtime"})

    async def _flush_cache(self, request: web.Request) -> web.Response:
        body = await request.read()
        if body.strip():
            try:
                parse_json_object(body, "flush_cache")
            except V0ProtocolError as exc:
                return json_error(400, str(exc))
        flushed = await self._engine.flush_cache()
        return web.json_response({"ok": True, "flushed": all(flushed.values()), "workers": flushed})

    async def _abort(self, request: web.Request) -> web.Response:
        try:
            request_id = parse_abort_request(await request.read())
        except V0ProtocolError as exc:
            return json_error(400, str(exc))
        # Unknown, finished or never-admitted ids are no error (OminiX-API aborts even refused requests).
        # Through the service first: it also aborts a request whose prompt is still being tokenized. With
        # gRPC API keys, a request of a key holder is not this front's to abort.
        found = self._service.may_abort(request_id, V0_CALLER) and (
            self._service.abort_live(request_id) or bool(self._engine.abort(request_id))
        )
        _log.info("v0 abort", request_id=request_id, found=found)
        return web.json_response({"ok": True, "aborted": request_id, "found": found})

    # ---- generate -------------------------------------------------------------------------------------

    def _parse_generate(self, body: bytes) -> tuple[V0GenerateRequest, engine_pb2.GenerateRequest]:
        req = parse_generate_request(body)
        return req, self._engine_request(req)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            if len(body) > LARGE_BODY_BYTES:
                # Megabytes of token ids or chat turns take seconds to check in Python: off the event loop,
                # which the engine and every other stream share (OminiX-API's probes give up after 3 s).
                req, pb = await asyncio.to_thread(self._parse_generate, body)
            else:
                req, pb = self._parse_generate(body)
        except V0ProtocolError as exc:
            return json_error(400, str(exc))
        with request_context(req.request_id[:256]):  # admit validates the id before anything logs it
            try:
                traceparent = traceparent_from_http_headers(request.headers)
                admitted = await self._service.admit(pb, req.request_id, V0_CALLER, traceparent)
            except OminixError as exc:
                return json_error(HTTP_STATUS_OF_ERROR.get(exc.kind, 500), exc.message, exc.kind)
            writer = V0EventWriter(req.request_id, req.trace_id)
            finished = False
            last: engine_pb2.GenerateEvent | None = None
            response = web.StreamResponse(
                status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            try:
                await response.prepare(request)
                async for event in self._service.stream(admitted):
                    last = event
                    for record in _records(event, writer):
                        await response.write(sse_frame(record))
                finished = True
                await response.write(DONE_FRAME)
                await response.write_eof()
            except ConnectionError:
                _log.info("v0 client went away mid-stream")
            except asyncio.CancelledError:
                _log.info("v0 client went away mid-stream")
                raise
            except Exception as exc:  # noqa: BLE001 - a bug must still end the stream with one terminal record
                _log.exception("v0 stream failed")
                if not writer.terminal_sent:
                    with contextlib.suppress(ConnectionError):
                        message = f"internal error: {exc!r}"
                        await response.write(sse_frame(writer.error("internal", message, False)))
                        await response.write(DONE_FRAME)
            finally:
                self._service.release(admitted, finished, last)
            return response

    def _engine_request(self, req: V0GenerateRequest) -> engine_pb2.GenerateRequest:
        """The engine's request; its validation (ranges, vocabulary, context, model) happens in ``admit``."""
        model = req.model
        if model == self.served_model_name:
            model = self._service.model_name
        s = req.sampling
        if s.max_new_tokens is not None and s.max_new_tokens < 1:
            raise V0ProtocolError(f"{s.name('max_new_tokens')} must be >= 1")
        sampling = common_pb2.SamplingParams(stop=s.stop, ignore_eos=s.ignore_eos)
        # Field by field, so that a value out of its wire type's range (a negative count, a number past int64
        # or a double) is refused naming the request's own field.
        for name, value, field in (
            ("max_tokens", s.max_new_tokens or 0, "max_new_tokens"),
            ("temperature", s.temperature, "temperature"),
            ("top_k", 0 if s.top_k in (None, -1) else s.top_k, "top_k"),
            ("min_p", s.min_p or 0.0, "min_p"),
            ("frequency_penalty", s.frequency_penalty or 0.0, "frequency_penalty"),
            ("presence_penalty", s.presence_penalty or 0.0, "presence_penalty"),
            ("min_tokens", s.min_new_tokens or 0, "min_new_tokens"),
            ("top_p", s.top_p, "top_p"),
            ("seed", s.seed, "seed"),
            ("logprobs", s.logprobs, "logprobs (or top_logprobs)"),
            ("repetition_penalty", s.repetition_penalty, "repetition_penalty"),
        ):
            if value is not None:
                _set_field(sampling, name, value, s.name(field))
        _set_field(sampling, "stop_token_ids", s.stop_token_ids, "sampling.stop_token_ids")
        try:
            pb = engine_pb2.GenerateRequest(
                request_id=req.request_id,
                model=model,
                sampling=sampling,
                priority=req.priority,  # type: ignore[arg-type]
                deadline_ms=req.deadline_ms,
                stream=True,  # the reply is SSE either way; non-stream clients concatenate the deltas
            )
            if req.tokens is not None:
                _set_field(pb.input_ids, "ids", req.tokens, "input.tokens")
            elif req.text is not None:
                pb.prompt = req.text
            else:
                assert req.messages is not None
                chat = engine_pb2.ChatMessages(
                    messages=[
                        engine_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in req.messages
                    ]
                )
                kwargs = struct_pb2.Struct()
                try:
                    kwargs.update(req.chat_template_kwargs)
                except RecursionError:
                    raise V0ProtocolError("input.chat_template_kwargs is nested too deeply") from None
                chat.chat_template_kwargs.CopyFrom(kwargs)
                pb.messages.CopyFrom(chat)
        # Out of the wire types' range: negative ids, numbers past int64 or a double.
        except (ValueError, TypeError, OverflowError) as exc:
            raise V0ProtocolError(f"request field out of range: {exc}") from exc
        return pb


def _set_field(message: Any, name: str, value: Any, field: str) -> None:
    """Set (or, for a repeated field, extend) ``message.name``; a value its wire type cannot hold is a 400
    naming the request's ``field``."""
    try:
        if isinstance(value, list):
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    except (ValueError, TypeError, OverflowError) as exc:
        raise V0ProtocolError(f"{field} is out of range: {exc}") from exc


def _records(event: engine_pb2.GenerateEvent, writer: V0EventWriter) -> list[dict[str, Any]]:
    """The v0 records of one engine event."""
    which = event.WhichOneof("event")
    if which == "prefill_done":
        return [writer.prefill_done(event.prefill_done.prompt_tokens, event.prefill_done.cached_tokens)]
    if which == "token":
        return _token_records(event.token, writer)
    if which == "usage":
        u = event.usage
        return [writer.usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)]
    if which == "done":
        return [writer.done(_FINISH_NAMES.get(event.done.finish_reason, "error"), event.done.matched_stop)]
    if which == "error":
        kind = RuntimeErrorKind(event.error.code) if event.error.code else RuntimeErrorKind.INTERNAL
        retryable = is_retryable(kind, tokens_sent=writer.tokens_sent > 0)
        return [writer.error(kind.name.lower(), event.error.message, retryable)]
    return []


def _token_records(chunk: engine_pb2.TokenChunk, writer: V0EventWriter) -> list[dict[str, Any]]:
    """A chunk as one record, or, when it carries logprobs, one record per token: the protocol's token
    event holds one token's logprobs (the reference worker splits chunks the same way to keep them aligned
    with their ids). The chunk's text is complete only with its last token, so that record carries it."""
    ids = list(chunk.token_ids)
    if not chunk.logprobs or not ids:
        return [writer.token(ids, chunk.text)]
    last = len(ids) - 1
    return [
        writer.token(
            [token_id],
            chunk.text if i == last else "",
            _logprobs_field(chunk.logprobs[i]) if i < len(chunk.logprobs) else None,
        )
        for i, token_id in enumerate(ids)
    ]


def _logprobs_field(lp: common_pb2.SampledLogprobs) -> dict[str, Any]:
    return token_logprobs(lp.sampled.logprob, ((t.token_id, t.logprob) for t in lp.top))


__all__ = ["HTTP_STATUS_OF_ERROR", "V0Front", "json_error"]
