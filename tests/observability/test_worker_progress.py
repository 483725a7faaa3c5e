"""Worker startup progress: JSON events when stderr is not a terminal, tqdm bars on a terminal."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from e2e_procs import free_ports
from obs_daemon import Scraped

from ominix_worker import progress
from ominix_worker.progress import Progress, stage, track

STAGES = ("loading weights", "profiling the KV cache", "warming up")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _events(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith('{"event": "progress"')]


def test_json_events_off_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(progress, "JSON_UPDATE_INTERVAL_S", 0.0)
    with Progress("loading weights", total=3, unit="tensor", stream=out) as p:
        for _ in range(3):
            p.update()
    events = _events(out.getvalue())
    assert [e["status"] for e in events] == ["start", "update", "update", "update", "done"]
    assert events[-1]["done"] == events[-1]["total"] == 3 and events[-1]["elapsed_s"] >= 0
    assert all(e["stage"] == "loading weights" for e in events)


def test_json_updates_are_throttled() -> None:
    out = io.StringIO()
    with Progress("loading weights", total=1000, stream=out) as p:
        for _ in range(1000):
            p.update()
    assert [e["status"] for e in _events(out.getvalue())] == ["start", "done"]


def test_a_terminal_gets_a_bar_and_no_json() -> None:
    out = _Terminal()
    with Progress("loading weights", total=4, unit="tensor", stream=out) as p:
        p.update(4)
    text = out.getvalue()
    assert "loading weights" in text and "/4 " in text and "tensor" in text
    assert not _events(text)


def test_track_and_stage_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert list(track(iter(range(5)), 5, "dequantizing weights")) == [0, 1, 2, 3, 4]
    with stage("warming up"):
        pass
    events = _events(capsys.readouterr().err)
    assert [(e["stage"], e["status"]) for e in events] == [
        ("dequantizing weights", "start"),
        ("dequantizing weights", "done"),
        ("warming up", "start"),
        ("warming up", "done"),
    ]
    assert events[1]["done"] == 5 and "total" not in events[3]


def test_a_worker_process_reports_each_startup_stage(served: Scraped) -> None:
    worker = next(p for p in served.daemon.procs if p.name.startswith("worker"))
    events = _events(worker.log_path.read_text())
    for name in STAGES:
        statuses = [e["status"] for e in events if e["stage"] == name]
        assert statuses[0] == "start" and statuses[-1] == "done", (name, events)
    loading = [e for e in events if e["stage"] == "loading weights" and e["status"] == "done"]
    assert loading[0]["done"] == loading[0]["total"] > 0


def test_a_worker_on_a_terminal_draws_bars(tmp_path: Path) -> None:
    from ominix_worker.testing import write_tiny_hf_model

    model = write_tiny_hf_model(tmp_path / "tiny", arch="llama", vocab_size=320)
    (port,) = free_ports(1)
    controller, terminal = pty.openpty()
    # A terminal of 120 columns (a fresh pty has 0, and tqdm draws a bar as wide as the terminal).
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    worker = subprocess.Popen(
        [sys.executable, "-m", "ominix_runtime", "worker", "--model", str(model), "--device", "cpu"]
        + ["--port", str(port), "--kv-cache-memory", "8MiB", "--num-threads", "1"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=terminal,
    )
    os.close(terminal)
    seen = b""
    try:
        deadline = time.monotonic() + 120
        while b"serving" not in seen:
            assert time.monotonic() < deadline and worker.poll() is None, seen.decode(errors="replace")
            ready, _, _ = select.select([controller], [], [], 1.0)
            if ready:
                try:
                    seen += os.read(controller, 65536)
                except OSError:
                    break
    finally:
        worker.terminate()
        worker.wait(30)
        os.close(controller)
    text = seen.decode(errors="replace")
    assert "loading weights" in text and "tensor" in text and "warming up" in text
    assert not _events(text)
