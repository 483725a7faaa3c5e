"""Gemma 3 configs and checkpoints: the text part of a multimodal config, legacy config keys, dummy weights,
a multimodal checkpoint's language model (float and FP8); and how a hybrid layout's KV pools are sized."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from ominix_runtime.contract import DecodeStep, NewRequestData, SamplingParams
from ominix_worker.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    AttentionGroup,
    ModelConfigError,
    config_from_hf_dict,
    load_hf_config,
)
from ominix_worker.kv_cache import group_block_counts
from ominix_worker.runner import ModelRunner, build_runner
from ominix_worker.testing import write_tiny_hf_model

GEMMA_TEXT = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=8,
)


def last_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    runner.reset()
    captured: list[torch.Tensor] = []
    original = runner.model.compute_logits
    runner.model.compute_logits = lambda h: captured.append(original(h)) or captured[-1]  # type: ignore[method-assign]
    n_blocks = -(-len(tokens) // runner.block_size)
    tables = [list(range(n_blocks)) for _ in runner.attention_groups]
    runner.execute_step(
        DecodeStep(
            1,
            new_requests=[
                NewRequestData(
                    "r",
                    tokens,
                    SamplingParams(temperature=0.0),
                    tables[0],
                    0,
                    len(tokens),
                    0,
                    group_kv_block_ids=tables[1:],
                )
            ],
        )
    )
    runner.model.compute_logits = original  # type: ignore[method-assign]
    return captured[-1][0]


def test_the_text_part_of_a_multimodal_config() -> None:
    raw = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "eos_token_id": [1, 106],
        "text_config": {
            **GEMMA_TEXT,
            "model_type": "gemma3_text",
            "rope_scaling": {"type": "linear", "factor": 8.0},
        },
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    config = config_from_hf_dict(raw)
    assert config.arch == "gemma3_text" and config.architecture == "Gemma3ForCausalLM"
    assert config.eos_token_ids == (1, 106) and config.tie_word_embeddings
    # HF's defaults: one global layer in six, rope bases 1e6 (global, scaled) and 1e4 (local).
    assert config.layer_types == (SLIDING_ATTENTION,) * 4
    assert config.rope_theta == 1_000_000.0 and config.rope_local_theta == 10_000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.qk_norm and config.hidden_act == "gelu_pytorch_tanh" and config.query_pre_attn_scalar == 256


def test_legacy_and_current_gemma3_text_keys() -> None:
    legacy = config_from_hf_dict(
        {
            **GEMMA_TEXT,
            "model_type": "gemma3_text",
            "sliding_window_pattern": 2,
            "rope_local_base_freq": 5000.0,
        }
    )
    assert legacy.layer_types == (SLIDING_ATTENTION, FULL_ATTENTION) * 2
    assert [legacy.layer_window(i) for i in range(4)] == [8, 0, 8, 0]
    assert legacy.attention_groups(True) == (AttentionGroup(0, (1, 3)), AttentionGroup(8, (0, 2)))
    assert legacy.attention_groups(False) == (AttentionGroup(0, (0, 1, 2, 3)),)
    assert legacy.max_len_for(False) == 8 and legacy.max_len_for(True) == 131_072
    assert legacy.rope_local_theta == 5000.0
    current = config_from_hf_dict(
        {
            **GEMMA_TEXT,
            "model_type": "gemma3_text",
            "layer_types": [FULL_ATTENTION, SLIDING_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION],
            "rope_parameters": {
                FULL_ATTENTION: {"rope_type": "linear", "factor": 4.0, "rope_theta": 2e6},
                SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 3e4},
            },
            "final_logit_softcapping": 30.0,
        }
    )
    assert current.attention_groups(True) == (AttentionGroup(0, (0, 3)), AttentionGroup(8, (1, 2)))
    assert (current.rope_theta, current.rope_local_theta) == (2e6, 3e4)
    assert current.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert current.final_logit_softcapping == 30.0
    for bad, message in [
        ({"use_bidirectional_attention": True}, "bidirectional"),
        ({"hidden_activation": "silu"}, "hidden_act"),
        ({"layer_types": [FULL_ATTENTION]}, "layer_types"),
        (
            {"rope_parameters": {SLIDING_ATTENTION: {"rope_type": "linear", "factor": 2.0}}},
            "sliding-window layers",
        ),
    ]:
        with pytest.raises(ModelConfigError, match=message):
            config_from_hf_dict({**GEMMA_TEXT, "model_type": "gemma3_text", **bad})


# Gemma 3 rope configurations: a flat rope_parameters (not split per layer type), the per-type entries with
# and without their bases, and a legacy top-level rope_scaling beside them or alone. Six layers: both kinds.
FLAT_ROPE = {"rope_type": "linear", "factor": 8.0, "rope_theta": 500_000.0}
ROPE_CONFIGS: dict[str, dict[str, Any]] = {
    "flat": {"rope_parameters": FLAT_ROPE},
    "flat beside top-level bases": {
        "rope_parameters": FLAT_ROPE, "rope_theta": 2e6, "rope_local_base_freq": 2e4,
    },
    "per type without bases": {
        "rope_parameters": {
            FULL_ATTENTION: {"rope_type": "linear", "factor": 8.0},
            SLIDING_ATTENTION: {"rope_type": "default"},
        },
        "rope_theta": 321.0,
        "rope_local_base_freq": 654.0,
    },
    "global entry only": {
        "rope_parameters": {FULL_ATTENTION: {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}},
        "rope_local_base_freq": 654.0,
    },
    "per type beside a legacy rope_scaling": {
        "rope_parameters": {
            FULL_ATTENTION: {"rope_type": "default", "rope_theta": 5.0},
            SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 7.0},
        },
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
    "legacy": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 99.0},
}  # fmt: skip


def write_gemma3_config(folder: Path, rope: dict[str, Any]) -> Path:
    folder.mkdir()
    raw = {**GEMMA_TEXT, "model_type": "gemma3_text", "num_hidden_layers": 6, **rope}
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def hf_rope(folder: Path) -> tuple[float, dict[str, Any], float]:
    """What transformers' Gemma 3 rotates with: the global layers' base and scaling, the local layers' base
    (its Gemma3RotaryEmbedding reads ``rope_parameters[layer_type]`` and nothing else)."""
    hf = transformers.AutoConfig.from_pretrained(str(folder))
    full, local = hf.rope_parameters[FULL_ATTENTION], hf.rope_parameters[SLIDING_ATTENTION]
    assert set(hf.layer_types) == {FULL_ATTENTION, SLIDING_ATTENTION}
    assert local["rope_type"] == "default"
    scaling = {k: v for k, v in full.items() if k != "rope_theta"} if full["rope_type"] != "default" else {}
    return full["rope_theta"], scaling, local["rope_theta"]


@pytest.mark.parametrize("case", list(ROPE_CONFIGS))
def test_gemma3_rope_is_read_as_transformers_reads_it(case: str, tmp_path: Path) -> None:
    folder = write_gemma3_config(tmp_path / "m", ROPE_CONFIGS[case])
    config = load_hf_config(folder)
    assert (config.rope_theta, config.rope_scaling, config.rope_local_theta) == hf_rope(folder)


def test_a_flat_gemma3_rope_parameters_is_ignored_as_transformers_does_but_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rope_parameters not split per layer type does not reach transformers' Gemma 3 layers (they rotate
    plainly at the top-level bases): the same logits here, and a warning naming what is ignored."""
    folder = write_gemma3_config(tmp_path / "m", ROPE_CONFIGS["flat"])
    with caplog.at_level(logging.WARNING, logger="ominix_worker.config"):
        config = load_hf_config(folder)
    assert (config.rope_theta, config.rope_scaling, config.rope_local_theta) == (1e6, {}, 1e4)
    assert "factor, rope_theta, rope_type" in caplog.text and "ignored" in caplog.text, caplog.text


def test_a_flat_gemma3_rope_parameters_gives_the_logits_of_transformers(tmp_path: Path) -> None:
    """End to end through both models (applying the flat scaling to the global layers moves these logits by
    about 4%, far outside the tolerance)."""
    text = write_tiny_hf_model(
        tmp_path / "text", arch="gemma3_text", num_layers=4, sliding_window=8, sliding_window_pattern=2,
        with_tokenizer=False, vocab_size=96,
    )  # fmt: skip
    config = json.loads((text / "config.json").read_text())
    config["rope_parameters"] = FLAT_ROPE  # in place of the per-type entries transformers wrote
    (text / "config.json").write_text(json.dumps(config))
    tokens = [3 + (11 * i) % 90 for i in range(30)]
    reference = transformers.AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32)  # in eval mode
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0, -1]
    got = last_logits(build_runner(str(text), num_blocks=8, block_size=16), tokens)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


def test_a_flat_gemma3_rope_parameters_beside_rope_scaling_is_refused_as_transformers_refuses_it(
    tmp_path: Path,
) -> None:
    folder = write_gemma3_config(
        tmp_path / "m", {"rope_parameters": FLAT_ROPE, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    )
    with pytest.raises(KeyError, match=FULL_ATTENTION):  # the reference has no global entry to scale
        transformers.AutoConfig.from_pretrained(str(folder))
    with pytest.raises(
        ModelConfigError, match="rope_scaling beside a rope_parameters without a full_attention"
    ):
        load_hf_config(folder)


def test_dummy_gemma3_weights_give_finite_logits(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**GEMMA_TEXT, "model_type": "gemma3_text"}))
    runner = build_runner(f"dummy:{tmp_path / 'config.json'}", num_blocks=8, block_size=16)
    assert runner.kv_windows == (8,)  # HF's default pattern: four layers, all local
    norms = [p for n, p in runner.model.named_parameters() if n.endswith("norm.weight")]
    assert norms and all(bool((p == 0).all()) for p in norms)  # a unit scale is a zero Gemma weight
    logits = last_logits(runner, list(range(5, 40)))
    assert torch.isfinite(logits).all() and logits.abs().max() > 0


def test_a_multimodal_checkpoint_loads_its_language_model(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    text = write_tiny_hf_model(
        tmp_path / "text",
        arch="gemma3_text",
        num_layers=4,
        sliding_window=8,
        sliding_window_pattern=2,
        seed=3,
    )
    tensors = load_file(str(text / "model.safetensors"))
    renamed = {"model.language_model." + k.removeprefix("model."): v for k, v in tensors.items()}
    renamed["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3)
    renamed["model.multi_modal_projector.mm_input_projection_weight"] = torch.zeros(4, 4)
    multimodal = tmp_path / "multimodal"
    multimodal.mkdir()
    save_file(renamed, str(multimodal / "model.safetensors"))
    text_config = json.loads((text / "config.json").read_text())
    (multimodal / "config.json").write_text(
        json.dumps({"model_type": "gemma3", "text_config": text_config, "eos_token_id": [2]})
    )
    tokens = list(range(7, 30))
    expected = last_logits(build_runner(str(text), num_blocks=8, block_size=16), tokens)
    got = last_logits(build_runner(str(multimodal), num_blocks=8, block_size=16), tokens)
    torch.testing.assert_close(got, expected)


def test_a_multimodal_fp8_checkpoint_keeps_its_quantization(tmp_path: Path) -> None:
    """A Gemma3ForConditionalGeneration FP8 checkpoint states quantization_config beside text_config, not in
    it: the language model still loads as FP8 and gives the logits of its dequantized weights."""
    import transformers

    from ominix_worker.config import load_hf_config
    from ominix_worker.testing import write_fp8_checkpoint

    text = write_tiny_hf_model(
        tmp_path / "text", arch="gemma3_text", num_layers=4, sliding_window=8, sliding_window_pattern=2,
        with_tokenizer=False, vocab_size=96,
    )  # fmt: skip
    folder = write_fp8_checkpoint(text, tmp_path / "fp8", "block", block=16)
    text_config = json.loads((folder / "config.json").read_text())
    quantization = text_config.pop("quantization_config")
    outer = {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text_config,
        "quantization_config": quantization,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(outer))
    assert load_hf_config(folder).quantization == quantization
    tokens = [3 + (11 * i) % 90 for i in range(30)]
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder / "dequantized", dtype=torch.float32)
    with torch.no_grad():
        want = reference.eval()(torch.tensor([tokens])).logits[0, -1]
    got = last_logits(build_runner(str(folder), num_blocks=8, block_size=16), tokens)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


def test_hybrid_pools_give_the_window_what_it_needs_and_the_rest_to_the_global_layers() -> None:
    full, local = AttentionGroup(0, (5,)), AttentionGroup(12, (0, 1, 2, 3, 4))
    # Every running window fits (4 × (1 + 2) + 2 = 14 blocks), plus room to keep slid-out blocks cached
    # (4 windows per running request, 16 blocks, capped at a tenth of the memory: 24 × 6 / 10 / 5 = 2);
    # 24 × 6 - 16 × 5 = 64 for the global layer.
    assert group_block_counts((full, local), 24, 16, 4, 32) == (64, 16)
    # A large running cap: the four-window balance point bounds the window pool instead (plus the cache room
    # at its tenth of the memory: 2500 × 62 / 10 / 52 = 298 blocks).
    gemma_27b = (AttentionGroup(0, tuple(range(10))), AttentionGroup(1024, tuple(range(10, 62))))
    counts = group_block_counts(gemma_27b, 2500, 16, 256, 8192)
    assert counts[1] < 256 * 66 and counts[0] > 2 * 2500
    assert counts[0] * 10 + counts[1] * 52 <= 2500 * 62
    # gpt-oss-20b on an H100 (12 window layers of 128 tokens, 12 full; 256 running, 8,192-token steps): every
    # running window (256 × 10 + 512 = 3,072) and four more cached windows per request (8,192), within the
    # tenth of the memory (39,000 × 24 / 10 / 12 = 7,800).
    gpt_oss = (AttentionGroup(0, tuple(range(1, 24, 2))), AttentionGroup(128, tuple(range(0, 24, 2))))
    assert group_block_counts(gpt_oss, 39_000, 16, 256, 8192)[1] == 3_072 + 7_800
    # Never less than one window and a full step: a request's length is not bounded by the window pool.
    # (Five global layers and one with a 64-token window: the balance point alone would leave the window
    # 30 × 6 / (5 × 16 + 6) × 6 = 12 blocks; one window and a step is 22, the cache room adds 18, and no
    # group gets more than the uniform count.)
    mostly_global = (AttentionGroup(0, (1, 2, 3, 4, 5)), AttentionGroup(64, (0,)))
    assert group_block_counts(mostly_global, 30, 16, 4, 256)[1] == 30
    # With memory to spare: every running window (4 × 6 + 16 = 40) and four cached windows per request (64).
    assert group_block_counts(mostly_global, 300, 16, 4, 256)[1] == 40 + 4 * 4 * 4
    # Uniform layouts (all full, all windowed) keep the uniform count.
    assert group_block_counts((full,), 24, 16, 4, 32) == (24,)
    assert group_block_counts((local, AttentionGroup(4, (5,))), 24, 16, 4, 32) == (24, 24)
