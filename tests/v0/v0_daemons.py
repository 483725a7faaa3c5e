"""Real daemons for the ominix.worker.v0 tests (``serve`` over a fake SGLang process) and their constants.
Process helpers come from tests/e2e. A module of its own name: test modules import from it."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from e2e_procs import CLI, Proc, free_ports, start_proc, stop_procs, wait_health  # noqa: E402

from ominix_runtime.models import DEFAULT_MODEL_NAME  # noqa: E402

TOKEN = "v0-test-token"
SERVED_ALIAS = "C2Rust-FP8-DFlash"  # what OminiX-API would configure as OMINIX_V0_SERVED_MODEL
SMOLLM2_VOCAB = 49152
FAKE_KV_TOKENS = 40_000  # less than the context: a request can need more KV than there is
FAKE_CONTEXT = 65_536
FAKE_TOKEN_DELAY_S = 0.05


@dataclass
class V0Daemon:
    base_url: str
    grpc_address: str
    procs: list[Proc]
    sglang_url: str = ""


def _wait_line(proc: Proc, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.log_tail(20000):
        assert proc.popen.poll() is None and time.monotonic() < deadline, proc.log_tail()
        time.sleep(0.05)


def sglang_v0_daemon_procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[V0Daemon]:
    """``serve --model SmolLM2 --sglang URL --v0-port``: the tokenizer is local, generation is SGLang's."""
    logs = tmp_path_factory.mktemp("logs-v0")
    sglang_port, port, v0_port = free_ports(3)
    procs: list[Proc] = []
    try:
        fake = [
            sys.executable,
            "-m",
            "ominix_runtime.testing.fake_sglang",
            "--port",
            str(sglang_port),
            "--mode",
            "slow",
            "--token-delay",
            str(FAKE_TOKEN_DELAY_S),
            "--model-path",
            DEFAULT_MODEL_NAME,
            "--vocab",
            str(SMOLLM2_VOCAB),
            "--max-total-num-tokens",
            str(FAKE_KV_TOKENS),
            "--context-length",
            str(FAKE_CONTEXT),
        ]
        procs.append(start_proc("fake-sglang", fake, logs))
        _wait_line(procs[0], "fake SGLang ready")
        serve = [
            *CLI,
            "serve",
            "--model",
            DEFAULT_MODEL_NAME,
            "--sglang",
            f"http://127.0.0.1:{sglang_port}",
            "--port",
            str(port),
            "--metrics-port",
            "0",
            "--v0-port",
            str(v0_port),
            "--v0-token",
            TOKEN,
            "--served-model-name",
            SERVED_ALIAS,
        ]
        procs.append(start_proc("engine", serve, logs))
        address = f"127.0.0.1:{port}"
        wait_health(address, procs, timeout=90)
        _wait_line(procs[1], "ominix.worker.v0 front listening")
        yield V0Daemon(f"http://127.0.0.1:{v0_port}", address, procs, f"http://127.0.0.1:{sglang_port}")
    finally:
        stop_procs(procs[::-1])
