"""A grpc.health.v1 probe for container health checks: exit 0 when the server answers SERVING.

``python -m ominix_runtime.server.health_probe [HOST:PORT] [--service NAME] [--timeout S]``; the address
defaults to $OMINIX_HEALTH_ADDRESS, then to the engine's default port on loopback. Works for the engine and
for workers (both serve grpc.health.v1). Exit codes: 0 SERVING, 1 not serving or unreachable, 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ominix_runtime.config import DEFAULT_ENGINE_PORT

DEFAULT_ADDRESS = f"127.0.0.1:{DEFAULT_ENGINE_PORT}"


def probe(address: str, service: str = "", timeout: float = 3.0, ca: bytes | None = None) -> tuple[bool, str]:
    """(serving, what was seen) for one Health.Check call; ``ca`` (PEM) switches to TLS."""
    channel = (
        grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca))
        if ca is not None
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
        "address", nargs="?", default=os.environ.get("OMINIX_HEALTH_ADDRESS", DEFAULT_ADDRESS)
    )
    parser.add_argument("--service", default="", help="health service name ('' is the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    parser.add_argument("--tls-ca", default=None, help="PEM CA bundle: probe over TLS (unset: plaintext)")
    args = parser.parse_args(argv)
    ca = Path(args.tls_ca).read_bytes() if args.tls_ca else None
    serving, seen = probe(args.address, args.service, args.timeout, ca)
    print(seen, file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
