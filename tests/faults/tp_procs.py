"""Real processes for tensor-parallel tests: one group's rank processes (and optionally a TP=1 worker) behind
a `serve` engine, streaming clients, and killing a rank mid-stream. Shared by the CPU (gloo) and GPU (NCCL) tests.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from fault_procs import (
    CLI,
    Engine,
    Outcome,
    Proc,
    free_ports,
    start_proc_env,
    stop_procs,
    stream_one,
    wait_health,
)

from ominix_runtime.pb import common_pb2, engine_pb2

STEP_TIMEOUT_S = 3.0
DIST_TIMEOUT_S = 5.0
GROUP_FAILURE_EXIT_CODE = 3  # ominix_worker.rank_group: a rank that leaves its group
ROOT = Path(__file__).resolve().parents[2]
# Every process started here: NVLink SHARP off (its buffers fail on some machines); one CPU thread per rank;
# both packages importable from a bare checkout (GPU machines run the tests without installing).
ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), str(ROOT / "workers"), os.environ.get("PYTHONPATH")) if p
    ),
}


def request(
    rid: str, ids: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0
) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=rid,
        input_ids=engine_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True
        ),
        deadline_ms=120_000,
    )


def seeded(i: int, max_tokens: int = 150) -> engine_pb2.GenerateRequest:
    ids = [3 + (i * 11 + k) % 250 for k in range(12 + i % 5)]
    return request(f"s{i}", ids, max_tokens, temperature=0.8, seed=500 + i)


def worker_argv(model: str, device: str, port: int, extra: Sequence[str]) -> list[str]:
    argv = [*CLI, "worker", "--model", model, "--device", device, "--port", str(port)]
    if device == "cpu":  # float32, as the TP=1 references; "auto" is bfloat16 on a CPU with hardware bfloat16
        argv += ["--num-threads", "1", "--dtype", "float32"]
    return [*argv, *extra]


@contextlib.contextmanager
def start_tp_engine(
    model: str,
    log_dir: Path,
    *,
    devices: Sequence[str] = ("cpu", "cpu"),
    worker_args: Sequence[str] = ("--kv-cache-memory", "8MiB"),
    single_device: str | None = None,
) -> Iterator[tuple[Engine, list[Proc]]]:
    """One group with a rank per device (rank 0 at worker_addresses[0]), a TP=1 worker on ``single_device``
    when given, and the engine. Yields the engine and the group's rank processes in rank order."""
    size = len(devices)
    leader_port, single_port, port, metrics_port, dist_port = free_ports(5)
    group = ["--tp-size", str(size), "--dist-init-addr", f"127.0.0.1:{dist_port}"]
    group += ["--dist-timeout", str(DIST_TIMEOUT_S), *worker_args]
    ranks: list[Proc] = []
    others: list[Proc] = []
    try:
        for rank in reversed(range(size)):  # the followers first: they wait for their leader
            argv = worker_argv(model, devices[rank], leader_port, [*group, "--tp-rank", str(rank)])
            ranks.insert(0, start_proc_env(f"rank{rank}", argv, log_dir, ENV))
        addresses = [f"127.0.0.1:{leader_port}"]
        if single_device is not None:
            argv = worker_argv(model, single_device, single_port, worker_args)
            others.append(start_proc_env("single", argv, log_dir, ENV))
            addresses.append(f"127.0.0.1:{single_port}")
        serve = [*CLI, "serve", "--model", model, "--port", str(port), "--metrics-port", str(metrics_port)]
        serve += ["--worker-ready-timeout", "600", "--step-timeout", str(STEP_TIMEOUT_S)]
        for a in addresses:
            serve += ["--worker", a]
        others.append(start_proc_env("engine", serve, log_dir, ENV))
        address = f"127.0.0.1:{port}"
        wait_health(address, [*ranks, *others], timeout=600)
        with grpc.insecure_channel(address) as channel:
            procs = [*ranks, *others]
            yield (
                Engine(address, procs, addresses, channel, f"http://127.0.0.1:{metrics_port}/metrics"),
                ranks,
            )
    finally:
        stop_procs([*others[::-1], *ranks])


def kill_a_rank_mid_stream(
    engine: Engine,
    ranks: list[Proc],
    victim: int,
    requests: Sequence[engine_pb2.GenerateRequest],
    sig: signal.Signals = signal.SIGKILL,
) -> tuple[list[Outcome], float]:
    """Stream ``requests``; once each has a token, send ``sig`` to rank ``victim`` (SIGKILL: it dies, SIGSTOP: it
    hangs). Returns how each request ended and the seconds from the signal to the last end. Checks that every
    other rank leaves the group too."""
    outcomes = [Outcome(r.request_id) for r in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [
            pool.submit(stream_one, engine.stub, r, 180, o) for r, o in zip(requests, outcomes, strict=True)
        ]
        for out in outcomes:
            assert out.first_token.wait(120), engine.logs()
        killed_at = time.monotonic()
        os.kill(ranks[victim].popen.pid, sig)
        results = [f.result() for f in futures]
    seconds = time.monotonic() - killed_at
    for rank, proc in enumerate(ranks):
        if rank != victim:  # no half-alive group: the others notice their peer is gone and leave
            code = proc.popen.wait(timeout=DIST_TIMEOUT_S + 15)
            assert code == GROUP_FAILURE_EXIT_CODE, f"rank {rank} exited with {code}\n{proc.log_tail()}"
    return results, seconds
