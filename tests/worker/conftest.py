"""Shared fixtures for the worker tests: tiny random models written once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


def _import_worker_package() -> None:
    """GPU machines may run the tests from a bare checkout: put workers/ on the path for ominix_worker."""
    try:
        import ominix_worker  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workers"))


_import_worker_package()

from ominix_worker.testing import check_fast_launches, write_tiny_hf_model  # noqa: E402

check_fast_launches()  # every fast Triton launch in these tests is checked against Triton's own choice

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
    # Mixture of experts: Qwen3-MoE with a dense layer among sparse ones (mlp_only_layers), Mixtral, and
    # Qwen2-MoE's gated shared expert with un-normalised top-k weights.
    "qwen3_moe": dict(
        arch="qwen3_moe",
        num_layers=3,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        seed=4,
    ),
    "mixtral": dict(arch="mixtral", num_local_experts=4, num_experts_per_tok=2, seed=5),
    "qwen2_moe": dict(
        arch="qwen2_moe",
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        seed=6,
    ),
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


@pytest.fixture
def safetensors_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Elements read from safetensors files per tensor name while the test runs (a loader that reads only a
    rank's slices shows it here)."""
    import torch

    import ominix_worker.parallel.weights as weights

    read_elements: dict[str, int] = {}
    original = weights.SafetensorsWeight.read

    def counting_read(
        self: weights.SafetensorsWeight, dim: int = 0, start: int = 0, length: int | None = None
    ) -> torch.Tensor:
        out = original(self, dim, start, length)
        read_elements[self.name] = read_elements.get(self.name, 0) + out.numel()
        return out

    monkeypatch.setattr(weights.SafetensorsWeight, "read", counting_read)
    return read_elements
