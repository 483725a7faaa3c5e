"""A small typed client of the engine's front API (``ominix.runtime.v1.Engine``), blocking and asyncio.

    from ominix_runtime.client import EngineClient

    with EngineClient("localhost:50061", api_key="secret") as client:
        for event in client.generate(prompt="The capital of France is", max_tokens=16):
            if event.HasField("token"):
                print(event.token.text, end="", flush=True)

``generate`` yields the stream's ``GenerateEvent`` messages as they arrive (prefill_done, token, usage,
then exactly one done or error). ``generate_batch`` sends many requests in one call and yields all their
events, each request's ending with one done or error. :class:`AsyncEngineClient` is the same over
``grpc.aio``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc

PRIORITIES = {
    "realtime": common_pb2.PRIORITY_REALTIME,
    "interactive": common_pb2.PRIORITY_INTERACTIVE,
    "batch": common_pb2.PRIORITY_BATCH,
}
DEFAULT_ADDRESS = "localhost:50061"


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How to reach the engine: plaintext unless ``tls`` or ``root_certificates`` is given."""

    api_key: str | None = None  # sent as ``authorization: Bearer KEY``
    tls: bool = False  # TLS with the system's roots
    root_certificates: str | None = None  # PEM CA bundle path (implies TLS)
    timeout: float | None = None  # seconds per call (a whole Generate stream included)
    channel_options: tuple[tuple[str, Any], ...] = ()  # grpc channel arguments, e.g. message size limits

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def credentials(self) -> grpc.ChannelCredentials | None:
        if self.root_certificates:
            return grpc.ssl_channel_credentials(Path(self.root_certificates).read_bytes())
        if self.tls:
            return grpc.ssl_channel_credentials()
        return None


def generate_request(
    prompt: str | None = None,
    *,
    messages: Sequence[tuple[str, str]] = (),
    input_ids: Sequence[int] = (),
    model: str = "",
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    priority: str = "interactive",
    request_id: str = "",
) -> engine_pb2.GenerateRequest:
    """One request: exactly one of ``prompt``, ``messages`` ((role, content) pairs) or ``input_ids``."""
    if sum(bool(x) for x in (prompt, messages, input_ids)) != 1:
        raise ValueError("give exactly one of prompt, messages or input_ids")
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    sampling = common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_k=top_k, stop=list(stop), ignore_eos=ignore_eos
    )
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    request = engine_pb2.GenerateRequest(
        request_id=request_id, model=model, sampling=sampling, priority=PRIORITIES[priority]
    )
    if prompt:
        request.prompt = prompt
    elif messages:
        for role, content in messages:
            request.messages.messages.add(role=role, content=content)
    else:
        request.input_ids.ids.extend(int(i) for i in input_ids)
    return request


def _request(
    request: engine_pb2.GenerateRequest | None, kwargs: dict[str, Any]
) -> engine_pb2.GenerateRequest:
    if request is not None:
        if kwargs:
            raise ValueError("pass a GenerateRequest or keyword arguments, not both")
        return request
    return generate_request(**kwargs)


class EngineClient:
    """Blocking client; one channel, closed by ``close()`` or the ``with`` block."""

    def __init__(self, address: str = DEFAULT_ADDRESS, options: ClientOptions | None = None, **kw: Any):
        self.options = options or ClientOptions(**kw)
        credentials, channel_args = self.options.credentials(), list(self.options.channel_options)
        self._channel = (
            grpc.secure_channel(address, credentials, channel_args)
            if credentials
            else grpc.insecure_channel(address, channel_args)
        )
        self._stub = engine_pb2_grpc.EngineStub(self._channel)

    def generate(
        self,
        request: engine_pb2.GenerateRequest | None = None,
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Iterator[engine_pb2.GenerateEvent]:
        """Events of one request as they arrive; a refused request raises ``grpc.RpcError``. ``kwargs``
        build the request (see :func:`generate_request`); ``timeout`` overrides the client's."""
        call = self._stub.Generate(
            _request(request, kwargs), timeout=timeout or self.options.timeout, metadata=self.options.metadata
        )
        try:
            yield from call
        finally:
            call.cancel()  # no-op after the stream ended; frees the request when the caller stops early

    def generate_batch(
        self, requests: Sequence[engine_pb2.GenerateRequest], *, timeout: float | None = None
    ) -> Iterator[engine_pb2.GenerateEvent]:
        """Events of many requests sent in one call, as they arrive, told apart by ``request_id``; each
        request ends with one done or error event. A refused call raises ``grpc.RpcError``."""
        call = self._stub.GenerateBatch(
            engine_pb2.GenerateBatchRequest(requests=requests),
            timeout=timeout or self.options.timeout,
            metadata=self.options.metadata,
        )
        try:
            for batch in call:
                yield from batch.events
        finally:
            call.cancel()  # stopping early aborts every request still live

    def abort(self, request_id: str) -> bool:
        """True when a live request had that id."""
        response = self._stub.Abort(
            engine_pb2.AbortRequest(request_id=request_id),
            timeout=self.options.timeout,
            metadata=self.options.metadata,
        )
        return bool(response.found)

    def get_load(self, timeout: float | None = None) -> engine_pb2.GetLoadResponse:
        response: engine_pb2.GetLoadResponse = self._stub.GetLoad(
            engine_pb2.GetLoadRequest(),
            timeout=timeout or self.options.timeout,
            metadata=self.options.metadata,
        )
        return response

    def list_backends(self, timeout: float | None = None) -> engine_pb2.ListBackendsResponse:
        """Every backend's capability (model, limits, KV figures)."""
        response: engine_pb2.ListBackendsResponse = self._stub.ListBackends(
            engine_pb2.ListBackendsRequest(),
            timeout=timeout or self.options.timeout,
            metadata=self.options.metadata,
        )
        return response

    def health(self, service: str = "") -> bool:
        """True while grpc.health.v1 says SERVING (open to every client, no key needed)."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        response = stub.Check(  # type: ignore[attr-defined]  # the health stubs' typing lacks Check
            health_pb2.HealthCheckRequest(service=service), timeout=self.options.timeout or 5.0
        )
        return bool(response.status == health_pb2.HealthCheckResponse.SERVING)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncEngineClient:
    """asyncio client over ``grpc.aio``; ``async with`` closes it."""

    def __init__(self, address: str = DEFAULT_ADDRESS, options: ClientOptions | None = None, **kw: Any):
        self.options = options or ClientOptions(**kw)
        credentials, channel_args = self.options.credentials(), list(self.options.channel_options)
        self._channel = (
            grpc.aio.secure_channel(address, credentials, channel_args)
            if credentials
            else grpc.aio.insecure_channel(address, channel_args)
        )
        self._stub = engine_pb2_grpc.EngineStub(self._channel)

    async def generate(
        self,
        request: engine_pb2.GenerateRequest | None = None,
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[engine_pb2.GenerateEvent]:
        call = self._stub.Generate(
            _request(request, kwargs), timeout=timeout or self.options.timeout, metadata=self.options.metadata
        )
        try:
            async for event in call:
                yield event
        finally:
            call.cancel()

    async def generate_batch(
        self, requests: Sequence[engine_pb2.GenerateRequest], *, timeout: float | None = None
    ) -> AsyncIterator[engine_pb2.GenerateEvent]:
        """As :meth:`EngineClient.generate_batch`."""
        call = self._stub.GenerateBatch(
            engine_pb2.GenerateBatchRequest(requests=requests),
            timeout=timeout or self.options.timeout,
            metadata=self.options.metadata,
        )
        try:
            async for batch in call:
                for event in batch.events:
                    yield event
        finally:
            call.cancel()

    async def abort(self, request_id: str) -> bool:
        response = await self._stub.Abort(
            engine_pb2.AbortRequest(request_id=request_id),
            timeout=self.options.timeout,
            metadata=self.options.metadata,
        )
        return bool(response.found)

    async def get_load(self, timeout: float | None = None) -> engine_pb2.GetLoadResponse:
        response: engine_pb2.GetLoadResponse = await self._stub.GetLoad(
            engine_pb2.GetLoadRequest(),
            timeout=timeout or self.options.timeout,
            metadata=self.options.metadata,
        )
        return response

    async def list_backends(self, timeout: float | None = None) -> engine_pb2.ListBackendsResponse:
        response: engine_pb2.ListBackendsResponse = await self._stub.ListBackends(
            engine_pb2.ListBackendsRequest(),
            timeout=timeout or self.options.timeout,
            metadata=self.options.metadata,
        )
        return response

    async def health(self, service: str = "") -> bool:
        stub = health_pb2_grpc.HealthStub(self._channel)
        response = await stub.Check(  # type: ignore[attr-defined]  # the health stubs' typing lacks Check
            health_pb2.HealthCheckRequest(service=service), timeout=self.options.timeout or 5.0
        )
        return bool(response.status == health_pb2.HealthCheckResponse.SERVING)

    async def wait_ready(self, timeout: float) -> None:
        """Until the channel is connected (asyncio.TimeoutError after ``timeout`` seconds)."""
        await asyncio.wait_for(self._channel.channel_ready(), timeout)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
