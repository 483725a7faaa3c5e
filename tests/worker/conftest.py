"""Shared fixtures for the worker tests: tiny random models written once per session."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def _import_worker_package() -> None:
    """GPU machines may run the tests from a bare checkout: map ominix_worker onto workers/."""
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


_import_worker_package()

from ominix_worker.testing import write_tiny_hf_model  # noqa: E402

LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 500000.0,
}

TINY_MODELS = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2", tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3"),
    "llama31": dict(arch="llama", rope_parameters=LLAMA31_ROPE, seed=3),
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """tiny_model_dir(name) → folder of the tiny random model ``name`` (see TINY_MODELS)."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = write_tiny_hf_model(tmp_path_factory.mktemp(f"tiny_{name}"), **TINY_MODELS[name])
        return cache[name]

    return get
