"""Every scheduler created in-process during a fault test must pass check_integrity() when the test ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ominix_runtime.engine.scheduler import Scheduler


@pytest.fixture(autouse=True)
def assert_scheduler_integrity(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Scheduler]]:
    created: list[Scheduler] = []
    original_init = Scheduler.__init__

    def tracking_init(self: Scheduler, *args: object, **kwargs: object) -> None:
        original_init(self, *args, **kwargs)  # type: ignore[arg-type]
        created.append(self)

    monkeypatch.setattr(Scheduler, "__init__", tracking_init)
    yield created
    for scheduler in created:
        scheduler.check_integrity()
