"""What every call of the front Engine API passes before its handler runs: the API key, and a request that
decodes.

- With API keys configured, a call must carry ``authorization: Bearer KEY`` metadata naming one of them,
  else UNAUTHENTICATED. Health and reflection are other services and stay open (load balancers, grpcurl).
- A request whose bytes do not decode (corrupt message, invalid UTF-8 in a string) is INVALID_ARGUMENT with
  the reason, where gRPC itself would answer UNKNOWN.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from ominix_runtime.contract import RuntimeErrorKind
from ominix_runtime.pb import engine_pb2
from ominix_runtime.server.call_errors import error_metadata

ENGINE_METHOD_PREFIX = "/" + engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name + "/"
AUTHORIZATION = "authorization"
_BEARER = "bearer "


def bearer_key(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The KEY of an ``authorization: Bearer KEY`` entry, or None."""
    for name, value in metadata or ():
        if name.lower() == AUTHORIZATION and isinstance(value, str) and value[:7].lower() == _BEARER:
            return value[7:].strip()
    return None


if TYPE_CHECKING:  # only the stubs make these generic
    from typing import TypeAlias

    # Requests and responses pass through the guard whatever their message type.
    _Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
    _Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    # The aio server's handlers; the grpc stubs type RpcMethodHandler's behaviours for the sync server.
    _UnaryUnary: TypeAlias = Callable[[Any, _Context], Awaitable[Any]]
    _UnaryStream: TypeAlias = Callable[[Any, _Context], AsyncGenerator[Any, None]]


def caller_of(context: _Context) -> str:
    """Who is calling: a digest of the API key the call carries ("" without one). Requests belong to it."""
    key = bearer_key(context.invocation_metadata())
    return hashlib.sha256(key.encode()).hexdigest()[:32] if key else ""


class _Undecodable:
    """Stands in for a request whose bytes did not decode; the handler answers INVALID_ARGUMENT."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return _Undecodable(f"the request does not decode: {exc}")
        except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's bad bytes
            return _Undecodable(f"the request does not decode: {type(exc).__name__}")

    return decode


class FrontGuard(grpc.aio.ServerInterceptor):
    """Checks the API key and decodes requests safely for every Engine method."""

    def __init__(self, api_keys: Sequence[str] = ()) -> None:
        self._keys = [k.encode() for k in api_keys if k]

    def _authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        if not self._keys:
            return True
        key = bearer_key(metadata)
        if key is None:
            return False
        given = key.encode()
        # Compare with every key (constant time each) so timing does not tell which one nearly matched.
        return any([hmac.compare_digest(given, k) for k in self._keys])

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(ENGINE_METHOD_PREFIX):
            return handler
        authorized = self._authorized(handler_call_details.invocation_metadata)
        return _guarded(handler, authorized)


async def _refuse(request: Any, context: _Context, authorized: bool) -> None:
    # The contract has no kind of its own for a missing key: the call as sent is invalid, and sent again it
    # fails again.
    refused = error_metadata(RuntimeErrorKind.INVALID_ARGUMENT)
    if not authorized:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or unknown API key (send `authorization: Bearer KEY`)",
            trailing_metadata=refused,
        )
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason, trailing_metadata=refused)


def _guarded(handler: _Handler, authorized: bool) -> _Handler:
    """``handler`` with its request decoded safely, refusing unauthorized or undecodable calls first."""
    deserializer = _safe(handler.request_deserializer)
    serializer = handler.response_serializer
    if handler.unary_unary is not None:
        inner_uu = cast("_UnaryUnary", handler.unary_unary)

        async def unary_unary(request: Any, context: _Context) -> Any:
            await _refuse(request, context, authorized)
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, deserializer, serializer)
    if handler.unary_stream is not None:
        inner_us = cast("_UnaryStream", handler.unary_stream)

        async def unary_stream(request: Any, context: _Context) -> AsyncIterator[Any]:
            await _refuse(request, context, authorized)
            events = inner_us(request, context)
            try:
                async for item in events:
                    yield item
            finally:
                await events.aclose()  # its own cleanup (abort the request) runs now, not at collection

        return grpc.unary_stream_rpc_method_handler(unary_stream, deserializer, serializer)
    return handler  # the Engine API has no client-streaming methods
