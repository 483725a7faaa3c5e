"""The health probe checks a mutual-TLS worker (started with --tls-ca, so it requires a client certificate)
when given a client certificate with --tls-cert/--tls-key, and refuses half a client pair as bad usage;
`generate --tls-ca` reaches a TLS engine port. Certificates come from deploy/tls/make-certs.sh."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from obs_tools import DEPLOY, run

from ominix_runtime.bind_probe import free_port

PROBE = [sys.executable, "-m", "ominix_runtime.server.health_probe"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl binary not available")
    folder = tmp_path_factory.mktemp("tls")
    made = run(["bash", str(DEPLOY / "tls" / "make-certs.sh"), str(folder)])
    assert made.returncode == 0, made.stderr
    return folder


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "ominix_runtime", *argv], stdout=out, stderr=subprocess.STDOUT
        )


def _wait(probe: list[str], procs: dict[Path, subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 120
    while run(probe, timeout=30).returncode != 0:
        for log, proc in procs.items():
            assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "\n".join(log.read_text()[-2000:] for log in procs)
        time.sleep(0.3)


@pytest.fixture(scope="module")
def mtls(certs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(worker, engine) addresses: a worker requiring the engine's client certificate (--tls-ca), and an
    engine serving TLS on its own port, as deploy/TLS.md runs them."""
    from ominix_worker.testing import write_tiny_hf_model

    model = write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", arch="llama", vocab_size=320)
    logs = tmp_path_factory.mktemp("logs")
    worker_port, engine_port = free_port(), free_port()
    worker = f"127.0.0.1:{worker_port}"
    ca = ["--tls-ca", str(certs / "ca.pem")]
    argv = ["worker", "--model", str(model), "--port", str(worker_port), "--dtype", "float32"]
    argv += ["--kv-cache-memory", "4MiB", "--num-threads", "1", *ca]
    argv += ["--tls-cert", str(certs / "worker.pem"), "--tls-key", str(certs / "worker.key")]
    procs = {logs / "worker.log": _start(argv, logs / "worker.log")}
    try:
        client = [*ca, "--tls-cert", str(certs / "client.pem"), "--tls-key", str(certs / "client.key")]
        _wait([*PROBE, worker, *client], procs)
        argv = ["serve", "--model", str(model), "--port", str(engine_port), "--metrics-port", "0"]
        argv += ["--worker", worker, *ca]
        argv += ["--tls-cert", str(certs / "engine.pem"), "--tls-key", str(certs / "engine.key")]
        procs[logs / "engine.log"] = _start(argv, logs / "engine.log")
        engine = f"localhost:{engine_port}"
        _wait([*PROBE, engine, *ca], procs)
        yield worker, engine
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=30)


def test_probe_checks_a_mutual_tls_worker_with_a_client_certificate(
    certs: Path, mtls: tuple[str, str]
) -> None:
    worker, _ = mtls
    ca = ["--tls-ca", str(certs / "ca.pem")]
    pair = ["--tls-cert", str(certs / "client.pem"), "--tls-key", str(certs / "client.key")]
    ok = run([*PROBE, worker, *ca, *pair], timeout=30)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    # Without a client certificate the worker refuses the handshake: the probe cannot tell it is up.
    refused = run([*PROBE, worker, *ca], timeout=30)
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr, refused.stdout + refused.stderr


def test_generate_talks_to_a_tls_engine_port(certs: Path, mtls: tuple[str, str]) -> None:
    """deploy/TLS.md: `generate --tls-ca` is a client of a TLS engine port."""
    _, engine = mtls
    argv = ["generate", "hi", "--address", engine, "--tls-ca", str(certs / "ca.pem"), "--max-tokens", "2"]
    out = run([sys.executable, "-m", "ominix_runtime", *argv], timeout=120)
    assert out.returncode == 0 and "[length]" in out.stderr, out.stdout + out.stderr
    plaintext = run([sys.executable, "-m", "ominix_runtime", *argv[:4], "--max-tokens", "2"], timeout=120)
    assert plaintext.returncode != 0


@pytest.mark.parametrize("half", [["--tls-cert", "client.pem"], ["--tls-key", "client.key"]])
def test_half_a_client_pair_is_bad_usage(certs: Path, half: list[str]) -> None:
    flag, name = half
    out = run([*PROBE, "127.0.0.1:1", "--tls-ca", str(certs / "ca.pem"), flag, str(certs / name)], timeout=30)
    assert out.returncode == 2 and "--tls-cert and --tls-key go together" in out.stderr, out.stderr
    unreadable = run([*PROBE, "127.0.0.1:1", "--tls-ca", str(certs / "missing.pem")], timeout=30)
    assert unreadable.returncode == 2 and "cannot read" in unreadable.stderr, unreadable.stderr
