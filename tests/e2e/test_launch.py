"""``ominix-runtime launch``: two CPU workers and the engine from one command, clean stop; every startup
failure found before anything loads, in one line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import grpc.aio
import pytest
from e2e_procs import CLI, free_ports, start_proc, stop_procs, wait_health

from ominix_runtime.cli.commands import command
from ominix_runtime.cli.launcher import LaunchError, WorkerPlan, plan_workers, wait_workers_ready
from ominix_runtime.cli.settings import resolve
from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc, worker_pb2, worker_pb2_grpc


def _two_consecutive_free_ports() -> int:
    return free_ports(2, consecutive=True)[0]


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
            "--stats-interval",
            "0.5",
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
        # One log stream: every line from the launcher, its workers and the engine is a JSON object with the
        # same keys (stderr is not a terminal), and the stats line reported the streaming request.
        lines = [json.loads(line) for line in launch.log_path.read_text().splitlines() if line.strip()]
        odd = [line for line in lines if not {"event", "level", "timestamp", "component"} <= set(line)]
        assert not odd, odd[:5]
        assert {line["component"] for line in lines} == {"launcher", "worker", "engine"}
        assert {line["worker_id"] for line in lines if line["component"] == "worker"} == {
            f"cpu@127.0.0.1:{base}",
            f"cpu@127.0.0.1:{base + 1}",
        }
        stats = [line for line in lines if line["event"] == "stats"]
        assert any(line["generation_tokens_per_s"] > 0 for line in stats), stats
        assert all({"running", "waiting", "kv_usage", "prompt_tokens_per_s"} <= set(line) for line in stats)
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


# ---- startup failures: found before anything loads, one line, exit 1 ------------------------------------


def _hold_port_in_another_process() -> tuple[subprocess.Popen[str], int]:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    return holder, int(holder.stdout.readline())


_HOLDER = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
    "print(s.getsockname()[1], flush=True); time.sleep(120)\n"
)


def _launch(argv: list[str], timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run([*CLI, "launch", *argv], capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - started


@pytest.mark.parametrize("flag", ["--worker-base-port", "--port", "--metrics-port"])
def test_launch_against_a_port_held_by_another_process_fails_at_once(tiny_model_dir: Path, flag: str) -> None:
    """Finding 4: with a foreign process on a worker port, launch reported it ready and flapped forever; a
    taken engine or metrics port surfaced only after the workers had loaded, as a traceback."""
    holder, taken = _hold_port_in_another_process()
    try:
        port, metrics_port, base = free_ports(3)
        ports = {"--port": port, "--metrics-port": metrics_port, "--worker-base-port": base, flag: taken}
        argv = ["--model", str(tiny_model_dir), "--kv-cache-memory", "16MiB"]
        argv += [word for name, value in ports.items() for word in (name, str(value))]
        done, elapsed = _launch(argv)
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"port {taken}" in lines[0] and flag in lines[0], lines[0]
    assert elapsed < 5.0, f"took {elapsed:.1f}s"


def test_launch_with_a_missing_model_fails_in_one_line(tmp_path: Path) -> None:
    done, elapsed = _launch(["--model", str(tmp_path / "nowhere"), "--worker-base-port", "0"])
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "--model" in lines[0] and "not found" in lines[0]
    assert elapsed < 5.0


def test_launch_with_an_unloadable_model_ends_with_the_workers_reason(tmp_path: Path) -> None:
    """A worker that cannot start is a launch failure (not a restart loop), reported once with its reason."""
    unsupported = tmp_path / "gpt2"
    unsupported.mkdir()
    (unsupported / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    port, metrics_port = free_ports(2)
    argv = ["--model", str(unsupported), "--worker-base-port", "0", "--port", str(port)]
    done, _ = _launch([*argv, "--metrics-port", str(metrics_port)], timeout=120)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("ominix-runtime launch: error: worker 127.0.0.1:") and "before it was ready" in last
    )
    assert "unsupported model_type 'gpt2'" in last
    assert done.stderr.count("unsupported model_type") == 1, done.stderr


class _ForeignWorker(worker_pb2_grpc.WorkerServicer):
    async def Health(
        self, request: worker_pb2.HealthRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.HealthResponse:
        return worker_pb2.HealthResponse(ready=True, launch_nonce="someone-else", pid=os.getpid())


def test_launch_never_takes_a_foreign_worker_for_its_own() -> None:
    """The worker answering on the port must state this launch's nonce; any other answer ends the launch."""

    async def scenario() -> str:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(_ForeignWorker(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        plan = WorkerPlan(("cpu",), port, f"127.0.0.1:{port}", ((),))
        try:
            with pytest.raises(LaunchError) as info:
                await asyncio.to_thread(wait_workers_ready, [[own]], [plan], "our-nonce", 10.0)
            return str(info.value)
        finally:
            own.kill()
            own.wait()
            await server.stop(0)

    message = asyncio.run(scenario())
    assert f"worker port {port_of(message)}" in message and f"pid {os.getpid()}" in message
    assert "--worker-base-port" in message


def port_of(message: str) -> str:
    return message.split("worker port ", 1)[1].split(":", 1)[0]


def test_launch_keeps_workers_on_loopback_when_the_engine_moves() -> None:
    config, _ = resolve(command("launch"), ["--host", "0.0.0.0", "--devices", "cpu,cpu"], env={})
    assert config.server.metrics_host == "127.0.0.1"
    for plan in plan_workers(config, [41000, 41001], "n"):
        worker, _ = resolve(command("worker"), list(plan.argvs[0][4:]), env={})
        assert worker.server.host == "127.0.0.1" and plan.address.startswith("127.0.0.1:")
