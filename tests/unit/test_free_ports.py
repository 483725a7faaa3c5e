"""free_ports: distinct ports below the kernel's ephemeral range, skipping taken ones, in blocks when asked."""

from __future__ import annotations

import socket

import pytest

from ominix_runtime import bind_probe
from ominix_runtime.bind_probe import SEARCH_SPAN, ephemeral_low, free_ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    low = ephemeral_low()
    ports = free_ports("127.0.0.1", 6)
    assert len(set(ports)) == 6
    assert all(max(1024, low - SEARCH_SPAN) <= p < low for p in ports)
    held = []
    try:
        for port in ports:  # each is free once the probes are released
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", port))
    finally:
        for s in held:
            s.close()


def test_a_taken_port_is_skipped_and_a_block_is_consecutive(monkeypatch: pytest.MonkeyPatch) -> None:
    start = max(1024, ephemeral_low() - SEARCH_SPAN)
    with socket.socket() as taken:
        # the first free port the search would try, then taken by someone else
        monkeypatch.setattr(bind_probe.random, "randrange", lambda _n: 0)
        first = free_ports("127.0.0.1", 1)[0]
        taken.bind(("127.0.0.1", first))
        monkeypatch.setattr(bind_probe.random, "randrange", lambda _n: first - start)
        (other,) = free_ports("127.0.0.1", 1)
        assert other != first
        base = free_ports("127.0.0.1", 3, consecutive=True)
        assert base == [base[0], base[0] + 1, base[0] + 2] and first not in base


def test_no_room_is_an_os_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bind_probe, "ephemeral_low", lambda: 1026)
    with pytest.raises(OSError, match="no room below the ephemeral range"):
        free_ports("127.0.0.1", 3)
