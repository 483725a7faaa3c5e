"""The engine checks the launch nonce each time it reconnects to a worker, not only at start: after its worker
dies, a process with another nonce on the same port is never driven (the group stays unhealthy, one
warning says why); the relaunched worker with the right nonce is reconnected and serves."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from fault_procs import (
    CLI,
    Proc,
    free_ports,
    start_proc_env,
    stop_procs,
    stream_one,
    wait_health,
    worker_argv,
)

from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc

NONCE = "0123456789abcdef"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ominix_worker.testing import write_tiny_hf_model

    return write_tiny_hf_model(tmp_path_factory.mktemp("nonce-model") / "tiny", arch="llama", vocab_size=320)


def _worker(name: str, model: Path, port: int, nonce: str, log_dir: Path) -> Proc:
    # the same worker id each time: what a relaunched worker states
    extra = ("--launch-nonce", nonce, "--worker-id", "w0")
    return start_proc_env(name, worker_argv(str(model), port, extra=extra), log_dir, {})


def _wait_port_answers(address: str, proc: Proc, timeout: float = 120) -> None:
    from ominix_runtime.pb import worker_pb2, worker_pb2_grpc

    end = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        while True:
            assert proc.popen.poll() is None, proc.log_tail()
            try:
                if worker_pb2_grpc.WorkerStub(channel).Health(worker_pb2.HealthRequest(), timeout=2).ready:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < end, proc.log_tail()
            time.sleep(0.2)


def test_reconnect_refuses_a_worker_with_another_launch_nonce(tiny_model: Path, tmp_path: Path) -> None:
    worker_port, port, metrics_port = free_ports(3)
    worker_address = f"127.0.0.1:{worker_port}"
    procs = [_worker("worker", tiny_model, worker_port, NONCE, tmp_path)]
    serve = [
        *CLI,
        "serve",
        "--model",
        str(tiny_model),
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
    ]
    serve += ["--worker", worker_address, "--worker-launch-nonce", NONCE, "--step-timeout", "5"]
    engine = start_proc_env("engine", serve, tmp_path, {})
    procs.append(engine)
    request = engine_pb2.GenerateRequest(
        input_ids=engine_pb2.TokenIds(ids=[5, 6, 7]),
        sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )
    try:
        wait_health(f"127.0.0.1:{port}", procs)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)

            def healthy() -> bool:
                (load,) = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5).backends
                return load.healthy

            first = stream_one(stub, request, 30)
            assert first.done is not None, engine.log_tail()
            os.kill(procs[0].popen.pid, signal.SIGKILL)
            procs[0].popen.wait(timeout=10)
            end = time.monotonic() + 15
            while healthy():
                assert time.monotonic() < end, "kill not noticed"
                time.sleep(0.1)
            # a process of another launch takes the port: answers Describe with the same worker id and model
            impostor = _worker("impostor", tiny_model, worker_port, "fedcba9876543210", tmp_path)
            procs.append(impostor)
            _wait_port_answers(worker_address, impostor)
            end = time.monotonic() + 30
            while "another launch nonce" not in engine.log_tail(100_000):
                assert time.monotonic() < end, engine.log_tail()
                time.sleep(0.2)
            assert not healthy()
            assert "worker_reconnected" not in engine.log_tail(100_000)
            impostor.popen.send_signal(signal.SIGTERM)
            assert impostor.popen.wait(timeout=30) == 0
            # the relaunched worker of this launch is reconnected and serves as before
            relaunched = _worker("relaunched", tiny_model, worker_port, NONCE, tmp_path)
            procs.append(relaunched)
            end = time.monotonic() + 120
            while not healthy():
                assert relaunched.popen.poll() is None, relaunched.log_tail()
                assert time.monotonic() < end, engine.log_tail()
                time.sleep(0.2)
            assert "worker_reconnected" in engine.log_tail(100_000)
            again = stream_one(stub, request, 30)
            assert again.done is not None and again.tokens == first.tokens
    finally:
        stop_procs(procs[::-1])
