"""A missing external tool fails the test in CI (CI=true) and skips it elsewhere."""

from __future__ import annotations

import pytest
from obs_tools import require_tool


def test_missing_tool_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="ominix-no-such-tool is not installed"):
        require_tool("ominix-no-such-tool", "nowhere")


def test_missing_tool_skips_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        require_tool("ominix-no-such-tool", "nowhere")


def test_present_tool_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert require_tool("python3", "the interpreter").endswith("python3")
