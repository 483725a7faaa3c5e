"""Test harness: an engine daemon over the deterministic fake backend, served in a background thread on loopback."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import grpc

from ominix_runtime.bind_probe import free_ports
from ominix_runtime.config import FrontConfig, LogConfig, RuntimeConfig, ServerConfig
from ominix_runtime.models import DEFAULT_MODEL_NAME
from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc
from ominix_runtime.server.app import EngineDaemon
from ominix_runtime.server.logging import configure_logging
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


def token_request(rid: str, max_tokens: int) -> engine_pb2.GenerateRequest:
    """A greedy request of ``max_tokens`` tokens (eos ignored) on a four-token prompt."""
    return engine_pb2.GenerateRequest(
        request_id=rid,
        input_ids=engine_pb2.TokenIds(ids=[11, 12, 13, 14]),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


class StreamReader:
    """One Generate stream of ``token_request`` on its own connection (so the kernel picks the front process
    behind a shared port), read in a thread."""

    def __init__(
        self, address: str, rid: str, max_tokens: int, metadata: Sequence[tuple[str, str]] = ()
    ) -> None:
        self._channel = grpc.insecure_channel(address)
        self.events: list[engine_pb2.GenerateEvent] = []
        self.error: grpc.RpcError | None = None
        self.ended_at = 0.0
        self.first_token = threading.Event()  # set by the first token, or by the stream's end
        call = engine_pb2_grpc.EngineStub(self._channel).Generate(
            token_request(rid, max_tokens), metadata=tuple(metadata), timeout=60
        )
        self._thread = threading.Thread(target=self._read, args=(call,), daemon=True)
        self._thread.start()

    def _read(self, call: Iterator[engine_pb2.GenerateEvent]) -> None:
        try:
            for event in call:
                self.events.append(event)
                if event.HasField("token"):
                    self.first_token.set()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.first_token.set()

    def join(self) -> None:
        self._thread.join(60)
        assert not self._thread.is_alive(), "stream did not end"
        self._channel.close()

    def terminals(self) -> list[str]:
        kinds = (e.WhichOneof("event") for e in self.events)
        return [k for k in kinds if k in ("done", "error")]

    def tokens(self) -> int:
        return sum(len(e.token.token_ids) for e in self.events if e.HasField("token"))


# The fake worker of these daemons: SmolLM2's vocabulary and eos, a small KV, a fast step.
FAKE = FakeConfig(
    vocab_size=SMOLLM2_VOCAB, eos_token_ids=(2,), max_model_len=2048, kv_num_blocks=64, step_latency=0.002
)


def running_daemon(fake: FakeConfig, front_procs: int) -> Iterator[RunningDaemon]:
    """A daemon on ``fake`` with ``front_procs`` front processes, for the test (or module) that yields it."""
    configure_logging("warning", json_output=True)
    running, thread = start_daemon(fake, front=FrontConfig(procs=front_procs))
    try:
        yield running
    finally:
        stop_daemon(running, thread)
