"""Mutual TLS between engine and worker: only the engine's certificate from the worker's CA gets a Run stream
(a front-end client's certificate from the same CA does not).

Certificates come from deploy/tls/make-certs.sh (openssl), so the script is exercised too.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from fault_procs import CLI, free_ports, start_proc_env, stop_procs, wait_health_tls, worker_argv

from ominix_runtime.backends.grpc_worker import GrpcWorkerBackend
from ominix_runtime.contract import DecodeStep, NewRequestData, OminixError, SamplingParams
from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc

MAKE_CERTS = Path(__file__).resolve().parents[2] / "deploy" / "tls" / "make-certs.sh"


def _certs(folder: Path) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl binary not available")
    subprocess.run(["bash", str(MAKE_CERTS), str(folder)], check=True, capture_output=True, timeout=120)
    return folder


def _creds(ca: Path, cert: Path | None = None, key: Path | None = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=key.read_bytes() if key else None,
        certificate_chain=cert.read_bytes() if cert else None,
    )


async def _try_stream(address: str, tls: grpc.ChannelCredentials | None) -> str:
    """'ok' when a Run stream answers one step; otherwise the failure text."""
    backend = GrpcWorkerBackend(address, tls=tls, step_timeout=10, rpc_timeout=5)
    try:
        cap = await backend.describe()
        stream = await backend.open()
        step = DecodeStep(
            1,
            new_requests=[
                NewRequestData("probe", [5, 6, 7], SamplingParams(max_tokens=1), [0], 0, 3, effective_seed=1)
            ],
        )
        await stream.send(step)
        result = await stream.recv()
        await stream.close()
        assert cap.kv_num_blocks > 0 and result.step_id == 1
        return "ok"
    except OminixError as exc:
        return exc.message
    finally:
        await backend.close()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ominix_worker.testing import write_tiny_hf_model

    return write_tiny_hf_model(tmp_path_factory.mktemp("mtls-model") / "tiny", arch="llama", vocab_size=320)


def test_worker_accepts_only_the_engine_certificate_from_its_ca(tiny_model: Path, tmp_path: Path) -> None:
    tls = _certs(tmp_path / "tls")
    other = _certs(tmp_path / "other-ca")  # a valid-looking certificate from a CA the worker does not trust
    worker_port, port, metrics_port = free_ports(3)
    flags = [
        "--tls-cert",
        str(tls / "worker.pem"),
        "--tls-key",
        str(tls / "worker.key"),
        "--tls-ca",
        str(tls / "ca.pem"),
    ]
    worker = start_proc_env("worker", worker_argv(str(tiny_model), worker_port, extra=flags), tmp_path, {})
    procs = [worker]
    address = f"127.0.0.1:{worker_port}"
    engine_creds = _creds(tls / "ca.pem", tls / "engine.pem", tls / "engine.key")
    try:
        end = time.monotonic() + 120
        while not asyncio.run(GrpcWorkerBackend(address, tls=engine_creds, rpc_timeout=2).health()):
            assert worker.popen.poll() is None and time.monotonic() < end, worker.log_tail()
            time.sleep(0.2)
        # Refused: plaintext, TLS without a client certificate, a certificate from another CA.
        assert asyncio.run(_try_stream(address, None)) != "ok"
        assert asyncio.run(_try_stream(address, _creds(tls / "ca.pem"))) != "ok"
        assert (
            asyncio.run(
                _try_stream(address, _creds(tls / "ca.pem", other / "engine.pem", other / "engine.key"))
            )
            != "ok"
        )
        # Refused: certificates from the worker's own CA that are not the engine's. The front-end client's
        # passes the handshake, then Run says who it is not; the worker's own is no client certificate.
        client_refused = asyncio.run(
            _try_stream(address, _creds(tls / "ca.pem", tls / "client.pem", tls / "client.key"))
        )
        assert "PERMISSION_DENIED" in client_refused and "ominix-runtime client" in client_refused
        assert (
            asyncio.run(_try_stream(address, _creds(tls / "ca.pem", tls / "worker.pem", tls / "worker.key")))
            != "ok"
        )
        # Accepted: the engine's certificate, signed by the worker's CA.
        assert asyncio.run(_try_stream(address, engine_creds)) == "ok"

        # The engine daemon itself over mTLS to the worker, TLS on its own port.
        serve = [
            *CLI,
            "serve",
            "--model",
            str(tiny_model),
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
        ]
        serve += [
            "--worker",
            address,
            "--tls-cert",
            str(tls / "engine.pem"),
            "--tls-key",
            str(tls / "engine.key"),
        ]
        serve += ["--tls-ca", str(tls / "ca.pem")]
        engine = start_proc_env("engine", serve, tmp_path, {})
        procs.append(engine)
        front = f"localhost:{port}"
        wait_health_tls(front, _creds(tls / "ca.pem"), procs)
        with grpc.secure_channel(front, _creds(tls / "ca.pem")) as channel:
            request = engine_pb2.GenerateRequest(
                input_ids=engine_pb2.TokenIds(ids=[5, 6, 7]),
                sampling=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True),
            )
            events = list(engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=30))
        assert events[-1].WhichOneof("event") == "done"
    finally:
        stop_procs(procs[::-1])
