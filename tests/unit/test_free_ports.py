"""free_ports: distinct ports outside the kernel's ephemeral range, skipping taken ones, in blocks when asked,
and still ports where the range leaves no room."""

from __future__ import annotations

import socket

import pytest

from ominix_runtime import bind_probe
from ominix_runtime.bind_probe import ephemeral_range, free_ports, search_window


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    low, high = ephemeral_range()
    ports = free_ports(6)
    assert len(set(ports)) == 6
    assert all(p in search_window(6) for p in ports)
    if search_window(6) != range(
        1024, 65536
    ):  # this host leaves room outside the range (as a stock kernel does)
        assert not any(low <= p <= high for p in ports)
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
    window = search_window(1)
    with socket.socket() as taken:
        # the first free port the search would try, then taken by someone else
        monkeypatch.setattr(bind_probe.random, "randrange", lambda _n: 0)
        first = free_ports(1)[0]
        taken.bind(("127.0.0.1", first))
        monkeypatch.setattr(bind_probe.random, "randrange", lambda _n: window.index(first))
        (other,) = free_ports(1)
        assert other != first
        base = free_ports(3, consecutive=True)
        assert base == [base[0], base[0] + 1, base[0] + 2] and first not in base


def test_ports_given_to_others_are_avoided(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bind_probe.random, "randrange", lambda _n: 0)
    first = free_ports(1)[0]  # where every search below starts
    assert free_ports(1, avoid={first}) != [first]
    block = free_ports(3, consecutive=True, avoid={first + 1})
    assert first + 1 not in block and block == [block[0], block[0] + 1, block[0] + 2]


def test_the_launcher_picks_worker_and_rendezvous_ports_apart_from_the_given_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ominix_runtime.cli.commands import command
    from ominix_runtime.cli.launcher import rendezvous_ports, worker_ports
    from ominix_runtime.cli.settings import resolve

    monkeypatch.setattr(bind_probe.random, "randrange", lambda _n: 0)
    engine_port = free_ports(1)[0]  # the first port a search tries: every pick below would take it
    argv = ["--devices", "cpu,cpu", "--tensor-parallel-size", "2", "--model", "dummy:x"]
    config, _ = resolve(
        command("launch"), [*argv, "--port", str(engine_port), "--worker-base-port", "0"], env={}
    )
    workers = worker_ports(config, avoid={engine_port})
    rendezvous = rendezvous_ports(config, avoid={engine_port, *workers})
    assert len(workers) == len(rendezvous) == 1
    assert len({engine_port, *workers, *rendezvous}) == 3


@pytest.mark.parametrize(
    ("ephemeral", "expected"),
    [
        ((32768, 60999), range(20768, 32768)),
        ((1024, 60999), range(61000, 65536)),  # no room below: above
        ((1024, 65535), range(1024, 65536)),  # no room on either side: every unprivileged port
    ],
)
def test_where_the_search_looks(
    monkeypatch: pytest.MonkeyPatch, ephemeral: tuple[int, int], expected: range
) -> None:
    monkeypatch.setattr(bind_probe, "ephemeral_range", lambda: ephemeral)
    assert search_window(4) == expected
    ports = free_ports(4)
    assert len(set(ports)) == 4 and all(p in expected for p in ports)
