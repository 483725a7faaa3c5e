"""gpt-oss's MoE layer on the CPU reference path, against Hugging Face's GptOssMLP with the same weights.

The checkpoint layout (gate/up interleaved by column, (E, H, 2I) and (E, I, H) stacks) is loaded through the
model's own loader; inputs are scaled so that the SwiGLU clamps engage on both sides.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from ominix_worker.config import ModelConfigError, config_from_hf_dict
from ominix_worker.models.gpt_oss import GptOssMoeBlock
from ominix_worker.ops.moe_ref import clamped_swiglu
from ominix_worker.parallel import TensorWeight

HIDDEN, INTER = 48, 40


def hf_mlp(num_experts: int, top_k: int, seed: int) -> GptOssMLP:
    config = transformers.GptOssConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        vocab_size=300,
    )
    torch.manual_seed(seed)
    mlp = GptOssMLP(config).float().eval()
    with torch.no_grad():
        for param in mlp.parameters():
            param.normal_(0.0, 0.3)
    return mlp


def our_block(mlp: GptOssMLP, num_experts: int, top_k: int) -> GptOssMoeBlock:
    raw = {
        "model_type": "gpt_oss",
        "vocab_size": 300,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "num_local_experts": num_experts,
        "num_experts_per_tok": top_k,
        "attention_bias": True,
    }
    block = GptOssMoeBlock(config_from_hf_dict(raw)).float()
    experts = block.experts
    for part in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        experts.load_stack(part, TensorWeight(getattr(mlp.experts, part).detach()))  # type: ignore[operator]
    with torch.no_grad():
        block.gate.weight.copy_(mlp.router.weight)
        block.gate.bias.copy_(mlp.router.bias)
    return block


@pytest.mark.parametrize(("num_experts", "top_k", "tokens"), [(8, 2, 37), (32, 4, 64), (4, 1, 5), (6, 6, 9)])
def test_block_matches_hugging_face(num_experts: int, top_k: int, tokens: int) -> None:
    mlp = hf_mlp(num_experts, top_k, seed=num_experts + top_k)
    block = our_block(mlp, num_experts, top_k)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)) * 2.0
    with torch.no_grad():
        want, _ = mlp(x.unsqueeze(0))
        got = block(x)
        # The clamps engage: some gates above the limit, some up projections beyond it both ways.
        gate_up = (
            torch.einsum("th,ehn->etn", x, mlp.experts.gate_up_proj) + mlp.experts.gate_up_proj_bias[:, None]
        )
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    assert (gate > 7.0).any() and (up > 7.0).any() and (up < -7.0).any()
    torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-4)


def test_a_layout_mistake_would_show() -> None:
    """Reading gate_up as [gate | up] halves (not interleaved) gives another answer: the test above can fail."""
    mlp = hf_mlp(8, 2, seed=3)
    block = our_block(mlp, 8, 2)
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, _ = mlp(x.unsqueeze(0))
        w13 = mlp.experts.gate_up_proj.transpose(1, 2).contiguous()  # halves, no de-interleave
        block.experts.w13_weight.copy_(w13)
        block.experts.w13_bias.copy_(mlp.experts.gate_up_proj_bias)
        wrong = block(x)
    assert (wrong - want[0]).abs().max() > 1e-2


def test_clamped_swiglu_formula() -> None:
    gate = torch.tensor([[-10.0, -1.0, 0.5, 9.0]])
    up = torch.tensor([[-9.0, 0.0, 2.0, 8.0]])
    got = clamped_swiglu(torch.cat((gate, up), dim=-1), alpha=1.702, limit=7.0)
    g = gate.clamp(max=7.0)
    u = up.clamp(-7.0, 7.0)
    torch.testing.assert_close(got, (u + 1) * g * torch.sigmoid(1.702 * g))
    assert got[0, 3] == pytest.approx(8.0 * 7.0 * torch.sigmoid(torch.tensor(1.702 * 7.0)).item())


def test_stack_shapes_are_checked() -> None:
    mlp = hf_mlp(4, 2, seed=0)
    block = our_block(mlp, 4, 2)
    with pytest.raises(ValueError, match="expected"):
        block.experts.load_stack("down_proj", TensorWeight(torch.zeros(4, HIDDEN, INTER)))


def test_mxfp4_checkpoints_are_refused() -> None:
    raw = {
        "model_type": "gpt_oss",
        "vocab_size": 300,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]},
    }
    with pytest.raises(ModelConfigError, match="MXFP4"):
        config_from_hf_dict(raw)
