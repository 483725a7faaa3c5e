"""Port checks before anything loads: a taken port is one line naming the port and the flag that moves it."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from ominix_runtime.cli.settings import ConfigError


def check_port_free(host: str, port: int, flag: str) -> None:
    """Bind and release ``host:port`` (without SO_REUSEPORT, as the servers bind); ConfigError if taken."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigError(f"cannot resolve host {host!r} for {flag}: {exc.strerror or exc}") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            raise ConfigError(
                f"port {port} on {host} is not available ({exc.strerror or exc}): "
                f"stop what holds it or pass another {flag}"
            ) from None


def check_ports_free(ports: Sequence[tuple[str, int, str]]) -> None:
    """Each ``(host, port, flag)`` in turn; the same port named twice is an error too."""
    seen: dict[int, str] = {}
    for host, port, flag in ports:
        if port in seen:
            raise ConfigError(f"port {port} is given to both {seen[port]} and {flag}")
        seen[port] = flag
        check_port_free(host, port, flag)


def free_ports(host: str, count: int) -> list[int]:
    """``count`` ports the system reports free on ``host`` (for ``--worker-base-port 0``)."""
    probes = []
    try:
        for _ in range(count):
            probe = socket.socket()
            probe.bind((host, 0))
            probes.append(probe)
        return [int(p.getsockname()[1]) for p in probes]
    finally:
        for probe in probes:
            probe.close()
