"""MoE models from GGUF files (``qwen3moe``, ``qwen2moe`` and Mixtral as ``llama`` with experts): files written
here with the gguf package from tiny random transformers models (float32 tensors, experts stacked per layer as
llama.cpp stores them, Q/K rows permuted for ``llama``) give transformers' logits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from ominix_runtime.contract import DecodeStep, NewRequestData, SamplingParams
from ominix_worker.runner import build_runner

gguf = pytest.importorskip("gguf")

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
           "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}  # fmt: skip


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert-time Q/K row order for ``llama`` files."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder: Path, path: Path) -> Path:
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(folder)
    model_type = config.model_type
    arch = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}[model_type]
    tensors = load_file(str(folder / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), arch)
    num_experts = getattr(config, "num_experts", None) or config.num_local_experts
    writer.add_uint32(f"{arch}.block_count", config.num_hidden_layers)
    writer.add_uint32(f"{arch}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", config.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", config.num_key_value_heads)
    writer.add_uint32(f"{arch}.attention.key_length", config.head_dim)
    writer.add_uint32(f"{arch}.context_length", 1024)
    writer.add_float32(f"{arch}.rope.freq_base", float(config.rope_parameters["rope_theta"]))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_uint32(f"{arch}.expert_count", num_experts)
    writer.add_uint32(f"{arch}.expert_used_count", config.num_experts_per_tok)
    if model_type != "mixtral":
        writer.add_uint32(f"{arch}.expert_feed_forward_length", config.moe_intermediate_size)
        writer.add_bool(f"{arch}.expert_weights_norm", bool(config.norm_topk_prob))
    if model_type == "qwen2_moe":
        writer.add_uint32(f"{arch}.expert_shared_feed_forward_length", config.shared_expert_intermediate_size)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        if name in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
            out[{"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = tensor  # fmt: skip
            continue
        _, layer, rest = name.split(".", 2)
        if ".experts." in rest:
            _, _, expert, projection, _ = rest.split(".")
            experts.setdefault((int(layer), _EXPERT[projection]), {})[int(expert)] = tensor
            continue
        if arch == "llama" and rest == "self_attn.q_proj.weight":
            tensor = _permute(tensor, config.num_attention_heads)
        elif arch == "llama" and rest == "self_attn.k_proj.weight":
            tensor = _permute(tensor, config.num_key_value_heads)
        elif rest == "mlp.shared_expert_gate.weight":
            tensor = tensor.reshape(-1)
        out[f"blk.{layer}.{_LAYER[rest]}"] = tensor
    for (layer, stacked), per_expert in experts.items():
        out[f"blk.{layer}.{stacked}.weight"] = torch.stack([per_expert[e] for e in range(num_experts)])
    for name, tensor in out.items():
        writer.add_tensor(name, np.ascontiguousarray(tensor.float().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("model", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_gguf_matches_transformers(
    model: str, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = tiny_model_dir(model)
    if model == "qwen3_moe":  # every layer of a GGUF MoE file is sparse: no mlp_only_layers here
        from ominix_worker.testing import write_tiny_hf_model

        folder = write_tiny_hf_model(
            tmp_path / "all_sparse", arch="qwen3_moe", num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, seed=9, with_tokenizer=False,
        )  # fmt: skip
    path = write_gguf(folder, tmp_path / f"{model}.gguf")
    runner = build_runner(str(path), num_blocks=8)
    assert runner.config.is_moe and runner.config.arch == model
    rows: list[torch.Tensor] = []
    compute = runner.model.compute_logits
    runner.model.compute_logits = lambda h: rows.append(compute(h)) or rows[-1]  # type: ignore[method-assign]  # records the logits
    tokens = [(11 * i + 5) % 300 + 3 for i in range(19)]
    greedy = SamplingParams(temperature=0.0)
    runner.execute_step(DecodeStep(1, new_requests=[NewRequestData("a", tokens, greedy, [2, 4], 0, 19, 0)]))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0, -1]
    assert ((rows[0][0] - want).abs().max() / want.abs().max()).item() < 1e-4
