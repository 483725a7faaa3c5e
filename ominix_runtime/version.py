"""The installed version (package metadata) and, from a git checkout, the commit."""

from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path

from ominix_runtime import __version__

DISTRIBUTION = "ominix-runtime"


def package_version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return __version__


def git_commit() -> str | None:
    """The checkout's commit when the package runs from one (editable or source tree); None otherwise."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def version_text() -> str:
    commit = git_commit()
    return f"{DISTRIBUTION} {package_version()}" + (f" (git {commit})" if commit else "")
