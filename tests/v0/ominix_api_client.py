"""A test client that speaks ``ominix.worker.v0`` the way OminiX-API does (``src/engines/sglang.rs``).

Written from OminiX-API's client as described in shared/upstream/ominix_worker_v0.md: the readiness probes
it runs before every request, the exact GenerateRequest body it sends (f32-widened floats, fixed
response_options), its SSE decoder (frames split at the first blank line, ``data:`` lines only, size
limits), its WorkerEvent validation (envelope fields and their JSON types) and its accumulator rules
(exactly one ``done``, ``[DONE]`` after it, usage from the last ``prefill_done``/``usage``, finish reasons).
Every rule it enforces raises :class:`ProtocolFailure`, which OminiX-API would turn into an HTTP 502.
"""

from __future__ import annotations

import json
import struct
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

PROTOCOL_VERSION = "ominix.worker.v0"
PROBE_TIMEOUT_S = 3.0
ABORT_TIMEOUT_S = 2.0
MAX_PROBE_BODY = 64 * 1024
MAX_FRAME = 2 * 1024 * 1024
MAX_NON_STREAM_BODY = 64 * 1024 * 1024
KINDS = frozenset({"prefill_done", "usage", "token", "done", "error"})
SUCCESS_FINISH = frozenset({"stop", "length", "content_filter"})
FAILURE_FINISH = frozenset({"abort", "error"})


class ProtocolFailure(AssertionError):
    """The worker broke a rule OminiX-API enforces."""


class WorkerRejected(Exception):
    """A non-2xx answer to /generate (OminiX-API maps its status to a public error)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def f32(value: float) -> float:
    """OminiX-API holds temperature/top_p as f32 and widens them when serializing."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


@dataclass
class ChatResult:
    content: str
    finish_reason: str
    usage: dict[str, int]
    events: list[dict[str, Any]] = field(default_factory=list)


class SseDecoder:
    """OminiX-API's SseDecoder: frames end at the earliest blank line (LF or CRLF), comments and non-data
    lines are ignored, several data lines join with a newline, frames over 2 MiB are errors."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        out = []
        while True:
            cuts = [i for i in (self._buf.find(b"\n\n"), self._buf.find(b"\r\n\r\n")) if i >= 0]
            if not cuts:
                if len(self._buf) > MAX_FRAME:
                    raise ProtocolFailure("SSE frame over 2 MiB")
                return out
            cut = min(cuts)
            sep = 4 if self._buf[cut : cut + 4] == b"\r\n\r\n" else 2
            frame, self._buf = self._buf[:cut], self._buf[cut + sep :]
            if len(frame) > MAX_FRAME:
                raise ProtocolFailure("SSE frame over 2 MiB")
            data = _frame_data(frame)
            if data is not None:
                out.append(data)

    def finish(self) -> None:
        if self._buf.strip():
            raise ProtocolFailure(f"trailing bytes after the last SSE frame: {self._buf[:80]!r}")


def _frame_data(frame: bytes) -> str | None:
    try:
        text = frame.decode("utf-8").replace("\r\n", "\n")
    except UnicodeDecodeError as exc:
        raise ProtocolFailure(f"SSE frame is not UTF-8: {exc}") from exc
    lines = []
    for line in text.split("\n"):
        if line.startswith(":") or not line.startswith("data:"):
            continue
        value = line[5:]
        lines.append(value[1:] if value.startswith(" ") else value)
    return "\n".join(lines) if lines else None


def validate_event(data: str, request_id: str) -> dict[str, Any]:
    """OminiX-API's parse_worker_event: the envelope and the types of the known optional fields."""
    try:
        event = json.loads(data)
    except ValueError as exc:
        raise ProtocolFailure(f"event is not JSON: {data[:120]!r}") from exc
    if not isinstance(event, dict):
        raise ProtocolFailure("event is not an object")
    if event.get("protocol_version") != PROTOCOL_VERSION:
        raise ProtocolFailure(f"protocol_version {event.get('protocol_version')!r}")
    if event.get("message_type") != "WorkerEvent":
        raise ProtocolFailure(f"message_type {event.get('message_type')!r}")
    if event.get("request_id") != request_id:
        raise ProtocolFailure(f"request_id {event.get('request_id')!r} != {request_id!r}")
    if event.get("kind") not in KINDS:
        raise ProtocolFailure(f"unknown kind {event.get('kind')!r}")
    created = event.get("created_at_ms")
    if not isinstance(created, int) or isinstance(created, bool) or created < 0:
        raise ProtocolFailure(f"created_at_ms must be a non-negative integer, got {created!r}")
    if event.get("sequence_index") not in (None, 0):
        raise ProtocolFailure("multiple output sequences are not supported")
    for key in ("text_delta", "finish_reason"):
        if event.get(key) is not None and not isinstance(event[key], str):
            raise ProtocolFailure(f"{key} must be a string or null")
    usage = event.get("usage")
    if usage is not None:
        if not isinstance(usage, dict):
            raise ProtocolFailure("usage must be an object")
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            value = usage.get(key, 0)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**32:
                raise ProtocolFailure(f"usage.{key} must be a u32, got {value!r}")
    error = event.get("error")
    if error is not None and (not isinstance(error, dict) or not isinstance(error.get("message", ""), str)):
        raise ProtocolFailure("error must be an object with a string message")
    return event


class WorkerAccumulator:
    """OminiX-API's WorkerAccumulator for one request: text, usage and the single terminal event."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.content = ""
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        self.finish_reason: str | None = None
        self.saw_done_marker = False
        self.events: list[dict[str, Any]] = []

    def consume(self, data: str) -> list[str]:
        """Returns the text deltas this frame adds (what the stream adapter would send as chunks)."""
        if self.saw_done_marker:
            raise ProtocolFailure(f"data after [DONE]: {data[:80]!r}")
        if data == "[DONE]":
            if self.finish_reason is None:
                raise ProtocolFailure("[DONE] before done")
            self.saw_done_marker = True
            return []
        if self.finish_reason is not None:
            raise ProtocolFailure(f"an event after done: {data[:120]!r}")
        event = validate_event(data, self.request_id)
        self.events.append(event)
        kind = event["kind"]
        if kind in ("prefill_done", "usage") and event.get("usage") is not None:
            u = event["usage"]
            self.usage = {k: int(u.get(k, 0)) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        if kind == "error":
            message = (event.get("error") or {}).get("message", "")
            raise ProtocolFailure(f"worker error event: {message}")
        deltas = [event["text_delta"]] if event.get("text_delta") else []
        if kind == "done":
            reason = event.get("finish_reason")
            if reason in FAILURE_FINISH:
                self.finish_reason = reason
                raise RemoteFinish(reason, self)
            if reason not in SUCCESS_FINISH:
                raise ProtocolFailure(f"finish_reason {reason!r} is not accepted")
            self.finish_reason = reason
        self.content += "".join(deltas)
        return deltas


class RemoteFinish(Exception):
    """A ``done`` with abort/error: OminiX-API fails the request (the test may expect it)."""

    def __init__(self, reason: str, acc: WorkerAccumulator) -> None:
        super().__init__(f"worker finished with {reason}")
        self.reason = reason
        self.accumulator = acc


class OminixApiClient:
    """What OminiX-API does per chat completion, against one v0 worker base URL."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        token: str,
        served_model: str,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.session = session
        self.base = base_url.rstrip("/")
        self.token = token
        self.served_model = served_model
        self.chat_template_kwargs = chat_template_kwargs or {}

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    async def _probe(self, path: str) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        async with self.session.get(
            self.base + path, headers=self.headers, timeout=timeout, allow_redirects=False
        ) as r:
            body = await r.content.read(MAX_PROBE_BODY + 1)
            if not 200 <= r.status < 300 or len(body) > MAX_PROBE_BODY:
                raise ProtocolFailure(f"{path}: not ready (HTTP {r.status}, {len(body)} bytes)")
            return json.loads(body)

    async def ready(self) -> None:
        """probe_server_info + probe_model_identity, as before every generate."""
        info = await self._probe("/server_info")
        expected = {
            "scheduler_backend": "sglang-ominix-v0-http-shim",
            "protocol_version": PROTOCOL_VERSION,
            "mode": "grpc",
        }
        for key, value in expected.items():
            if info.get(key) != value:
                raise ProtocolFailure(f"/server_info {key} = {info.get(key)!r}, want {value!r}")
        if info.get("public_openai_api") is not False or info.get("auth_required") is not True:
            raise ProtocolFailure("/server_info must say public_openai_api false and auth_required true")
        if (info.get("routes") or {}).get("generate") != "/generate":
            raise ProtocolFailure("/server_info routes.generate must be /generate")
        model = await self._probe("/get_model_info")
        if model.get("served_model_name") != self.served_model or model.get("is_generation") is not True:
            raise ProtocolFailure(f"/get_model_info does not serve {self.served_model!r}: {model}")

    def worker_request(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int | None,
        temperature: float | None,
        top_p: float | None,
        stream: bool,
        request_id: str | None = None,
    ) -> dict[str, Any]:
        sampling: dict[str, Any] = {"max_new_tokens": max_tokens if max_tokens is not None else 2048}
        if temperature is not None:
            sampling["temperature"] = f32(temperature)
        if top_p is not None:
            sampling["top_p"] = f32(top_p)
        return {
            "protocol_version": PROTOCOL_VERSION,
            "message_type": "GenerateRequest",
            "request_id": request_id or "ominix-" + uuid.uuid4().hex,
            "model": self.served_model,
            "input": {
                "kind": "chat",
                "messages": [
                    {"role": m["role"], **({"content": m["content"]} if m.get("content") is not None else {})}
                    for m in messages
                ],
                "chat_template_kwargs": dict(self.chat_template_kwargs),
            },
            "sampling": sampling,
            "response_options": {"skip_special_tokens": True, "spaces_between_special_tokens": True},
            "stream": stream,
        }

    async def open_generate(self, body: dict[str, Any]) -> aiohttp.ClientResponse:
        headers = {**self.headers, "Accept": "text/event-stream", "Content-Type": "application/json"}
        resp = await self.session.post(
            self.base + "/generate", data=json.dumps(body).encode(), headers=headers, allow_redirects=False
        )
        if resp.status != 200:
            raw = await resp.read()
            try:
                message = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = raw[:512].decode(errors="replace")
            resp.release()
            raise WorkerRejected(resp.status, message)
        if not resp.headers.get("Content-Type", "").lower().startswith("text/event-stream"):
            resp.release()
            raise ProtocolFailure(f"200 with Content-Type {resp.headers.get('Content-Type')!r}")
        return resp

    async def chat(self, messages: list[dict[str, Any]], max_tokens: int = 16, **kw: Any) -> ChatResult:
        """A non-stream chat completion: the whole SSE body is read, then checked (≤ 64 MiB, clean tail)."""
        await self.ready()
        body = self.worker_request(messages, max_tokens, kw.get("temperature"), kw.get("top_p"), stream=False)
        resp = await self.open_generate(body)
        raw = b""
        try:
            async for piece in resp.content.iter_any():
                raw += piece
                if len(raw) > MAX_NON_STREAM_BODY:
                    break
        finally:
            resp.release()
        if len(raw) > MAX_NON_STREAM_BODY:
            raise ProtocolFailure("non-stream body over 64 MiB")
        decoder = SseDecoder()
        acc = WorkerAccumulator(body["request_id"])
        for data in decoder.feed(raw):
            acc.consume(data)
        decoder.finish()
        if not acc.saw_done_marker:
            raise ProtocolFailure("the body ended without [DONE]")
        assert acc.finish_reason is not None
        return ChatResult(acc.content, acc.finish_reason, acc.usage, acc.events)

    async def chat_stream(
        self, messages: list[dict[str, Any]], max_tokens: int = 16, request_id: str | None = None, **kw: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """A streamed chat completion as OpenAI chunks: role chunk, content chunks, finish chunk."""
        await self.ready()
        body = self.worker_request(
            messages, max_tokens, kw.get("temperature"), kw.get("top_p"), stream=True, request_id=request_id
        )
        rid = body["request_id"]
        resp = await self.open_generate(body)
        guard_armed = True
        try:
            yield {"id": f"chatcmpl-{rid}", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
            decoder = SseDecoder()
            acc = WorkerAccumulator(rid)
            async for piece in resp.content.iter_any():
                for data in decoder.feed(piece):
                    for delta in acc.consume(data):
                        yield {
                            "id": f"chatcmpl-{rid}",
                            "choices": [{"index": 0, "delta": {"content": delta}}],
                        }
                    if acc.saw_done_marker:
                        guard_armed = False
                        yield {
                            "id": f"chatcmpl-{rid}",
                            "choices": [{"index": 0, "delta": {}, "finish_reason": acc.finish_reason}],
                            "usage": acc.usage,
                        }
                        return
            raise ProtocolFailure("the stream ended without [DONE]")
        finally:
            resp.release()
            if guard_armed:  # AbortGuard: disarmed only by the worker's [DONE]
                await self.abort(rid)

    async def abort(self, request_id: str) -> None:
        body = {
            "protocol_version": PROTOCOL_VERSION,
            "message_type": "AbortRequest",
            "request_id": request_id,
            "reason": "client_disconnect_or_upstream_failure",
        }
        try:
            async with self.session.post(
                self.base + "/abort_request",
                json=body,
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S),
            ) as r:
                await r.read()
        except (aiohttp.ClientError, TimeoutError):
            pass  # fire and forget
