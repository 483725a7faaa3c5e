"""TLS on the engine's front port (self-signed certificate made with the openssl binary)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_harness import SMOLLM2_VOCAB, start_daemon, stop_daemon

from ominix_runtime.config import FrontConfig, TLSConfig
from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc
from ominix_runtime.testing.fake_backend import FakeConfig


def _self_signed(folder: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl binary not available")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.mark.parametrize("front_procs", [0, 1], ids=["in-process", "front-process"])
def test_front_api_over_tls(tmp_path: Path, front_procs: int) -> None:
    cert, key = _self_signed(tmp_path)
    running, thread = start_daemon(
        FakeConfig(vocab_size=SMOLLM2_VOCAB),
        tls=TLSConfig(cert=str(cert), key=str(key)),
        front=FrontConfig(procs=front_procs),
    )
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(running.address, credentials) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            request = engine_pb2.GenerateRequest(
                prompt="secure", sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0)
            )
            events = list(engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=10))
            assert events[-1].done.finish_reason == common_pb2.FINISH_REASON_LENGTH
        with grpc.insecure_channel(running.address) as plain, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=3)
    finally:
        stop_daemon(running, thread)
