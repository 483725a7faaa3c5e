"""Step-level backend client: one torch worker process reached over gRPC (ominix.runtime.v1.Worker)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import Any

import grpc
import grpc.aio

from ominix_runtime import wire
from ominix_runtime.config import DEFAULT_WORKER_HEARTBEAT_TIMEOUT_S as DEFAULT_HEARTBEAT_TIMEOUT_S
from ominix_runtime.contract import BackendCapability, DecodeStep, OminixError, RuntimeErrorKind, StepResult
from ominix_runtime.pb import worker_pb2, worker_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_RPC_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 5.0
# Without an explicit step timeout, a step may take this many times the slowest step seen on the stream,
# and never less than the floor (a first long prefill, a slow device).
AUTO_STEP_TIMEOUT_FACTOR = 10.0
AUTO_STEP_TIMEOUT_FLOOR_S = 30.0
# A wait that ends this much later than asked means the engine's own event loop was stalled.
_LOOP_STALL_S = 0.25
# Metadata on Run carrying the shared secret of plaintext deployments (see ominix_worker's --engine-secret).
ENGINE_SECRET_METADATA = "x-ominix-engine-secret"

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
    """One bidirectional Worker.Run call. Results arrive in step_id order.

    Two clocks, so that liveness does not depend on compute: any message (a heartbeat from the worker's
    event loop, or a result) proves the worker alive, and silence longer than ``heartbeat_timeout`` breaks the
    stream; a step that is due gets ``step_timeout`` seconds (None: derived from the slowest step seen) from
    when it was sent or the previous result arrived, heartbeats or not (a hung device).
    """

    def __init__(
        self,
        address: str,
        call: grpc.aio.StreamStreamCall[worker_pb2.DecodeStep, worker_pb2.WorkerMessage],
        step_timeout: float | None,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    ) -> None:
        self._address = address
        self._call = call
        self._step_timeout = step_timeout
        self._heartbeat_timeout = heartbeat_timeout
        # A reader task owns call.read(): cancelling a pending read() directly would tear down the RPC.
        # Only results and failures are queued; heartbeats just move _last_heard (an idle engine would
        # otherwise pile them up).
        self._inbox: asyncio.Queue[Any] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._last_heard = self._loop.time()
        self._heard = asyncio.Event()  # the worker accepted the stream (its first message arrived)
        self._sent_at: collections.deque[float] = collections.deque()  # steps due, oldest first
        self._last_result_at = 0.0
        self.slowest_step = 0.0
        self._reader = self._loop.create_task(self._read_loop())
        self._broken: OminixError | None = None
        self._closed = False

    @property
    def step_timeout(self) -> float:
        if self._step_timeout is not None:
            return self._step_timeout
        return max(AUTO_STEP_TIMEOUT_FLOOR_S, AUTO_STEP_TIMEOUT_FACTOR * self.slowest_step)

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await self._call.read()
                if not isinstance(msg, worker_pb2.WorkerMessage):  # grpc.aio.EOF: the worker closed it
                    self._inbox.put_nowait(_unavailable(self._address, "Run stream closed by the worker"))
                    return
                self._last_heard = self._loop.time()
                self._heard.set()
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

    async def accepted(self, timeout: float) -> None:
        """Return once the worker has answered the stream (a worker sends a heartbeat when it accepts Run);
        raise BACKEND_UNAVAILABLE when it refused it or said nothing within ``timeout``."""
        heard = asyncio.ensure_future(self._heard.wait())
        try:
            await asyncio.wait({heard, self._reader}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            heard.cancel()
        if self._heard.is_set():
            return
        if self._reader.done() and not self._inbox.empty():
            self._broken = self._inbox.get_nowait()
        else:
            self._broken = _unavailable(self._address, f"did not answer the Run stream within {timeout:g}s")
        self._call.cancel()
        raise self._broken

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
        self._sent_at.append(self._loop.time())

    def _fail(self, what: str) -> OminixError:
        self._broken = _unavailable(self._address, what)
        self._call.cancel()
        return self._broken

    async def recv(self) -> StepResult:
        if self._broken is not None:
            raise self._broken
        while True:
            now = self._loop.time()
            silence_ends = self._last_heard + self._heartbeat_timeout
            if now >= silence_ends:
                raise self._fail(
                    f"no step result or heartbeat within {self._heartbeat_timeout:g}s (unresponsive)"
                )
            wait = silence_ends - now
            if self._sent_at:
                # A step runs from when it was sent or when the one before it finished, whichever is later.
                due = max(self._sent_at[0], self._last_result_at) + self.step_timeout
                if now >= due:
                    raise self._fail(
                        f"step not finished within the {self.step_timeout:g}s step timeout (heartbeats continue)"
                    )
                wait = min(wait, due - now)
            try:
                item = await asyncio.wait_for(self._inbox.get(), timeout=wait)
            except asyncio.TimeoutError:
                # This event loop itself may have been stalled (a long GC, a starved process): silence it
                # slept through is not the worker's, and messages that came meanwhile are not read yet.
                late = self._loop.time() - (now + wait)
                if late > _LOOP_STALL_S:
                    self._last_heard += late
                continue  # re-check: a message may have arrived meanwhile
            return self._take(item)

    def recv_nowait(self) -> StepResult | None:
        if self._broken is not None:
            raise self._broken
        if self._inbox.empty():
            return None
        return self._take(self._inbox.get_nowait())

    def _take(self, item: Any) -> StepResult:  # noqa: ANN401 - a WorkerMessage or the stream's failure
        if isinstance(item, OminixError):
            self._broken = item
            raise item
        if item.WhichOneof("kind") == "fatal_error":
            self._broken = _unavailable(self._address, f"fatal error: {item.fatal_error.message}")
            raise self._broken
        self._on_result()
        return wire.step_result_from_pb(item.step_result)

    def _on_result(self) -> None:
        now = self._loop.time()
        if self._sent_at:
            started = max(self._sent_at.popleft(), self._last_result_at)
            self.slowest_step = max(self.slowest_step, now - started)
        self._last_result_at = now

    def abandon(self) -> None:
        """End a stream nothing was sent on, at once (no ordered close: the worker holds no state for it)."""
        self._closed = True
        self._call.cancel()
        self._reader.cancel()

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
        step_timeout: float | None = None,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_S,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        engine_secret: str | None = None,
        launch_nonce: str = "",
    ) -> None:
        """``step_timeout`` None: derived from the step times measured on each stream (see GrpcStepStream).
        ``engine_secret``: sent on Run to workers that require one (plaintext deployments).
        ``launch_nonce``: when set, ``describe`` (at start and at every reconnect) first checks that the
        worker's Health states it."""
        self.address = address
        self._launch_nonce = launch_nonce
        self._tls = tls
        self._step_timeout = step_timeout
        self._heartbeat_timeout = heartbeat_timeout
        self._engine_secret = engine_secret
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
        if self._launch_nonce:
            await self._check_launch_nonce()
        try:
            pb = await self._get_stub().Describe(worker_pb2.DescribeRequest(), timeout=self._rpc_timeout)
        except grpc.aio.AioRpcError as exc:
            raise _unavailable(self.address, f"Describe failed: {exc.code().name}: {exc.details()}") from exc
        return wire.capability_from_pb(pb)

    async def _check_launch_nonce(self) -> None:
        """Raise CAPABILITY_MISMATCH when the process on this address is not the one `launch` started there
        (another launch nonce: e.g. a foreign process took the port while the worker restarted)."""
        try:
            resp = await self._get_stub().Health(worker_pb2.HealthRequest(), timeout=self._rpc_timeout)
        except grpc.aio.AioRpcError as exc:
            raise _unavailable(self.address, f"Health failed: {exc.code().name}: {exc.details()}") from exc
        if resp.launch_nonce != self._launch_nonce:
            raise OminixError(
                RuntimeErrorKind.CAPABILITY_MISMATCH,
                f"the process on {self.address} (pid {resp.pid or 'unknown'}) answers with another launch nonce: "
                "not a worker this launch started",
            )

    async def open(self) -> GrpcStepStream:
        """A Run stream the worker has accepted: a refused or unanswered one raises BACKEND_UNAVAILABLE, so a
        group is never healthy on a worker it cannot drive (one held by another engine, a wrong secret)."""
        metadata = ((ENGINE_SECRET_METADATA, self._engine_secret),) if self._engine_secret else None
        call = self._get_stub().Run(metadata=metadata)
        stream = GrpcStepStream(self.address, call, self._step_timeout, self._heartbeat_timeout)
        try:
            await stream.accepted(max(self._heartbeat_timeout, self._rpc_timeout))
        except BaseException:
            # Refused, unanswered, or the caller stopped waiting (a reconnect's own timeout): the call must
            # not live on, or a worker that answers it late holds its one Run slot for a reader nobody reads.
            stream.abandon()
            raise
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
