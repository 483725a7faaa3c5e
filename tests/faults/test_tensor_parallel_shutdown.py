"""A tensor-parallel group stops within bounded time on SIGTERM (gloo, CPU): `launch` ends every process of a
TP=2 group that is streaming without having to kill any, and a leader whose loading thread waits in a
collective (here: for a rank that never joins, with a long --dist-timeout) exits at once instead of waiting
the timeout out."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from fault_procs import CLI, free_ports, start_proc_env, stop_procs, stream_one, wait_health

from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))
from test_launch import _children, _two_consecutive_free_ports  # noqa: E402

# The worker's own deadline is 5 s (ominix_worker.server.SHUTDOWN_DEADLINE_S) and launch kills what is left
# after 15 s; a group that stops by itself is gone well before either.
STOP_BOUND_S = 12.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ominix_worker.testing import write_tiny_hf_model

    return write_tiny_hf_model(tmp_path_factory.mktemp("tp-stop") / "tiny", arch="llama", vocab_size=320)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_sigterm_to_launch_ends_a_streaming_tp2_group_without_killing_it(
    tiny_model: Path, tmp_path: Path
) -> None:
    base = _two_consecutive_free_ports()
    port, metrics_port = free_ports(2)
    argv = [*CLI, "launch", "--devices", "cpu,cpu", "--tensor-parallel-size", "2", "--model", str(tiny_model)]
    argv += ["--port", str(port), "--metrics-port", str(metrics_port), "--worker-base-port", str(base)]
    argv += ["--kv-cache-memory", "8MiB", "--drain-timeout", "1"]
    launch = start_proc_env("launch", argv, tmp_path, {})
    try:
        wait_health(f"127.0.0.1:{port}", [launch])
        ranks = _children(launch.popen.pid)
        assert len(ranks) == 2
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            request = engine_pb2.GenerateRequest(
                input_ids=engine_pb2.TokenIds(ids=[5, 6, 7]),
                sampling=common_pb2.SamplingParams(max_tokens=900, ignore_eos=True),
            )
            first = threading.Event()
            stream = threading.Thread(target=lambda: stream_one(stub, request, 120), daemon=True)
            stream.start()
            # steps are running on both ranks when the signal comes
            end = time.monotonic() + 60
            while not first.is_set():
                (load,) = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5).backends
                if load.running_requests:
                    first.set()
                assert time.monotonic() < end, launch.log_tail()
                time.sleep(0.05)
            time.sleep(1.0)
            signalled = time.monotonic()
            launch.popen.send_signal(signal.SIGTERM)
            code = launch.popen.wait(timeout=60)
            took = time.monotonic() - signalled
        assert code == 0, launch.log_tail()
        assert took < STOP_BOUND_S, f"launch took {took:.1f}s to stop\n{launch.log_tail()}"
        assert not any(_alive(pid) for pid in ranks)
        log = launch.log_tail(200_000)
        assert "did not stop after SIGTERM" not in log, log
        stopped = [json.loads(line) for line in log.splitlines() if '"processes stopped"' in line]
        assert stopped, log
        codes = {int(pid): c for pid, c in stopped[-1]["exit_codes"].items()}
        assert set(codes) == set(ranks)
        # the leader leaves with 0; a follower ends on the signal itself (or, had the leader gone first,
        # with the group-failure code 3): none was killed
        assert all(c in (0, -signal.SIGTERM, 3) for c in codes.values()), codes
    finally:
        stop_procs([launch])


def test_a_leader_waiting_for_its_group_stops_at_once_on_sigterm(tiny_model: Path, tmp_path: Path) -> None:
    """Rank 0 alone: its loading thread waits for rank 1 to join (up to --dist-timeout 120 s). SIGTERM ends
    it within the worker's shutdown deadline, exit code 0."""
    port, rendezvous = free_ports(2)
    argv = [*CLI, "worker", "--model", str(tiny_model), "--device", "cpu", "--port", str(port)]
    argv += ["--tp-size", "2", "--tp-rank", "0", "--dist-init-addr", f"127.0.0.1:{rendezvous}"]
    argv += ["--dist-timeout", "120", "--kv-cache-memory", "8MiB", "--num-threads", "1"]
    leader = start_proc_env("leader", argv, tmp_path, {})
    try:
        end = time.monotonic() + 120
        while "joining tensor-parallel group" not in leader.log_tail():
            assert leader.popen.poll() is None, leader.log_tail()
            assert time.monotonic() < end, leader.log_tail()
            time.sleep(0.1)
        time.sleep(0.5)  # inside the rendezvous
        signalled = time.monotonic()
        leader.popen.send_signal(signal.SIGTERM)
        try:
            code = leader.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the leader still waits for its group 30 s after SIGTERM\n{leader.log_tail()}")
        assert code == 0, leader.log_tail()
        assert time.monotonic() - signalled < 8.0
    finally:
        stop_procs([leader])
