"""Daemon lifecycle: NOT_SERVING (and Generate UNAVAILABLE) until the engine is ready, then SERVING."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_harness import SMOLLM2_VOCAB

from ominix_runtime.bind_probe import free_port
from ominix_runtime.config import LogConfig, RuntimeConfig, ServerConfig
from ominix_runtime.models import DEFAULT_MODEL_NAME
from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc
from ominix_runtime.server.app import EngineDaemon
from ominix_runtime.testing.fake_backend import FakeConfig, FakeStepBackend

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


def test_not_serving_until_ready_then_serving_then_clean_stop() -> None:
    port = free_port()
    daemon = EngineDaemon(
        RuntimeConfig(
            server=ServerConfig(port=port, metrics_port=0, drain_timeout=2.0), log=LogConfig(format="json")
        ),
        backends=[
            FakeStepBackend(
                FakeConfig(vocab_size=SMOLLM2_VOCAB, describe_delay=2.0, model_name=DEFAULT_MODEL_NAME)
            )
        ],
    )
    loop = asyncio.new_event_loop()
    failures: list[BaseException] = []

    async def main() -> None:
        try:
            await daemon.start()
            await daemon.stop_requested.wait()
        except BaseException as exc:
            failures.append(exc)
        finally:
            await daemon.shutdown()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    statuses: list[int] = []
    unavailable_while_starting = None
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            engine = engine_pb2_grpc.EngineStub(channel)
            deadline = time.monotonic() + 60
            while not statuses or statuses[-1] != SERVING:
                assert time.monotonic() < deadline, f"never SERVING: {statuses}"
                assert thread.is_alive(), failures
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                except grpc.RpcError:
                    time.sleep(0.02)  # not bound yet
                    continue
                statuses.append(status)
                if status == NOT_SERVING and unavailable_while_starting is None:
                    try:
                        list(engine.Generate(engine_pb2.GenerateRequest(prompt="x"), timeout=5))
                    except grpc.RpcError as exc:
                        unavailable_while_starting = exc.code()
                time.sleep(0.02)
            assert statuses[0] == NOT_SERVING
            assert unavailable_while_starting == grpc.StatusCode.UNAVAILABLE
            events = list(
                engine.Generate(
                    engine_pb2.GenerateRequest(
                        prompt="x", sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0)
                    ),
                    timeout=10,
                )
            )
            assert events[-1].HasField("done")
    finally:
        loop.call_soon_threadsafe(daemon.stop_requested.set)
        thread.join(30)
    assert not thread.is_alive() and not failures
    loop.close()
