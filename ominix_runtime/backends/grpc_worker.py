"""Step-level backend client: one torch worker process reached over gRPC (ominix.runtime.v1.Worker)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
import grpc.aio

from ominix_runtime import wire
from ominix_runtime.contract import BackendCapability, DecodeStep, OminixError, RuntimeErrorKind, StepResult
from ominix_runtime.engine.config import DEFAULT_STEP_TIMEOUT_S
from ominix_runtime.pb import worker_pb2, worker_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_RPC_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 5.0

# Keepalive pings while a Run stream is open detect a dead peer (host gone, cable cut) that a plain TCP
# socket would only notice much later. Pings are spaced well above gRPC servers' default strike policy.
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
)

_EOF = object()


def _unavailable(address: str, what: str) -> OminixError:
    return OminixError(RuntimeErrorKind.BACKEND_UNAVAILABLE, f"worker {address}: {what}")


class GrpcStepStream:
    """One bidirectional Worker.Run call. Results arrive in step_id order; heartbeats reset the timeout."""

    def __init__(
        self,
        address: str,
        call: grpc.aio.StreamStreamCall[worker_pb2.DecodeStep, worker_pb2.WorkerMessage],
        step_timeout: float,
    ) -> None:
        self._address = address
        self._call = call
        self._step_timeout = step_timeout
        # A reader task owns call.read(): cancelling a pending read() directly would tear down the RPC.
        # Only results and failures are queued; heartbeats just move _last_heard (an idle engine would
        # otherwise pile them up).
        self._inbox: asyncio.Queue[Any] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._last_heard = self._loop.time()
        self._reader = self._loop.create_task(self._read_loop())
        self._broken: OminixError | None = None
        self._closed = False

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await self._call.read()
                if not isinstance(msg, worker_pb2.WorkerMessage):  # grpc.aio.EOF: the worker closed it
                    self._inbox.put_nowait(_unavailable(self._address, "Run stream closed by the worker"))
                    return
                self._last_heard = self._loop.time()
                if msg.WhichOneof("kind") in ("step_result", "fatal_error"):
                    self._inbox.put_nowait(msg)
                # heartbeat (or a kind from a newer worker): proof of life only
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            self._inbox.put_nowait(
                _unavailable(self._address, f"Run stream broke: {exc.code().name}: {exc.details()}")
            )
        except Exception as exc:  # noqa: BLE001 - any failure of the stream makes the worker unavailable
            self._inbox.put_nowait(_unavailable(self._address, f"Run stream failed: {exc!r}"))

    async def send(self, step: DecodeStep) -> None:
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise _unavailable(self._address, "stream is closed")
        try:
            await self._call.write(wire.step_to_pb(step))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            self._broken = _unavailable(self._address, f"cannot send step {step.step_id}: {exc!r}")
            raise self._broken from exc

    async def recv(self) -> StepResult:
        if self._broken is not None:
            raise self._broken
        waiting_since = self._loop.time()
        while True:
            # Silence is measured from the later of: when this wait began, the last message heard.
            remaining = max(waiting_since, self._last_heard) + self._step_timeout - self._loop.time()
            if remaining <= 0:
                self._broken = _unavailable(
                    self._address, f"no step result or heartbeat within {self._step_timeout:.1f}s"
                )
                self._call.cancel()
                raise self._broken
            try:
                item = await asyncio.wait_for(self._inbox.get(), timeout=remaining)
            except asyncio.TimeoutError:
                continue  # re-check: a heartbeat may have arrived meanwhile
            if isinstance(item, OminixError):
                self._broken = item
                raise item
            if item.WhichOneof("kind") == "fatal_error":
                self._broken = _unavailable(self._address, f"fatal error: {item.fatal_error.message}")
                raise self._broken
            return wire.step_result_from_pb(item.step_result)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Half-close and let the worker end the call itself, so it can drop its state in order; cancel only
        # when it does not answer in time (cancelling first could interrupt the worker's own cleanup).
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._call.done_writing(), timeout=CLOSE_TIMEOUT_S)
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(asyncio.shield(self._reader), timeout=CLOSE_TIMEOUT_S)
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader


class GrpcWorkerBackend:
    """StepBackend for a worker at ``host:port``. The channel is created lazily on the running loop."""

    def __init__(
        self,
        address: str,
        *,
        tls: grpc.ChannelCredentials | None = None,
        step_timeout: float = DEFAULT_STEP_TIMEOUT_S,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_S,
    ) -> None:
        self.address = address
        self._tls = tls
        self._step_timeout = step_timeout
        self._rpc_timeout = rpc_timeout
        self._channel: grpc.aio.Channel | None = None
        self._stub: worker_pb2_grpc.WorkerStub | None = None
        self._streams: list[GrpcStepStream] = []

    def __repr__(self) -> str:
        return f"GrpcWorkerBackend({self.address!r})"

    def _get_stub(self) -> worker_pb2_grpc.WorkerStub:
        if self._stub is None:
            if self._tls is not None:
                self._channel = grpc.aio.secure_channel(self.address, self._tls, options=CHANNEL_OPTIONS)
            else:
                self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
            self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        return self._stub

    async def describe(self) -> BackendCapability:
        try:
            pb = await self._get_stub().Describe(worker_pb2.DescribeRequest(), timeout=self._rpc_timeout)
        except grpc.aio.AioRpcError as exc:
            raise _unavailable(self.address, f"Describe failed: {exc.code().name}: {exc.details()}") from exc
        return wire.capability_from_pb(pb)

    async def open(self) -> GrpcStepStream:
        call = self._get_stub().Run()
        stream = GrpcStepStream(self.address, call, self._step_timeout)
        self._streams = [s for s in self._streams if not s._closed] + [stream]
        return stream

    async def health(self) -> bool:
        try:
            resp = await self._get_stub().Health(worker_pb2.HealthRequest(), timeout=self._rpc_timeout)
        except grpc.aio.AioRpcError:
            return False
        return bool(resp.ready)

    async def wait_ready(self, timeout: float) -> None:
        """Poll Health until the worker reports ready; raise BACKEND_UNAVAILABLE after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if await self.health():
                return
            await asyncio.sleep(0.1)
        raise _unavailable(self.address, f"not ready within {timeout:.0f}s")

    async def close(self) -> None:
        for stream in self._streams:
            await stream.close()
        self._streams.clear()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None
