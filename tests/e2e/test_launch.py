"""``ominix-runtime launch --devices cpu,cpu``: two workers and the engine from one command, clean stop."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from pathlib import Path

import grpc
from e2e_procs import CLI, free_ports, start_proc, stop_procs, wait_health

from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc


def _two_consecutive_free_ports() -> int:
    for _ in range(50):
        base = free_ports(1)[0]
        if base >= 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise AssertionError("no two consecutive free ports")


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


async def _try_open_run(address: str) -> str:
    from ominix_runtime.backends.grpc_worker import GrpcWorkerBackend
    from ominix_runtime.contract import OminixError

    backend = GrpcWorkerBackend(address, rpc_timeout=5)
    try:
        stream = await backend.open()
        await stream.close()
        return "opened"
    except OminixError as exc:
        return exc.message
    finally:
        await backend.close()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_launch_two_cpu_workers_and_stop_cleanly(tiny_model_dir: Path, tmp_path: Path) -> None:
    port, metrics_port = free_ports(2)
    base = _two_consecutive_free_ports()
    launch = start_proc(
        "launch",
        [
            *CLI,
            "launch",
            "--devices",
            "cpu,cpu",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--worker-base-port",
            str(base),
            "--kv-cache-memory",
            "16MiB",
            "--drain-timeout",
            "60",
        ],
        tmp_path,
    )
    try:
        address = f"127.0.0.1:{port}"
        wait_health(address, [launch])
        workers = _children(launch.popen.pid)
        assert len(workers) == 2, workers
        with grpc.insecure_channel(address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            backends = stub.ListBackends(engine_pb2.ListBackendsRequest(), timeout=10).backends
            assert sorted(b.worker_id for b in backends) == [
                f"cpu@127.0.0.1:{base}",
                f"cpu@127.0.0.1:{base + 1}",
            ]
            events = list(
                stub.Generate(
                    engine_pb2.GenerateRequest(
                        prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0)
                    ),
                    timeout=60,
                )
            )
            assert events[-1].done.finish_reason == common_pb2.FINISH_REASON_LENGTH
            # Only this launch's engine may drive its workers (a fresh secret): another local process
            # cannot open Run, and the engine stays healthy.
            stranger = asyncio.run(_try_open_run(f"127.0.0.1:{base}"))
            assert "PERMISSION_DENIED" in stranger, stranger
            assert stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10).total.healthy
            # SIGTERM while a request streams: it is drained to its normal end, then everything exits.
            sampling = common_pb2.SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
            stream = stub.Generate(
                engine_pb2.GenerateRequest(prompt="drain me", sampling=sampling), timeout=120
            )
            first = next(stream)
            assert first.HasField("prefill_done")
            launch.popen.send_signal(signal.SIGTERM)
            rest = list(stream)
        assert rest[-1].HasField("done"), rest[-1]
        assert rest[-1].done.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert sum(len(e.token.token_ids) for e in rest if e.HasField("token")) == 60
        assert launch.popen.wait(timeout=120) == 0, launch.log_tail()
        assert not any(_alive(pid) for pid in workers), "worker processes outlived launch"
        for worker_port in (base, base + 1):
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", worker_port)) != 0
    finally:
        stop_procs([launch])


def test_ctrl_c_twice_ends_every_stream_with_a_terminal_event(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two SIGINTs to launch while requests stream: each stream still ends with one terminal event (an error,
    not CANCELLED), launch exits, its workers are gone, and nothing prints a traceback."""
    port, metrics_port = free_ports(2)
    launch = start_proc(
        "launch",
        [
            *CLI,
            "launch",
            "--devices",
            "cpu",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--worker-base-port",
            str(free_ports(1)[0]),
            "--kv-cache-memory",
            "16MiB",
            "--drain-timeout",
            "60",
        ],
        tmp_path,
    )
    try:
        wait_health(f"127.0.0.1:{port}", [launch])
        workers = _children(launch.popen.pid)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            sampling = common_pb2.SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
            streams = [
                stub.Generate(
                    engine_pb2.GenerateRequest(prompt=f"stream {i}", sampling=sampling), timeout=120
                )
                for i in range(3)
            ]
            for s in streams:
                assert next(s).HasField("prefill_done")
            launch.popen.send_signal(signal.SIGINT)
            time.sleep(0.5)
            launch.popen.send_signal(signal.SIGINT)
            endings = []
            for s in streams:
                events = list(s)  # a CANCELLED stream would raise here
                endings.append(
                    [e.WhichOneof("event") for e in events if e.WhichOneof("event") in ("done", "error")]
                )
        assert endings == [["error"]] * 3, endings
        assert launch.popen.wait(timeout=60) == 0, launch.log_tail()
        assert not any(_alive(pid) for pid in workers)
        assert "Traceback" not in launch.log_path.read_text(errors="replace"), launch.log_tail()
    finally:
        stop_procs([launch])
