"""Fixtures of the ominix.worker.v0 tests (see v0_daemons.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from v0_daemons import V0Daemon, sglang_v0_daemon_procs


@pytest.fixture(scope="module")
def sglang_v0_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[V0Daemon]:
    yield from sglang_v0_daemon_procs(tmp_path_factory)
