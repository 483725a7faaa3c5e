"""Real processes for fault tests: CPU workers on a tiny random model and a `serve` engine, all on loopback.

Builds on the e2e harness (tests/e2e/e2e_procs.py) for process start/stop and health polling; adds engine
environment (step timeout), per-worker load queries and a streaming client that records how each request ended.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))

from e2e_procs import CLI, Proc, free_ports, stop_procs, wait_health  # noqa: E402

from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc  # noqa: E402

__all__ = [
    "CLI",
    "Engine",
    "Outcome",
    "Proc",
    "free_ports",
    "metric_value",
    "rss_bytes",
    "start_engine",
    "start_fake_engine",
    "start_proc_env",
    "stop_procs",
    "stream_one",
    "wait_health",
    "wait_health_tls",
    "worker_argv",
]


def start_proc_env(name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str]) -> Proc:
    import subprocess

    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        )
    return Proc(name, popen, log_path)


def worker_argv(model: str, port: int, num_threads: int = 1, extra: Sequence[str] = ()) -> list[str]:
    return [
        *CLI,
        "worker",
        "--model",
        model,
        "--device",
        "cpu",
        "--port",
        str(port),
        "--kv-cache-memory",
        "8MiB",
        "--num-threads",
        str(num_threads),
        "--dtype",  # float32 references; "auto" is bfloat16 on a CPU with hardware bfloat16
        "float32",
        *extra,
    ]


def wait_health_tls(
    address: str, credentials: grpc.ChannelCredentials, procs: Sequence[Proc], timeout: float = 120.0
) -> None:
    """wait_health over a TLS channel."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.secure_channel(address, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            for p in procs:
                assert p.popen.poll() is None, f"{p.name} exited with {p.popen.returncode}:\n{p.log_tail()}"
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, "\n".join(p.log_tail() for p in procs)
            time.sleep(0.1)


@dataclass
class Engine:
    address: str
    procs: list[Proc]  # workers first, the engine last
    worker_addresses: list[str]
    channel: grpc.Channel
    metrics_url: str = ""

    @property
    def stub(self) -> engine_pb2_grpc.EngineStub:
        return engine_pb2_grpc.EngineStub(self.channel)

    @property
    def engine(self) -> Proc:
        return self.procs[-1]

    @property
    def workers(self) -> list[Proc]:
        return self.procs[:-1]

    def load(self) -> engine_pb2.GetLoadResponse:
        return self.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail(6000)}" for p in self.procs)


@contextlib.contextmanager
def start_engine(
    model: str,
    log_dir: Path,
    *,
    num_workers: int = 2,
    engine_env: dict[str, str] | None = None,
    serve_args: Sequence[str] = (),
    worker_args: Sequence[str] = (),
) -> Iterator[Engine]:
    procs: list[Proc] = []
    channel: grpc.Channel | None = None
    try:
        ports = free_ports(num_workers + 2)
        worker_ports, (port, metrics_port) = ports[:num_workers], ports[num_workers:]
        for i, wp in enumerate(worker_ports):
            procs.append(start_proc_env(f"worker{i}", worker_argv(model, wp, extra=worker_args), log_dir, {}))
        addresses = [f"127.0.0.1:{p}" for p in worker_ports]
        serve = [*CLI, "serve", "--model", model, "--port", str(port), "--metrics-port", str(metrics_port)]
        serve += [*serve_args]
        for a in addresses:
            serve += ["--worker", a]
        procs.append(start_proc_env("engine", serve, log_dir, engine_env or {}))
        address = f"127.0.0.1:{port}"
        wait_health(address, procs)
        channel = grpc.insecure_channel(address)
        yield Engine(address, procs, addresses, channel, f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        if channel is not None:
            channel.close()
        stop_procs(procs[::-1])


FAKE_ENGINE = Path(__file__).resolve().parent / "fake_engine.py"


@contextlib.contextmanager
def start_fake_engine(log_dir: Path, *args: str) -> Iterator[Engine]:
    """The real front server and engine over fake workers, in a process of its own (see fake_engine.py)."""
    port, metrics_port = free_ports(2)
    argv = [sys.executable, str(FAKE_ENGINE), "--port", str(port), "--metrics-port", str(metrics_port), *args]
    proc = start_proc_env("engine", argv, log_dir, {})
    channel: grpc.Channel | None = None
    try:
        address = f"127.0.0.1:{port}"
        wait_health(address, [proc], timeout=60)
        channel = grpc.insecure_channel(address)
        yield Engine(address, [proc], [], channel, f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        if channel is not None:
            channel.close()
        stop_procs([proc])


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def metric_value(metrics_url: str, name: str) -> float:
    """Sum of every sample of ``name`` on a Prometheus text page (0 when absent)."""
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Outcome:
    """How one streamed request ended, as the client saw it."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    done: engine_pb2.Done | None = None
    error: common_pb2.ErrorInfo | None = None
    status: grpc.StatusCode | None = None  # the RPC itself failed
    num_terminal: int = 0
    seconds: float = 0.0
    first_token: threading.Event = field(default_factory=threading.Event)


def stream_one(
    stub: engine_pb2_grpc.EngineStub,
    request: engine_pb2.GenerateRequest,
    timeout: float,
    out: Outcome | None = None,
) -> Outcome:
    """Stream ``request`` to its end, recording into ``out`` (pass one to watch progress from another thread)."""
    out = out or Outcome(request.request_id)
    start = time.monotonic()
    try:
        for ev in stub.Generate(request, timeout=timeout):
            kind = ev.WhichOneof("event")
            if kind == "token":
                out.tokens += list(ev.token.token_ids)
                out.first_token.set()
            elif kind == "done":
                out.done = ev.done
                out.num_terminal += 1
            elif kind == "error":
                out.error = ev.error
                out.num_terminal += 1
    except grpc.RpcError as exc:
        out.status = exc.code()  # type: ignore[attr-defined]  # a failed call raises an RpcError that is a grpc.Call
    out.seconds = time.monotonic() - start
    return out
