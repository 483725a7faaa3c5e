"""Log lines reach stderr in one write each, so processes sharing one stderr (launch and its workers) never
interleave a line's text with another process's line."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest
import structlog

from ominix_runtime.server.logging import configure_logging


class _Writes(io.StringIO):
    """A stderr that records every write call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)

    def isatty(self) -> bool:
        return False


def test_every_json_log_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = _Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    try:
        configure_logging("info", json_output=True, component="worker", worker_id="cpu@test")
        log = structlog.get_logger("ominix_test")
        log.info("first line", step=1)
        log.warning("second line", detail="x" * 500)
    finally:
        configure_logging("warning", json_output=True)  # back to the suite's setting, on the real stderr
    lines = [c for c in stderr.calls if c.strip()]
    assert len(lines) == 2
    for call in lines:
        assert call.endswith("\n") and call.count("\n") == 1  # text and newline in the same write
        record = json.loads(call)
        assert record["component"] == "worker" and record["worker_id"] == "cpu@test"
    assert [json.loads(c)["event"] for c in lines] == ["first line", "second line"]


def test_lines_go_to_the_stderr_of_the_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream replaced and closed after logging was configured (a test runner's capture) takes no more
    lines: each goes to whatever ``sys.stderr`` is when it is written."""
    before, after = _Writes(), _Writes()
    monkeypatch.setattr(sys, "stderr", before)
    try:
        configure_logging("info", json_output=True)
        before.close()
        monkeypatch.setattr(sys, "stderr", after)
        structlog.get_logger("ominix_test").info("after the swap")
        logging.getLogger("ominix_runtime").warning("stdlib after the swap")
    finally:
        configure_logging("warning", json_output=True)
    assert [json.loads(c)["event"] for c in after.calls if c.strip()] == [
        "after the swap",
        "stdlib after the swap",
    ]
