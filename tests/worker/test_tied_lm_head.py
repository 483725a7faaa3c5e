"""``tie_word_embeddings`` checkpoints that store ``lm_head.weight``, tied as transformers 5 ties them on load
(``PreTrainedModel.tie_weights`` with the checkpoint's missing keys): both stored and different, the stored LM
head is kept (not tied); both stored and equal, tied; only the LM head stored, the embedding is tied to it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ominix_worker.ops import cpu_gemm
from ominix_worker.parallel import TensorParallel
from ominix_worker.runner import build_runner
from ominix_worker.testing import write_tiny_hf_model

from .hf_match import assert_matches_transformers

TIED = {
    "qwen3": dict(arch="qwen3", tie_word_embeddings=True, seed=4),
    "qwen3_moe": dict(
        arch="qwen3_moe",
        tie_word_embeddings=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        seed=5,
    ),
    "gemma3_text": dict(arch="gemma3_text", tie_word_embeddings=True, num_layers=4, sliding_window=6, seed=6),
}


def stored_as(folder: Path, layout: str) -> Path:
    """Rewrite the tied checkpoint ``folder``: "different" adds an lm_head.weight unlike the embedding,
    "equal" adds a copy of the embedding, "lm_head-only" stores the embedding as lm_head.weight alone."""
    tensors = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    embedding = tensors["model.embed_tokens.weight"]
    if layout == "different":
        generator = torch.Generator().manual_seed(7)
        tensors["lm_head.weight"] = 0.08 * torch.randn(embedding.shape, generator=generator)
    elif layout == "equal":
        tensors["lm_head.weight"] = embedding.clone()
    else:
        tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("layout", ["different", "equal", "lm_head-only"])
@pytest.mark.parametrize("model", list(TIED))
def test_a_tied_config_with_a_stored_lm_head_loads_as_transformers_loads_it(
    model: str, layout: str, tmp_path: Path
) -> None:
    folder = stored_as(write_tiny_hf_model(tmp_path / model, **TIED[model]), layout)
    runner = assert_matches_transformers(folder, attn_implementation="eager")
    tied = runner.model.lm_head.weight is runner.model.embed_tokens.weight
    assert tied == (layout != "different")


@pytest.mark.parametrize("layout", ["different", "lm_head-only"])
def test_each_rank_keeps_its_rows_of_the_stored_weights(
    layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under tensor parallelism (rank 1 of 2, vocabulary split) the untied LM head and the embedding tied to a
    stored LM head hold the rank's rows of the stored tensors."""
    folder = stored_as(write_tiny_hf_model(tmp_path / "m", **TIED["qwen3"]), layout)
    tensors = load_file(str(folder / "model.safetensors"))
    monkeypatch.setattr(cpu_gemm, "can_pack", lambda weight: False)  # keep the dense weights to read them

    class Group:  # stands in for a process group: loading never touches it
        pass

    tp = TensorParallel(1, 2, Group())  # type: ignore[arg-type]  # a stand-in process group
    model = build_runner(str(folder), num_blocks=4, tp=tp).model
    rows = slice(160, 320)  # the second half of the 320-token vocabulary
    head = tensors["lm_head.weight"][rows]
    embedding = tensors.get("model.embed_tokens.weight", tensors["lm_head.weight"])[rows]
    assert torch.equal(model.lm_head.weight, head)
    assert torch.equal(model.embed_tokens.weight, embedding)
    assert (model.lm_head.weight is model.embed_tokens.weight) == (layout == "lm_head-only")


@pytest.mark.parametrize("layout", ["different", "equal", "lm_head-only"])
@pytest.mark.parametrize("model", list(TIED))
def test_the_stated_parameter_count_is_the_loaded_models(model: str, layout: str, tmp_path: Path) -> None:
    """What the worker states (``ModelInfo.num_parameters``, from the config and whether the loaded LM head
    shares the embedding) is what the model holds: a stored, different head of a tied config counts."""
    folder = stored_as(write_tiny_hf_model(tmp_path / model, **TIED[model]), layout)
    runner = build_runner(str(folder))
    loaded = runner.model
    held = sum(p.numel() for p in loaded.parameters())  # a shared weight once
    tied = loaded.lm_head.weight is loaded.embed_tokens.weight
    assert loaded.lm_head_tied == tied
    assert loaded.num_parameters() == loaded.config.num_parameters(tied_lm_head=tied) == held
    head = loaded.config.vocab_size * loaded.config.hidden_size
    assert loaded.config.num_parameters() == held - (0 if tied else head)  # the config alone says tied
