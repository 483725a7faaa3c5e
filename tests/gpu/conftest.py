"""Makes ``ominix_worker`` importable from a bare checkout (GPU machines run the tests without installing)."""

from __future__ import annotations

import sys
from pathlib import Path


def _alias_worker_package() -> None:
    """GPU machines may run the tests from a bare checkout: put workers/ on the path for ominix_worker."""
    try:
        import ominix_worker  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workers"))


_alias_worker_package()

from ominix_worker.testing import check_fast_launches  # noqa: E402

check_fast_launches()  # every fast Triton launch in the GPU tests is checked against Triton's own choice
