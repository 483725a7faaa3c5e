"""Real-process harness: start workers and the engine with the CLI on loopback, wait for health, tear down."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ominix_runtime.backends.grpc_worker import GrpcWorkerBackend
from ominix_runtime.bind_probe import free_ports
from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData, SamplingParams
from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc

CLI = [sys.executable, "-m", "ominix_runtime"]
STARTUP_TIMEOUT_S = 150.0
# Greedy references computed by driving a worker directly, compared with the engine's output.
REFERENCE_TOKENS = 8
REFERENCE_TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def start_proc(name: str, argv: Sequence[str], log_dir: Path) -> Proc:
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return Proc(name, popen, log_path)


def stop_procs(procs: Sequence[Proc], timeout: float = 20.0) -> dict[str, int]:
    """SIGTERM, then SIGKILL after ``timeout``; returns each exit code."""
    for p in procs:
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    codes: dict[str, int] = {}
    for p in procs:
        try:
            codes[p.name] = p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            codes[p.name] = p.popen.wait(timeout=10)
    return codes


def wait_health(address: str, procs: Sequence[Proc], timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Poll grpc.health.v1 until SERVING; fail fast (with the log) when a process exits."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            for p in procs:
                if p.popen.poll() is not None:
                    raise AssertionError(f"{p.name} exited with {p.popen.returncode}:\n{p.log_tail()}")
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in procs)
                raise AssertionError(f"{address} not serving within {timeout:.0f}s\n{logs}")
            time.sleep(0.1)


@dataclass
class Daemon:
    address: str
    metrics_url: str
    worker_addresses: list[str]
    procs: list[Proc]
    channel: grpc.Channel
    references: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    kind: str = ""
    tokenizer: Any = None

    @property
    def stub(self) -> engine_pb2_grpc.EngineStub:
        return engine_pb2_grpc.EngineStub(self.channel)

    @property
    def engine(self) -> Proc:
        return self.procs[-1]


# The tests compare with float32 references (transformers, a worker run directly); "auto" would be bfloat16 on a
# CPU with hardware bfloat16.
FLOAT32 = ("--dtype", "float32")


def start_workers(
    model: str, n: int, log_dir: Path, kv_cache_memory: str, extra_args: Sequence[str] = ()
) -> tuple[list[Proc], list[str]]:
    ports = free_ports(n)
    procs = [
        start_proc(
            f"worker{i}",
            [
                *CLI,
                "worker",
                "--model",
                model,
                "--device",
                "cpu",
                "--port",
                str(port),
                "--kv-cache-memory",
                kv_cache_memory,
                # The workers share the cores: each gets its part instead of a full torch thread pool.
                "--num-threads",
                str(max(1, (os.cpu_count() or 1) // n)),
                *FLOAT32,
                *extra_args,
            ],
            log_dir,
        )
        for i, port in enumerate(ports)
    ]
    return procs, [f"127.0.0.1:{p}" for p in ports]


@contextlib.contextmanager
def run_server(
    model: str,
    log_dir: Path,
    *,
    num_workers: int = 2,
    kv_cache_memory: str = "64MiB",
    reference_prompts: Sequence[Sequence[int]] = (),
    reference_tokens: int = 0,
    extra_serve_args: Sequence[str] = (),
    extra_worker_args: Sequence[str] = (),
) -> Iterator[Daemon]:
    """``serve`` + ``num_workers`` CPU workers. Greedy references for ``reference_prompts`` are computed by
    driving the first worker directly (before the engine connects), so they never pass through the engine."""
    procs: list[Proc] = []
    channel: grpc.Channel | None = None
    try:
        workers, addresses = start_workers(model, num_workers, log_dir, kv_cache_memory, extra_worker_args)
        procs += workers
        references: dict[tuple[int, ...], list[int]] = {}
        if reference_prompts:
            references = asyncio.run(
                worker_greedy_reference(addresses[0], reference_prompts, reference_tokens, procs)
            )
        port, metrics_port = free_ports(2)
        serve = [
            *CLI,
            "serve",
            "--model",
            model,
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--drain-timeout",
            "10",
            *extra_serve_args,
        ]
        for a in addresses:
            serve += ["--worker", a]
        procs.append(start_proc("engine", serve, log_dir))
        address = f"127.0.0.1:{port}"
        wait_health(address, procs)
        channel = grpc.insecure_channel(address)
        yield Daemon(
            address, f"http://127.0.0.1:{metrics_port}/metrics", addresses, procs, channel, references
        )
    finally:
        if channel is not None:
            channel.close()
        # Engine first (it drains), then the workers.
        stop_procs(procs[::-1])


async def worker_greedy_reference(
    address: str, prompts: Sequence[Sequence[int]], max_tokens: int, procs: Sequence[Proc]
) -> dict[tuple[int, ...], list[int]]:
    """Greedy tokens of each prompt, one request at a time, from a worker driven step by step."""
    backend = GrpcWorkerBackend(address, step_timeout=120)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not await backend.health():
            for p in procs:
                if p.popen.poll() is not None:
                    raise AssertionError(f"{p.name} exited:\n{p.log_tail()}")
            assert time.monotonic() < deadline, "worker not ready"
            await asyncio.sleep(0.1)
        cap = await backend.describe()
        block = cap.kv_block_size
        out: dict[tuple[int, ...], list[int]] = {}
        stream = await backend.open()
        step_id = 0
        finished: list[str] = []  # the worker drops these before the next step
        try:
            for n, prompt in enumerate(prompts):
                rid = f"ref-{n}"
                total = len(prompt) + max_tokens
                blocks = list(range((total + block - 1) // block))
                assert len(blocks) <= cap.kv_num_blocks
                sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                step_id += 1
                await stream.send(
                    DecodeStep(
                        step_id,
                        new_requests=[
                            NewRequestData(
                                rid, list(prompt), sampling, blocks, 0, len(prompt), effective_seed=0
                            )
                        ],
                        finished_request_ids=finished,
                    )
                )
                tokens = [(await stream.recv()).outputs[0].sampled_token_id]
                while len(tokens) < max_tokens:
                    step_id += 1
                    await stream.send(DecodeStep(step_id, running_requests=[RunningRequestData(rid, [], 1)]))
                    tokens.append((await stream.recv()).outputs[0].sampled_token_id)
                out[tuple(prompt)] = [int(t) for t in tokens]
                finished = [rid]
        finally:
            await stream.close()
        return out
    finally:
        await backend.close()


async def generate_greedy(
    address: str, prompts: list[list[int]], new_tokens: int, prefix: str
) -> list[list[int]]:
    """Stream every prompt at once through the engine (greedy, exactly ``new_tokens``, request ids
    ``prefix-i``); each stream must end with ``done``. Returns the tokens per prompt."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)

        async def one(i: int, prompt: list[int]) -> list[int]:
            request = engine_pb2.GenerateRequest(
                request_id=f"{prefix}-{i}",
                input_ids=engine_pb2.TokenIds(ids=prompt),
                sampling=common_pb2.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
            )
            events = [e async for e in stub.Generate(request, timeout=300)]
            assert events[-1].WhichOneof("event") == "done", events[-1]
            return [t for e in events if e.HasField("token") for t in e.token.token_ids]

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
