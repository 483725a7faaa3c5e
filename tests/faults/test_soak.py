"""Soak: thousands of short requests with 20% client aborts and disconnects, through the real front server.

OMINIX_SOAK_REQUESTS sets the count against the fake workers (default 2000; `make soak` runs 10000); a
smaller share goes to a real CPU worker. Afterwards: no leaked KV block, no stuck or lost request, every
stream ended exactly once, no integrity violation, and engine RSS (and a front process's, behind one) within 10%
of its post-warm-up size.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from fault_procs import Engine, metric_value, rss_bytes, start_engine, start_fake_engine
from soak_client import SoakTally, run_soak

from ominix_runtime.pb import engine_pb2

NUM_REQUESTS = int(os.environ.get("OMINIX_SOAK_REQUESTS", "2000"))
CONCURRENCY = 64
WARMUP_SHARE = 0.2
MAX_RSS_GROWTH = 0.10
REAL_WORKER_REQUESTS = max(100, NUM_REQUESTS // 20)
FAULT_INTERVAL_S = 0.6


def _settled(engine: Engine, timeout: float = 10.0) -> engine_pb2.GetStatsResponse:
    """Wait until nothing is live, then return the engine's counters."""
    end = time.monotonic() + timeout
    while True:
        total = engine.load().total
        if total.running_requests == total.queued_requests == total.kv_bytes_used == 0:
            return engine.stub.GetStats(engine_pb2.GetStatsRequest(), timeout=5)
        assert time.monotonic() < end, f"engine not idle: {total}\n{engine.logs()}"
        time.sleep(0.05)


def _check(
    tally: SoakTally, stats: engine_pb2.GetStatsResponse, engine: Engine, min_abort_share: float
) -> None:
    assert tally.bad == 0, tally.bad_examples
    assert tally.stuck == 0
    assert tally.rejected == 0  # the queue bound is far above the concurrency
    ended = tally.completed + tally.aborted + tally.disconnected + tally.errors
    assert ended == tally.sent
    assert tally.client_aborts >= min_abort_share * tally.sent
    # Nothing lost inside the engine: every accepted request reached a terminal state.
    assert stats.requests_accepted == tally.sent
    assert stats.requests_accepted == stats.requests_finished + stats.requests_aborted + stats.requests_failed
    assert stats.kv_blocks_used == 0
    assert metric_value(engine.metrics_url, "ominix_integrity_violations_total") == 0


def _front_pids(engine_pid: int) -> list[int]:
    """The engine process's children: its front processes (the fake workers run inside it)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except OSError:  # the process ended while being read
            continue
        if int(fields[1]) == engine_pid:
            children.append(int(stat.parent.name))
    return children


@pytest.mark.parametrize("front_procs", [0, 1], ids=["engine-front", "front-process"])
def test_soak_fake_workers_through_the_front_server(tmp_path: Path, front_procs: int) -> None:
    """Also behind a front process (``--front-procs 1``): the clients' streams cross the link, and the front
    process's RSS is held to the same bound as the engine's."""
    args = ("--workers", "2", "--step-latency", "0.015", "--front-procs", str(front_procs))
    with start_fake_engine(tmp_path, *args) as engine:
        pid = engine.engine.popen.pid
        fronts = _front_pids(pid)
        assert len(fronts) == front_procs, fronts
        watched = {"engine": pid} | {f"front {i}": front for i, front in enumerate(fronts)}
        rss: dict[str, dict[str, int]] = {name: {} for name in watched}
        warmup = int(NUM_REQUESTS * WARMUP_SHARE)

        def on_progress(done: int) -> None:
            if done == warmup:
                for name, process in watched.items():
                    rss[name]["warm"] = rss_bytes(process)

        # Faults: every FAULT_INTERVAL_S the first fake worker crashes (unless still down) and comes back
        # shortly after; its requests resume on the other one (none may be lost or fail: a survivor is there).
        stop_faults = threading.Event()

        def inject() -> None:
            while not stop_faults.wait(FAULT_INTERVAL_S):
                os.kill(pid, signal.SIGUSR1)

        injector = threading.Thread(target=inject, daemon=True)
        start = time.monotonic()
        injector.start()
        try:
            tally = asyncio.run(
                run_soak(engine.address, NUM_REQUESTS, CONCURRENCY, seed=1, on_progress=on_progress)
            )
        finally:
            stop_faults.set()
            injector.join(5)
        elapsed = time.monotonic() - start
        stats = _settled(engine)
        for name, process in watched.items():
            rss[name]["end"] = rss_bytes(process)
        _check(tally, stats, engine, min_abort_share=0.19)
        faults = engine.engine.log_tail(10**7).count("fault injected")
        assert tally.errors == 0 and faults >= 3
        assert "Traceback" not in engine.engine.log_tail(10**7)
        growth = {name: r["end"] / r["warm"] - 1 for name, r in rss.items()}
        sizes = ", ".join(
            f"{name} {r['warm'] >> 20} -> {r['end'] >> 20} MiB ({growth[name]:+.1%})"
            for name, r in rss.items()
        )
        print(
            f"\nsoak(fake, {front_procs} front procs): {tally.sent} requests in {elapsed:.1f}s, {faults} worker "
            f"crashes, {tally.client_aborts} client aborts "
            f"({tally.aborted} Abort RPC, {tally.disconnected} disconnects), {tally.errors} errors, "
            f"0 lost, {stats.kv_blocks_used} blocks leaked, RSS {sizes}"
        )
        assert all(g < MAX_RSS_GROWTH for g in growth.values()), rss


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ominix_worker.testing import write_tiny_hf_model

    return write_tiny_hf_model(tmp_path_factory.mktemp("soak-model") / "tiny", arch="llama", vocab_size=320)


def test_soak_real_cpu_worker(tiny_model: Path, tmp_path: Path) -> None:
    with start_engine(str(tiny_model), tmp_path, num_workers=1) as engine:
        tally = asyncio.run(run_soak(engine.address, REAL_WORKER_REQUESTS, 16, seed=2, prefix="real"))
        stats = _settled(engine)
        _check(tally, stats, engine, min_abort_share=0.1)
        print(
            f"\nsoak(cpu worker): {tally.sent} requests, {tally.client_aborts} client aborts, 0 lost, 0 leaked"
        )
