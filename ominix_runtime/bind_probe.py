"""Bind and release an address the way the gRPC servers bind it, so a taken port is found before loading."""

from __future__ import annotations

import socket


def probe_bind(host: str, port: int) -> None:
    """Bind ``host:port`` with SO_REUSEADDR (no SO_REUSEPORT, as the servers bind) and release it.

    Raises socket.gaierror when ``host`` does not resolve and OSError when the port cannot be bound.
    """
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(sockaddr)
