"""Ports taken after the start-up check, while the workers load (`serve` waits for them, `launch` loads them
before it runs the engine): the bind that comes later must fail as a taken port does at start-up, one line
naming the flag and exit code 1 after a graceful stop, and never end up sharing the port with another server.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health, health_pb2_grpc
from server_harness import SMOLLM2_VOCAB

from ominix_runtime.bind_probe import free_ports
from ominix_runtime.config import FrontConfig, LogConfig, RuntimeConfig, ServerConfig
from ominix_runtime.contract import OminixError
from ominix_runtime.models import DEFAULT_MODEL_NAME
from ominix_runtime.server import app
from ominix_runtime.server.logging import configure_logging
from ominix_runtime.testing.fake_backend import FakeConfig, FakeStepBackend


def _backend() -> FakeStepBackend:
    # The daemon serves the embedded model's tokenizer; the fake backend states that model's name.
    return FakeStepBackend(
        FakeConfig(vocab_size=SMOLLM2_VOCAB, eos_token_ids=(2,), model_name=DEFAULT_MODEL_NAME)
    )


def _config(port: int, metrics_port: int, front_procs: int = 0) -> RuntimeConfig:
    return RuntimeConfig(
        server=ServerConfig(port=port, metrics_port=metrics_port, drain_timeout=1.0),
        log=LogConfig(format="json"),
        front=FrontConfig(procs=front_procs),
    )


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@contextlib.contextmanager
def _listening(port: int) -> Iterator[None]:
    """Another process's listener on ``port`` (SO_REUSEADDR, as most servers set)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
        yield


@contextlib.asynccontextmanager
async def _other_grpc_server(port: int) -> AsyncIterator[None]:
    """Another gRPC server on ``port`` with gRPC's default options, which set SO_REUSEPORT (a second engine)."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    await server.start()
    try:
        yield
    finally:
        await server.stop(0)


def test_a_metrics_port_taken_late_is_one_line_and_a_graceful_exit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("warning", json_output=True)
    backend = _backend()
    monkeypatch.setattr(app, "_build_backends", lambda config: [backend])
    port, metrics_port = free_ports(2)
    with _listening(metrics_port):
        code = asyncio.run(asyncio.wait_for(app.serve(_config(port, metrics_port)), 60))
    assert code == 1
    lines = capsys.readouterr().err.splitlines()
    errors = [line for line in lines if line.startswith("ominix-runtime: error:")]
    assert len(errors) == 1, lines
    assert "--metrics-port" in errors[0] and str(metrics_port) in errors[0]
    assert not any("Traceback" in line for line in lines)
    # What started was stopped: the backends closed, the engine port released.
    assert backend.closed
    assert _bindable(port)


async def _start_expecting_a_taken_port(config: RuntimeConfig) -> str:
    """Start a daemon on a port another gRPC server holds; the start's error message (it must fail)."""
    daemon = app.EngineDaemon(config, backends=[_backend()])
    try:
        with pytest.raises(OminixError) as refused:
            await daemon.start()
        return refused.value.message
    finally:
        await daemon.shutdown()


@pytest.mark.parametrize("front_procs", [0, 1], ids=["engine-binds", "one-front-binds"])
def test_an_engine_port_taken_late_fails_the_bind_instead_of_sharing_it(front_procs: int) -> None:
    """With no front process (or one) a single process serves the port: it binds without SO_REUSEPORT, so
    another gRPC server that bound it first is a taken port, not a share of the connections. (Several fronts
    still share their port: test_front_procs.py serves through two.)"""
    configure_logging("warning", json_output=True)
    port, metrics_port = free_ports(2)

    async def body() -> str:
        async with _other_grpc_server(port):
            return await _start_expecting_a_taken_port(_config(port, metrics_port, front_procs))

    message = asyncio.run(asyncio.wait_for(body(), 120))
    assert str(port) in message
