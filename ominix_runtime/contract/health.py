"""A backend's lifecycle state in the router's terms (upstream ``WorkerState``)."""

from __future__ import annotations

from enum import IntEnum


class BackendHealth(IntEnum):
    """Values match ``ominix.runtime.v1.BackendHealth``."""

    STARTING = 1  # described, driver not serving yet
    AVAILABLE = 2  # serving, takes new requests
    DRAINING = 3  # finishes live requests, takes no new ones
    UNHEALTHY = 4  # running but failing (reconnecting)
    OFFLINE = 5  # stopped

    @property
    def takes_new_requests(self) -> bool:
        return self == BackendHealth.AVAILABLE


__all__ = ["BackendHealth"]
