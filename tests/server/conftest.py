"""Fixtures: one fake-backed engine daemon per module (see server_harness.py), serving its clients itself and
again through two front processes (``--front-procs 2``): the front API must not tell the two apart."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_harness import FAKE, RunningDaemon, running_daemon


@pytest.fixture(scope="module", params=[0, 2], ids=["in-process", "front-procs"])
def fake_daemon(request: pytest.FixtureRequest) -> Iterator[RunningDaemon]:
    yield from running_daemon(FAKE, request.param)
