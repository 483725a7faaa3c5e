"""``serve --front-procs 2`` as processes: the fronts are the engine's children, serve the port, and never
outlive it, whether it stops on SIGTERM or is killed."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from e2e_procs import Daemon, run_server

from ominix_runtime import memory
from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(_gone(p) for p in pids):
        assert time.monotonic() < deadline, (
            f"front processes still running: {[p for p in pids if not _gone(p)]}"
        )
        time.sleep(0.1)


def _generate_once(stub: engine_pb2_grpc.EngineStub) -> None:
    request = engine_pb2.GenerateRequest(
        request_id=f"tree-{time.monotonic_ns()}",
        input_ids=engine_pb2.TokenIds(ids=[5, 6, 7]),
        sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )
    events = list(stub.Generate(request, timeout=60))
    assert events[-1].HasField("done")


def _wait_for_fronts_serving(log_path: Path, count: int, timeout: float) -> list[str]:
    """The engine log's "front serving" lines once ``count`` fronts wrote theirs: a front writes its line after it
    has told the engine its port, so the engine can serve (and this test go on) before the line is there."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in log_path.read_text().splitlines() if "front serving" in line]
        if len(lines) >= count:
            return lines
        assert time.monotonic() < deadline, (
            f"{len(lines)} of {count} fronts serving after {timeout} s: {lines}"
        )
        time.sleep(0.1)


@contextlib.contextmanager
def _serving_with_two_fronts(model_dir: Path, log_dir: Path) -> Iterator[tuple[Daemon, list[int]]]:
    """The tiny model behind ``serve --front-procs 2`` with one CPU worker, after one request went through."""
    with run_server(
        str(model_dir),
        log_dir,
        num_workers=1,
        kv_cache_memory="16MiB",
        extra_serve_args=["--front-procs", "2"],
    ) as daemon:
        fronts = _children(daemon.engine.popen.pid)
        assert len(fronts) == 2, fronts
        _wait_for_fronts_serving(daemon.engine.log_path, 2, 60)
        _generate_once(daemon.stub)
        yield daemon, fronts


def test_fronts_serve_and_stop_with_the_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    with _serving_with_two_fronts(tiny_model_dir, tmp_path) as (daemon, fronts):
        pass  # two fronts served a request (checked on the way in)
    # run_server stopped the engine with SIGTERM: its fronts went with it.
    _wait_gone(fronts, 20)
    # Each front froze its startup heap and collects young objects at the serving threshold, as the engine
    # process does: with Python's defaults its full collections held back every stream's tokens.
    serving = [line for line in daemon.engine.log_path.read_text().splitlines() if "front serving" in line]
    assert len(serving) == 2, serving
    for line in serving:
        frozen = re.search(r"frozen_objects\W+(\d+)", line)
        threshold = re.search(r"gc_threshold\W+(\d+)", line)
        assert frozen is not None and int(frozen.group(1)) > 10_000, line
        assert threshold is not None and int(threshold.group(1)) == memory.SERVING_GC_THRESHOLD[0], line


def test_fronts_exit_when_the_engine_is_killed(tiny_model_dir: Path, tmp_path: Path) -> None:
    with _serving_with_two_fronts(tiny_model_dir, tmp_path) as (daemon, fronts):
        os.kill(daemon.engine.popen.pid, signal.SIGKILL)
        daemon.engine.popen.wait(10)
        # Orphaned, each front sees its link to the engine close and exits.
        _wait_gone(fronts, 20)
