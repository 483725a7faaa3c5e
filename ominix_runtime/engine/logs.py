"""Engine logging that can never raise: a broken log sink must not keep a request from its end."""

from __future__ import annotations

import contextlib

import structlog

_log = structlog.get_logger("ominix.engine")


def log_event(level: str, event: str, **fields: object) -> None:
    with contextlib.suppress(Exception):
        getattr(_log, level)(event, **fields)
