"""Test harness: an engine daemon over the deterministic fake backend, served in a background thread on loopback."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, replace

import grpc

from ominix_runtime.bind_probe import free_ports
from ominix_runtime.config import LogConfig, RuntimeConfig, ServerConfig
from ominix_runtime.models import DEFAULT_MODEL_NAME
from ominix_runtime.pb import engine_pb2_grpc
from ominix_runtime.server.app import EngineDaemon
from ominix_runtime.testing.fake_backend import FakeConfig, FakeStepBackend

SMOLLM2_VOCAB = 49152


@dataclass
class RunningDaemon:
    daemon: EngineDaemon
    backend: FakeStepBackend
    loop: asyncio.AbstractEventLoop
    address: str
    metrics_url: str
    channel: grpc.Channel

    @property
    def stub(self) -> engine_pb2_grpc.EngineStub:
        return engine_pb2_grpc.EngineStub(self.channel)

    def call(self, fn, timeout: float = 10.0):  # noqa: ANN001, ANN201 - test helper
        """Run ``fn()`` (sync) on the daemon's loop thread and return its result."""

        async def wrapper():  # noqa: ANN202
            return fn()

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(timeout)


def start_daemon(fake: FakeConfig, **config_overrides) -> tuple[RunningDaemon, threading.Thread]:  # noqa: ANN003
    port, metrics_port = free_ports(2)  # distinct: two single picks can name the same port
    config = RuntimeConfig(
        server=ServerConfig(port=port, metrics_port=metrics_port, drain_timeout=5.0),
        log=LogConfig(format="json"),
        **config_overrides,
    )
    # The daemon serves the embedded model's tokenizer; the fake backend states that model's name.
    backend = FakeStepBackend(replace(fake, model_name=DEFAULT_MODEL_NAME))
    loop = asyncio.new_event_loop()
    daemon_box: dict[str, EngineDaemon] = {}
    started = threading.Event()
    errors: list[BaseException] = []

    async def main() -> None:
        daemon = EngineDaemon(config, backends=[backend])
        daemon_box["daemon"] = daemon
        try:
            await daemon.start()
        except BaseException as exc:
            errors.append(exc)
            started.set()
            await daemon.shutdown()
            return
        started.set()
        await daemon.stop_requested.wait()
        await daemon.shutdown()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    assert started.wait(60), "daemon did not start within 60s"
    if errors:
        raise errors[0]
    daemon = daemon_box["daemon"]
    address = f"127.0.0.1:{daemon.bound_port}"
    running = RunningDaemon(
        daemon,
        backend,
        loop,
        address,
        f"http://127.0.0.1:{daemon.metrics_port}/metrics",
        grpc.insecure_channel(address),
    )
    return running, thread


def stop_daemon(running: RunningDaemon, thread: threading.Thread) -> None:
    running.channel.close()
    running.loop.call_soon_threadsafe(running.daemon.stop_requested.set)
    thread.join(30)
    assert not thread.is_alive(), "daemon did not stop within 30s"
    running.loop.close()
