"""MoE fields read from Hugging Face configs: which layers are sparse, routing options, parameter counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ominix_worker.config import ModelConfigError, config_from_hf_dict, load_hf_config

BENCH_CONFIGS = Path(__file__).resolve().parents[2] / "bench" / "configs"


def _qwen_moe(**overrides: object) -> dict[str, object]:
    raw: dict[str, object] = dict(
        model_type="qwen3_moe", vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32,
    )  # fmt: skip
    raw.update(overrides)
    return raw


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers() -> None:
    config = config_from_hf_dict(_qwen_moe(decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True))
    assert config.moe_layers == (1, 5)  # (i + 1) % 2 == 0, minus layer 3
    assert config.norm_topk_prob and config.qk_norm and config.is_moe
    # Unstated, norm_topk_prob is off (transformers' default for Qwen3-MoE and Qwen2-MoE).
    assert not config_from_hf_dict(_qwen_moe()).norm_topk_prob
    assert config.architecture == "Qwen3MoeForCausalLM"


def test_qwen2_moe_has_a_shared_expert_and_mixtral_is_sparse_everywhere() -> None:
    qwen2 = config_from_hf_dict(
        _qwen_moe(model_type="qwen2_moe", shared_expert_intermediate_size=48, norm_topk_prob=False)
    )
    assert qwen2.shared_expert_intermediate_size == 48 and not qwen2.norm_topk_prob and qwen2.qkv_bias
    mixtral = config_from_hf_dict(
        _qwen_moe(model_type="mixtral", num_experts=None, num_local_experts=8, moe_intermediate_size=None)
    )
    assert mixtral.moe_layers == tuple(range(6)) and mixtral.moe_intermediate_size == 96
    assert mixtral.norm_topk_prob and not mixtral.qk_norm


def test_a_bad_moe_shape_is_refused() -> None:
    with pytest.raises(ModelConfigError, match="top-9"):
        config_from_hf_dict(_qwen_moe(num_experts_per_tok=9))


def test_qwen3_30b_a3b_shape() -> None:
    config = load_hf_config(BENCH_CONFIGS / "qwen3-30b-a3b-config.json")
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (128, 8, 768)
    assert config.moe_layers == tuple(range(48))
    # The published total is 30.5B parameters.
    assert 30.4e9 < config.num_parameters() < 30.6e9
    dense = json.loads((BENCH_CONFIGS / "llama8b-config.json").read_text())
    assert not config_from_hf_dict(dense).is_moe
