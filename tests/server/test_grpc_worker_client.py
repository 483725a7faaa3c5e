"""GrpcWorkerBackend against an in-process Worker service that misbehaves on purpose."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import grpc.aio
import pytest

from ominix_runtime import wire
from ominix_runtime.backends.grpc_worker import GrpcWorkerBackend
from ominix_runtime.bind_probe import free_port
from ominix_runtime.contract import FAKE_PROFILE, DecodeStep, ModelInfo, OminixError, RuntimeErrorKind
from ominix_runtime.pb import common_pb2, worker_pb2, worker_pb2_grpc

CAPABILITY = dataclasses.replace(
    FAKE_PROFILE, model=ModelInfo(name="m", vocab_size=100, max_model_len=64, eos_token_ids=(2,))
)


class ScriptedWorker(worker_pb2_grpc.WorkerServicer):
    """mode: echo | heartbeat_only | silent | fatal | close | refuse | mute.

    Every mode but ``mute`` and ``refuse`` accepts the stream with a heartbeat, as a real worker does."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.steps_seen: list[int] = []

    async def Describe(self, request, context):  # noqa: ANN001, ANN201
        return wire.capability_to_pb(CAPABILITY)

    async def Health(self, request, context):  # noqa: ANN001, ANN201
        return worker_pb2.HealthResponse(ready=True)

    async def Run(self, request_iterator, context) -> AsyncIterator[worker_pb2.WorkerMessage]:  # noqa: ANN001
        if self.mode == "refuse":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another Run stream is active")
        if self.mode != "mute":
            yield worker_pb2.WorkerMessage(heartbeat=worker_pb2.Heartbeat(worker_time=0.0))
        if self.mode == "heartbeat_only":
            # Heartbeats until the client half-closes; the step never finishes.
            drained = asyncio.ensure_future(_drain(request_iterator))
            while not drained.done():
                yield worker_pb2.WorkerMessage(heartbeat=worker_pb2.Heartbeat(worker_time=0.0))
                await asyncio.sleep(0.05)
            return
        async for step in request_iterator:
            self.steps_seen.append(step.step_id)
            if self.mode == "echo":
                yield worker_pb2.WorkerMessage(heartbeat=worker_pb2.Heartbeat(worker_time=1.0))
                yield worker_pb2.WorkerMessage(step_result=worker_pb2.StepResult(step_id=step.step_id))
            elif self.mode == "fatal":
                yield worker_pb2.WorkerMessage(
                    fatal_error=common_pb2.ErrorInfo(
                        code=common_pb2.ERROR_CODE_INTERNAL, message="GPU on fire"
                    )
                )
            elif self.mode == "close":
                return
            # silent: swallow the step


async def _drain(request_iterator: AsyncIterator[worker_pb2.DecodeStep]) -> None:
    async for _ in request_iterator:
        pass


async def _serve(mode: str) -> tuple[grpc.aio.Server, ScriptedWorker, str]:
    server = grpc.aio.server()
    worker = ScriptedWorker(mode)
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    await server.start()
    return server, worker, f"127.0.0.1:{port}"


async def _expect_unavailable(mode: str, step_timeout: float = 5.0, heartbeat_timeout: float = 3.0) -> str:
    server, _, address = await _serve(mode)
    backend = GrpcWorkerBackend(address, step_timeout=step_timeout, heartbeat_timeout=heartbeat_timeout)
    try:
        stream = await backend.open()
        await stream.send(DecodeStep(1))
        with pytest.raises(OminixError) as info:
            await asyncio.wait_for(stream.recv(), 10)
        assert info.value.kind == RuntimeErrorKind.BACKEND_UNAVAILABLE
        with pytest.raises(OminixError):  # the stream stays broken
            await stream.recv()
        return info.value.message
    finally:
        await backend.close()
        await server.stop(0)


def test_results_in_order_heartbeats_skipped() -> None:
    async def run() -> None:
        server, worker, address = await _serve("echo")
        backend = GrpcWorkerBackend(address, step_timeout=5)
        try:
            assert await backend.health()
            cap = await backend.describe()
            assert cap.worker_id == "fake-0" and cap.model.vocab_size == 100
            stream = await backend.open()
            for step_id in (1, 2, 3):  # two steps in flight at a time, like the engine's overlap
                await stream.send(DecodeStep(step_id))
            assert [(await stream.recv()).step_id for _ in range(3)] == [1, 2, 3]
            await stream.close()
            assert worker.steps_seen == [1, 2, 3]
        finally:
            await backend.close()
            await server.stop(0)

    asyncio.run(run())


def test_fatal_error_makes_the_worker_unavailable() -> None:
    assert "GPU on fire" in asyncio.run(_expect_unavailable("fatal"))


def test_stream_closed_by_worker() -> None:
    assert "closed" in asyncio.run(_expect_unavailable("close"))


def test_silence_beyond_the_heartbeat_timeout() -> None:
    """No result and no heartbeat (a SIGSTOPped worker): unavailable after the heartbeat timeout, even with a
    long step timeout."""
    message = asyncio.run(_expect_unavailable("silent", step_timeout=30, heartbeat_timeout=0.4))
    assert "within 0.4s" in message and "unresponsive" in message


def test_a_step_past_the_step_timeout_fails_even_with_heartbeats() -> None:
    """Heartbeats prove the worker's process alive, not its device: a step due longer than the step
    timeout breaks the stream."""
    message = asyncio.run(_expect_unavailable("heartbeat_only", step_timeout=0.5, heartbeat_timeout=3))
    assert "0.5s step timeout" in message


def test_heartbeats_keep_an_idle_stream_alive() -> None:
    async def run() -> None:
        server, _, address = await _serve("heartbeat_only")
        backend = GrpcWorkerBackend(address, heartbeat_timeout=0.3)
        try:
            stream = await backend.open()
            # No step is due: well past the heartbeat timeout, heartbeats keep the stream healthy.
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(stream.recv(), 1.2)
        finally:
            await backend.close()
            await server.stop(0)

    asyncio.run(run())


@pytest.mark.parametrize("mode", ["refuse", "mute"])
def test_open_fails_when_the_worker_does_not_accept_the_stream(mode: str) -> None:
    """A refused or unanswered Run never yields a stream, so the group is never reported healthy."""

    async def run() -> str:
        server, _, address = await _serve(mode)
        backend = GrpcWorkerBackend(address, heartbeat_timeout=0.5, rpc_timeout=0.5)
        try:
            with pytest.raises(OminixError) as info:
                await backend.open()
            assert info.value.kind == RuntimeErrorKind.BACKEND_UNAVAILABLE
            return info.value.message
        finally:
            await backend.close()
            await server.stop(0)

    message = asyncio.run(run())
    assert ("FAILED_PRECONDITION" in message) if mode == "refuse" else ("did not answer" in message)


def test_auto_step_timeout_follows_the_slowest_step() -> None:
    async def run() -> None:
        server, _, address = await _serve("echo")
        backend = GrpcWorkerBackend(address)  # no explicit step timeout
        try:
            stream = await backend.open()
            assert stream.step_timeout == 30.0  # the floor before any step
            await stream.send(DecodeStep(1))
            await stream.recv()
            assert 0 < stream.slowest_step < 1 and stream.step_timeout == 30.0
            stream.slowest_step = 7.0  # as if a 7 s step had been measured
            assert stream.step_timeout == 70.0
        finally:
            await backend.close()
            await server.stop(0)

    asyncio.run(run())


def test_worker_killed_mid_stream() -> None:
    async def run() -> None:
        server, _, address = await _serve("silent")
        backend = GrpcWorkerBackend(address, step_timeout=30)
        try:
            stream = await backend.open()
            await stream.send(DecodeStep(1))
            recv = asyncio.ensure_future(stream.recv())
            await asyncio.sleep(0.1)
            await server.stop(0)
            with pytest.raises(OminixError) as info:
                await asyncio.wait_for(recv, 10)
            assert info.value.kind == RuntimeErrorKind.BACKEND_UNAVAILABLE
        finally:
            await backend.close()

    asyncio.run(run())


def test_nothing_listening() -> None:
    async def run() -> None:
        backend = GrpcWorkerBackend(f"127.0.0.1:{free_port()}", rpc_timeout=2)
        try:
            assert not await backend.health()
            with pytest.raises(OminixError) as info:
                await backend.describe()
            assert info.value.kind == RuntimeErrorKind.BACKEND_UNAVAILABLE
        finally:
            await backend.close()

    asyncio.run(run())
