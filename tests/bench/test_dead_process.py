"""The bench scripts stop waiting as soon as a process they started has died, and show its last log lines.

Every case starts a real process that dies at start (or while the benchmark runs) and bounds how long the
wait took: far below the readiness timeout it would otherwise have spent.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import bench.common as common  # noqa: E402
from bench.common import (  # noqa: E402
    LaunchedService,
    ServiceDied,
    ServiceNotReady,
    WatchedProcess,
    free_port,
    launch_service,
    run_while_alive,
    wait_until_ready,
)

REPO = Path(__file__).resolve().parents[2]
DIES_AT_START = "import sys; print('ImportError: grpcio 1.0 is too old'); sys.exit(3)"
BOUND_S = 30.0  # a quiet 2-core box needs a second or two; the readiness timeouts below are 600 s


def test_launch_service_stops_waiting_when_the_service_dies_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "service_command", lambda: [sys.executable, "-c", DIES_AT_START])
    started = time.monotonic()
    with pytest.raises(ServiceDied) as failure, launch_service(ready_timeout_s=600.0, show_progress=False):
        pytest.fail("the service cannot be SERVING")
    assert time.monotonic() - started < BOUND_S
    assert "exited with code 3" in str(failure.value)
    assert "grpcio 1.0 is too old" in str(failure.value)


def test_a_process_known_by_pid_is_dead_once_it_exits_even_as_a_zombie(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    with log.open("wb") as out:
        child = subprocess.Popen([sys.executable, "-c", DIES_AT_START], stdout=out, stderr=subprocess.STDOUT)
    try:
        watched = WatchedProcess("child", log, pid=child.pid)  # not reaped: it stays a zombie meanwhile
        deadline = time.monotonic() + BOUND_S
        while watched.exit_status() is None:
            assert time.monotonic() < deadline, "a dead child was still seen as running"
            time.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(ServiceDied, match="too old"):
            wait_until_ready(lambda: "UNREACHABLE", [watched], timeout_s=600.0, what="child")
        assert time.monotonic() - started < BOUND_S
    finally:
        child.wait(timeout=10)


def test_a_live_process_is_waited_for_until_the_timeout(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watched = WatchedProcess("sleeper", tmp_path / "none.log", process=sleeper)
        with pytest.raises(ServiceNotReady, match="not SERVING after"):
            wait_until_ready(lambda: "NOT_SERVING", [watched], timeout_s=0.5, what="sleeper", poll_s=0.1)
        probes = iter(["UNREACHABLE", "SERVING"])
        assert (
            wait_until_ready(lambda: next(probes), [watched], timeout_s=60.0, what="sleeper", poll_s=0.01)
            >= 0
        )
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)


def test_wait_serving_command_fails_at_once_for_a_shell_started_process(tmp_path: Path) -> None:
    """What bench/gpu_service.sh does: background a process from bash, then wait for health while it lives."""
    log = tmp_path / "worker.log"
    port = free_port()  # nothing listens: health is UNREACHABLE until the wait gives up
    script = (
        f'{sys.executable} -c "{DIES_AT_START}" >{log} 2>&1 & wpid=$!; '
        f"{sys.executable} bench/common.py wait-serving 127.0.0.1:{port} --timeout 600 --watch worker:$wpid:{log}"
    )
    started = time.monotonic()
    done = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < BOUND_S
    assert done.returncode == 1
    assert "worker exited" in done.stderr and "grpcio 1.0 is too old" in done.stderr


def test_run_while_alive_stops_the_benchmark_when_the_service_dies(tmp_path: Path) -> None:
    log = tmp_path / "service.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import time; print('serving'); time.sleep(1); raise SystemExit('worker lost')",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    service = LaunchedService("127.0.0.1:1", 0, process, log)
    started = time.monotonic()
    with pytest.raises(ServiceDied, match="worker lost"):
        run_while_alive(asyncio.sleep(600), service, poll_s=0.1)
    assert time.monotonic() - started < BOUND_S
    process.wait(timeout=10)


def test_gpu_service_script_stops_when_its_processes_die_at_start(tmp_path: Path) -> None:
    """The whole service stage with a model that cannot load: both processes die at start."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "OUT": str(tmp_path),
        "STAGES": "service",
        "DEVICE": "cpu",
        "MODEL": "dummy:/nonexistent/config.json",
        "SERVICE_S": "60",
        "NO_WHEELS": "1",
    }
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "bench/gpu_service.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    elapsed = time.monotonic() - started
    assert elapsed < 120, f"the stage waited {elapsed:.0f} s on dead processes"
    assert "service never SERVING" in done.stdout
    assert "exited; last lines of" in done.stdout + done.stderr
    assert "/nonexistent/config.json" in done.stdout + done.stderr
