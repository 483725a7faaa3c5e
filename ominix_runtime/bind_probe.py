"""Ports: bind and release an address the way the gRPC servers bind it, so a taken port is found before loading;
and pick free ports no other process can be handed before the caller binds them."""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Collection
from pathlib import Path


def probe_bind(host: str, port: int) -> None:
    """Bind ``host:port`` with SO_REUSEADDR (no SO_REUSEPORT, as the servers bind) and release it.

    Raises socket.gaierror when ``host`` does not resolve and OSError when the port cannot be bound.
    """
    with _bound(host, port, reuse_address=True):
        pass


def _bound(host: str, port: int, reuse_address: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port``; OSError (the socket closed) when the port cannot be bound."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        if reuse_address:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
    except OSError:
        sock.close()
        raise
    return sock


# The kernel hands ports in [low, high] of this range to every bind to port 0 and every outgoing connection.
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)
# How far outside the ephemeral range ports are looked for (below it: clear of the well-known and registered low
# ports).
SEARCH_SPAN = 12000
LOWEST_PORT = 1024
HIGHEST_PORT = 65535
LOOPBACK = "127.0.0.1"


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel assigns on its own, lowest and highest."""
    with contextlib.suppress(OSError, ValueError):
        low, high = (int(word) for word in EPHEMERAL_RANGE_FILE.read_text().split()[:2])
        return low, high
    return DEFAULT_EPHEMERAL_RANGE


def search_window(count: int) -> range:
    """Where ``free_ports`` looks: below the ephemeral range, else above it; where the range leaves no room on
    either side for ``count`` ports (a host that widened it), every unprivileged port, at the old risk."""
    low, high = ephemeral_range()
    below = range(max(LOWEST_PORT, low - SEARCH_SPAN), low)
    above = range(high + 1, min(HIGHEST_PORT, high + SEARCH_SPAN) + 1)
    for window in (below, above):
        if len(window) >= count:
            return window
    return range(LOWEST_PORT, HIGHEST_PORT + 1)


def free_ports(
    count: int, host: str = LOOPBACK, *, consecutive: bool = False, avoid: Collection[int] = ()
) -> list[int]:
    """``count`` distinct ports free on ``host`` now, outside the kernel's ephemeral range, none in ``avoid``
    (ports already given to something that has not bound them yet).

    A port the kernel reports free for ``bind(0)`` is inside that range, and between the probe and the real bind
    any process may be given the same port for its own ``bind(0)`` (gloo's pair listeners) or as the source of an
    outgoing connection (a rank retrying rank 0, a gRPC channel). Outside the range no socket gets a port it did
    not name. ``consecutive`` asks for ``count`` adjacent ports (a ``--worker-base-port`` block).
    """
    window = search_window(count)
    # A random start keeps concurrent callers (parallel tests, several launches) apart.
    offset = random.randrange(len(window))
    probes: list[socket.socket] = []
    try:
        for step in range(len(window)):
            port = window[(offset + step) % len(window)]
            if consecutive and probes and port != probes[-1].getsockname()[1] + 1:
                _close_all(probes)
            if port in avoid:
                if consecutive:
                    _close_all(probes)
                continue
            try:
                probes.append(_bound(host, port))
            except OSError:
                if consecutive:
                    _close_all(probes)
                continue
            if len(probes) == count:
                return [int(p.getsockname()[1]) for p in probes]
    finally:
        _close_all(probes)
    raise OSError(f"no {count} free ports on {host} in {window.start}-{window.stop - 1}")


def free_port(host: str = LOOPBACK) -> int:
    """One port as :func:`free_ports` picks them."""
    return free_ports(1, host)[0]


def _close_all(probes: list[socket.socket]) -> None:
    for probe in probes:
        probe.close()
    probes.clear()
