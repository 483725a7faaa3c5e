"""Ports: bind and release an address the way the gRPC servers bind it, so a taken port is found before loading;
and pick free ports no other process can be handed before the caller binds them."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path


def probe_bind(host: str, port: int) -> None:
    """Bind ``host:port`` with SO_REUSEADDR (no SO_REUSEPORT, as the servers bind) and release it.

    Raises socket.gaierror when ``host`` does not resolve and OSError when the port cannot be bound.
    """
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(sockaddr)


# The kernel hands ports in [low, high] of this range to every bind to port 0 and every outgoing connection.
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_LOW = 32768
# How far below the ephemeral range ports are looked for (clear of the well-known and registered low ports).
SEARCH_SPAN = 12000


def ephemeral_low() -> int:
    """The lowest port the kernel assigns on its own."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    return DEFAULT_EPHEMERAL_LOW


def free_ports(host: str, count: int, *, consecutive: bool = False) -> list[int]:
    """``count`` distinct ports free on ``host`` now, below the kernel's ephemeral range.

    A port the kernel reports free for ``bind(0)`` is inside that range, and between the probe and the real bind
    any process may be given the same port for its own ``bind(0)`` (gloo's pair listeners) or as the source of an
    outgoing connection (a rank retrying rank 0, a gRPC channel). Below the range no socket gets a port it did not
    name. ``consecutive`` asks for ``count`` adjacent ports (a ``--worker-base-port`` block).
    """
    low = ephemeral_low()
    start = max(1024, low - SEARCH_SPAN)
    if low - start < count:
        raise OSError(f"no room below the ephemeral range (it starts at {low}) for {count} ports")
    # A random start keeps concurrent callers (parallel tests, several launches) apart.
    offset = random.randrange(low - start)
    probes: list[socket.socket] = []
    try:
        for step in range(low - start):
            port = start + (offset + step) % (low - start)
            if consecutive and probes and port != probes[-1].getsockname()[1] + 1:
                _close_all(probes)
            probe = _held(host, port)
            if probe is None:
                if consecutive:
                    _close_all(probes)
                continue
            probes.append(probe)
            if len(probes) == count:
                return [int(p.getsockname()[1]) for p in probes]
    finally:
        _close_all(probes)
    raise OSError(f"no {count} free ports on {host} below {low}")


def _held(host: str, port: int) -> socket.socket | None:
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    probe = socket.socket(family, kind, proto)
    try:
        probe.bind(sockaddr)
    except OSError:
        probe.close()
        return None
    return probe


def _close_all(probes: list[socket.socket]) -> None:
    for probe in probes:
        probe.close()
    probes.clear()
