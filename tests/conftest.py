"""Suite-wide fixtures.

Every scheduler created in-process by a unit, conformance or fault test must pass check_integrity() when the
test ends. Server and end-to-end tests run their engines on other threads or in other processes, where a check
at teardown would race the engine; their daemons check integrity themselves when idle.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ominix_runtime.engine.scheduler import Scheduler

_CHECKED_DIRS = ("unit", "conformance", "faults")
_TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def assert_scheduler_integrity(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[Scheduler]]:
    created: list[Scheduler] = []
    if Path(request.node.path).resolve().relative_to(_TESTS_DIR).parts[0] not in _CHECKED_DIRS:
        yield created
        return
    original_init = Scheduler.__init__

    def tracking_init(self: Scheduler, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(Scheduler, "__init__", tracking_init)
    yield created
    for scheduler in created:
        scheduler.check_integrity()
