"""A grpc.health.v1 probe for container health checks: exit 0 when the server answers SERVING.

``python -m ominix_runtime.server.health_probe [HOST:PORT] [--service NAME] [--timeout S] [--tls-ca PEM
[--tls-cert PEM --tls-key PEM]]``; the address defaults to $OMINIX_HEALTH_ADDRESS, then to the engine's
default port on loopback. Works for the engine and for workers (both serve grpc.health.v1); a worker started
with --tls-ca (mutual TLS) needs a client certificate its CA signed: --tls-cert/--tls-key. Exit codes: 0
SERVING, 1 not serving or unreachable, 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def default_address() -> str:
    """$OMINIX_HEALTH_ADDRESS, else the engine's default port on loopback. ominix_runtime.config pulls in
    the engine, so it is imported only here: the probe runs every few seconds (Kubernetes exec probes,
    Docker HEALTHCHECK) and starts with grpc alone when given an address."""
    if os.environ.get("OMINIX_HEALTH_ADDRESS"):
        return os.environ["OMINIX_HEALTH_ADDRESS"]
    from ominix_runtime.config import DEFAULT_ENGINE_PORT

    return f"127.0.0.1:{DEFAULT_ENGINE_PORT}"


def probe(
    address: str,
    service: str = "",
    timeout: float = 3.0,
    ca: bytes | None = None,
    cert: bytes | None = None,
    key: bytes | None = None,
) -> tuple[bool, str]:
    """(serving, what was seen) for one Health.Check call; ``ca`` (PEM) switches to TLS, ``cert`` and
    ``key`` (PEM, both or neither) present a client certificate, as a mutual-TLS worker requires."""
    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs both its certificate and its key")
    channel = (
        grpc.secure_channel(
            address,
            grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert),
        )
        if ca is not None or cert is not None
        else grpc.insecure_channel(address)
    )
    with channel:
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(  # type: ignore[attr-defined]  # the grpc stubs leave HealthStub's methods out
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as exc:
            return False, f"{address}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="health_probe", description=__doc__.splitlines()[0])
    parser.add_argument(
        "address", nargs="?", help="HOST:PORT (unset: $OMINIX_HEALTH_ADDRESS, else the engine's)"
    )
    parser.add_argument("--service", default="", help="health service name ('' is the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    parser.add_argument("--tls-ca", default=None, help="PEM CA bundle: probe over TLS (unset: plaintext)")
    parser.add_argument(
        "--tls-cert",
        default=None,
        help="PEM client certificate (with --tls-key) for a server that requires one: a worker with --tls-ca",
    )
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    args = parser.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together (the client certificate and its key)")
    pem: dict[str, bytes | None] = {}
    for name in ("tls_ca", "tls_cert", "tls_key"):
        path = getattr(args, name)
        try:
            pem[name] = Path(path).read_bytes() if path else None
        except OSError as exc:
            parser.error(f"--{name.replace('_', '-')}: cannot read {path}: {exc.strerror}")
    address = args.address or default_address()
    serving, seen = probe(address, args.service, args.timeout, pem["tls_ca"], pem["tls_cert"], pem["tls_key"])
    print(seen, file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
