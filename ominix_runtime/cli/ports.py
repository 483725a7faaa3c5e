"""Port checks before anything loads: a taken port is one line naming the port and the flag that moves it."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from ominix_runtime.bind_probe import probe_bind
from ominix_runtime.cli.settings import ConfigError


def check_port_free(host: str, port: int, flag: str) -> None:
    """ConfigError naming ``flag`` when ``host:port`` cannot be bound now."""
    try:
        probe_bind(host, port)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot resolve host {host!r} for {flag}: {exc.strerror or exc}") from None
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
