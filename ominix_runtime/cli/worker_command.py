"""``ominix-runtime worker``: the one place the policy package reaches into the worker package (and torch)."""

from __future__ import annotations

import argparse
import importlib.util

from ominix_runtime.cli.settings import ConfigError
from ominix_runtime.config import RuntimeConfig


def run_worker(config: RuntimeConfig, options: argparse.Namespace) -> int:
    # gguf is a base dependency, imported only when a GGUF model loads: a GPU image may run without it.
    missing = [m for m in ("torch", "ominix_worker") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"the worker needs {', '.join(missing)}, which is not installed: pip install 'ominix-runtime[worker]'"
        )
    from ominix_worker.server import run  # type: ignore[import-untyped,import-not-found,unused-ignore]  # untyped, and not visible to mypy through an editable install

    return int(run(config))
