"""Makes ``ominix_worker`` importable from a bare checkout (GPU machines run the tests without installing)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _alias_worker_package() -> None:
    try:
        import ominix_worker  # noqa: F401
    except ImportError:
        workers = Path(__file__).resolve().parents[2] / "workers"
        spec = importlib.util.spec_from_file_location(
            "ominix_worker", workers / "__init__.py", submodule_search_locations=[str(workers)]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["ominix_worker"] = module
        spec.loader.exec_module(module)


_alias_worker_package()
