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


def _check_fast_launches() -> None:
    """Every GPU test's fast Triton launches also ask Triton which kernel it would launch, and fail if another."""
    try:
        from ominix_worker.ops import launch
    except ImportError:  # no Triton here: the GPU tests skip
        return
    launch.CHECK_AGAINST_TRITON = True


_check_fast_launches()
