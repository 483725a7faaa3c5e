"""Qwen2-MoE with ``shared_expert_intermediate_size: 0``: transformers builds and saves a zero-width shared
expert and its sigmoid gate, which add nothing to a layer's output. Such a checkpoint loads and matches
transformers; a config of 0 beside a shared expert with rows is refused, naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from ominix_worker.loader import ModelLoadError
from ominix_worker.runner import build_runner
from ominix_worker.testing import write_tiny_hf_model

from .hf_match import assert_matches_transformers


def _qwen2_moe(folder: Path, shared: int) -> Path:
    return write_tiny_hf_model(
        folder,
        arch="qwen2_moe",
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=shared,
        norm_topk_prob=False,
        seed=6,
    )


def test_a_zero_width_shared_expert_loads_and_matches_transformers(tmp_path: Path) -> None:
    folder = _qwen2_moe(tmp_path / "m", shared=0)
    with safe_open(str(folder / "model.safetensors"), "pt") as stored:
        shapes = {k: stored.get_slice(k).get_shape() for k in stored.keys() if ".layers.0.mlp.shared" in k}  # noqa: SIM118 (not iterable)
    # What this test is about: transformers writes the empty expert and its gate.
    assert shapes["model.layers.0.mlp.shared_expert.down_proj.weight"] == [64, 0]
    assert "model.layers.0.mlp.shared_expert_gate.weight" in shapes
    runner = assert_matches_transformers(folder)
    assert all(layer.mlp.shared_expert is None for layer in runner.model.layers)


def test_a_shared_expert_with_rows_under_a_config_of_zero_is_refused(tmp_path: Path) -> None:
    folder = _qwen2_moe(tmp_path / "m", shared=48)
    config = json.loads((folder / "config.json").read_text())
    config["shared_expert_intermediate_size"] = 0
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError, match=r"shared_expert\.\w+_proj\.weight.*shared_expert_intermediate_size is 0"
    ):
        build_runner(str(folder), num_blocks=32, block_size=16)
