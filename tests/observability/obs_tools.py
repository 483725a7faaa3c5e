"""External tools the observability tests drive (promtool, hadolint, kubectl, systemd-analyze).

In CI (CI=true) a missing tool fails the test: .ci/run installs promtool and the test extra installs the
others, so a skip there would hide a broken install. Locally a missing tool skips.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
# Tools installed from PyPI land next to the interpreter, which need not be on PATH.
_VENV_BIN = str(Path(sys.executable).parent)


def require_tool(name: str, how: str) -> str:
    """The tool's path; fail in CI and skip elsewhere when it is missing (``how`` says how to get it)."""
    path = shutil.which(name, path=os.pathsep.join([_VENV_BIN, os.environ.get("PATH", "")]))
    if path:
        return path
    message = f"{name} is not installed ({how})"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def promtool() -> str:
    return require_tool("promtool", "apt-get install -y prometheus")


def run(argv: list[str], timeout: float = 120, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)  # type: ignore[call-overload]  # callers pass run()'s own keywords
