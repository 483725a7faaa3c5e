"""`launch` restarts a worker killed with SIGKILL; the engine reconnects to it and it serves again."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import grpc
import pytest
from fault_procs import CLI, free_ports, start_proc_env, stop_procs, stream_one, wait_health

from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))
from test_launch import _children, _two_consecutive_free_ports  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ominix_worker.testing import write_tiny_hf_model

    return write_tiny_hf_model(tmp_path_factory.mktemp("launch-model") / "tiny", arch="llama", vocab_size=320)


def test_launch_restarts_a_killed_worker_and_the_engine_reconnects(tiny_model: Path, tmp_path: Path) -> None:
    base = _two_consecutive_free_ports()
    port, metrics_port = free_ports(2)
    argv = [*CLI, "launch", "--devices", "cpu,cpu", "--model", str(tiny_model), "--port", str(port)]
    argv += [
        "--metrics-port",
        str(metrics_port),
        "--worker-base-port",
        str(base),
        "--kv-cache-memory",
        "8MiB",
        "--step-timeout",
        "5",
    ]
    launch = start_proc_env("launch", argv, tmp_path, {})
    address = f"127.0.0.1:{port}"
    victim_address = f"127.0.0.1:{base}"
    try:
        wait_health(address, [launch])
        with grpc.insecure_channel(address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)

            def victim() -> engine_pb2.BackendLoad:
                loads = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5).backends
                return next(b for b in loads if b.worker_id.endswith(victim_address))

            before = set(_children(launch.popen.pid))
            victim_pid = next(p for p in before if str(base) in Path(f"/proc/{p}/cmdline").read_text())
            os.kill(victim_pid, signal.SIGKILL)
            end = time.monotonic() + 10
            while victim().healthy:
                assert time.monotonic() < end, "kill not noticed"
                time.sleep(0.05)
            # Health stays SERVING with one worker left; requests go to the survivor meanwhile.
            request = engine_pb2.GenerateRequest(
                input_ids=engine_pb2.TokenIds(ids=[5, 6, 7]),
                sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
            )
            assert stream_one(stub, request, 30).done is not None
            end = time.monotonic() + 90
            while not victim().healthy:
                assert launch.popen.poll() is None, launch.log_tail()
                assert time.monotonic() < end, f"worker not back\n{launch.log_tail()}"
                time.sleep(0.2)
            after = set(_children(launch.popen.pid))
            assert victim_pid not in after and len(after) == len(before)
            assert "restarting" in launch.log_tail(20000)
            assert stream_one(stub, request, 30).done is not None
        launch.popen.send_signal(signal.SIGTERM)
        assert launch.popen.wait(timeout=60) == 0, launch.log_tail()
    finally:
        stop_procs([launch])


def test_launch_runs_a_tp2_group_and_restarts_it_whole_when_a_rank_dies(
    tiny_model: Path, tmp_path: Path
) -> None:
    base = _two_consecutive_free_ports()
    port, metrics_port = free_ports(2)
    argv = [*CLI, "launch", "--devices", "cpu,cpu", "--tensor-parallel-size", "2", "--model", str(tiny_model)]
    argv += ["--port", str(port), "--metrics-port", str(metrics_port), "--worker-base-port", str(base)]
    argv += ["--kv-cache-memory", "8MiB", "--step-timeout", "5"]
    launch = start_proc_env("launch", argv, tmp_path, {})
    address = f"127.0.0.1:{port}"
    request = engine_pb2.GenerateRequest(
        input_ids=engine_pb2.TokenIds(ids=[5, 6, 7]),
        sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )
    try:
        wait_health(address, [launch])
        with grpc.insecure_channel(address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            (backend,) = stub.ListBackends(engine_pb2.ListBackendsRequest(), timeout=5).backends
            assert backend.tensor_parallel_size == 2 and len(backend.ranks) == 2
            assert backend.worker_id == f"cpu+cpu@127.0.0.1:{base}"
            first = stream_one(stub, request, 30)
            assert first.done is not None
            ranks = sorted(_children(launch.popen.pid))
            assert len(ranks) == 2  # one group of two ranks, the engine runs in the launcher
            follower = next(
                p for p in ranks if "--tp-rank 1" in Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")
            )
            os.kill(follower, signal.SIGKILL)

            def healthy() -> bool:
                (load,) = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5).backends
                return load.healthy

            end = time.monotonic() + 20
            while healthy():  # the leader leaves with its peer: the group is down
                assert time.monotonic() < end, f"kill not noticed\n{launch.log_tail()}"
                time.sleep(0.1)
            end = time.monotonic() + 120
            while not healthy():
                assert launch.popen.poll() is None, launch.log_tail()
                assert time.monotonic() < end, f"group not back\n{launch.log_tail()}"
                time.sleep(0.2)
            after = set(_children(launch.popen.pid))
            assert len(after) == 2 and not after & set(ranks), "both ranks are new processes"
            assert "restarting the group" in launch.log_tail(20000)
            again = stream_one(stub, request, 30)
            assert again.done is not None and again.tokens == first.tokens
        launch.popen.send_signal(signal.SIGTERM)
        assert launch.popen.wait(timeout=60) == 0, launch.log_tail()
    finally:
        stop_procs([launch])
