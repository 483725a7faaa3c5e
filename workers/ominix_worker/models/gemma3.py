"""Gemma 3 text decoder: the Llama-family decoder with Gemma's layer structure and its hybrid attention.

What differs from Llama, as Hugging Face's Gemma3ForCausalLM computes it:
- RMSNorm scales by ``1 + weight`` (weights are stored centred on 0) and multiplies before casting back;
- four norms per layer: input, post-attention, pre-feedforward, post-feedforward (the attention and MLP
  outputs are normalised before their residual adds); q/k RMSNorm per head;
- the embedding is scaled by sqrt(hidden_size), rounded to the run dtype;
- a GELU (tanh approximation) gated MLP;
- attention scale ``query_pre_attn_scalar ** -0.5``; optional tanh soft-capping of the final logits. The
  config's ``attn_logit_softcapping`` is read by neither: Hugging Face's Gemma 3 never applies it (Gemma 2
  did), and the released Gemma 3 configs leave it null;
- interleaved layers: sliding-window ("local") layers rotate with ``rope_local_theta`` and no scaling, global
  layers with ``rope_theta`` and the config's scaling. Each kind is one KV group of the layout.

A Gemma3ForConditionalGeneration checkpoint loads its language model (the vision tower is skipped).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ominix_worker.attention.base import AttentionBackend, AttentionMetadata
from ominix_worker.config import ModelConfig
from ominix_worker.models.llama import (
    MLP,
    Attention,
    LlamaForCausalLM,
    RotaryEmbedding,
    kept_rows,
)
from ominix_worker.parallel import SINGLE, TensorParallel, WeightSource

# Prefixes of a multimodal checkpoint's language model (transformers 5, then earlier) and of what is skipped.
_LANGUAGE_MODEL_PREFIXES = ("model.language_model.", "language_model.model.")
_SKIPPED_PREFIXES = (
    "vision_tower.",
    "model.vision_tower.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
)


class GemmaRMSNorm(nn.Module):
    """RMSNorm with the scale ``1 + weight``, all in float32, cast back at the end."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(MLP):
    """The gated MLP with GELU (tanh approximation) instead of SiLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(Attention):
    """Llama attention with Gemma's q/k norms and query_pre_attn_scalar scale."""

    fuse_qk_norm = False  # Gemma's norms scale by (1 + weight) in float32: not the fused kernel's arithmetic

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding, tp: TensorParallel
    ) -> None:
        super().__init__(config, backend, rotary, tp)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding, tp: TensorParallel
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = Gemma3Attention(config, backend, rotary, tp)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = GemmaMLP(config, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), positions, kv_cache, meta, keep=keep)
        hidden = kept_rows(hidden, keep) + self.post_attention_layernorm(attn)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        max_positions: int | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__(config, backend, max_positions, tp)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # Local layers rotate with their own base and without the global layers' scaling.
        local = replace(config, rope_theta=config.rope_local_theta or config.rope_theta, rope_scaling={})
        self.local_rotary = RotaryEmbedding(local, self.rotary.max_positions)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, Gemma3DecoderLayer)  # build_layer's
            if config.layer_window(i):
                layer.self_attn.rotary = self.local_rotary
        self.embed_scale = config.hidden_size**0.5

    def build_layer(
        self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel, layer_index: int
    ) -> nn.Module:
        return Gemma3DecoderLayer(config, backend, self.rotary, tp)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metas: Sequence[AttentionMetadata],
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # The scale rounded to the run dtype first, as the reference does; a host float, so that CUDA-graph
        # capture sees no host-to-device copy.
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype).item()
        return self.norm(self._run_layers(hidden, positions, kv_caches, metas, keep))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | WeightSource]]) -> set[str]:
        return super().load_weights(_language_model_weights(weights))

    def init_dummy_weights(self, seed: int = 0) -> None:
        super().init_dummy_weights(seed)
        with torch.no_grad():  # Gemma's norms scale by 1 + weight: a unit scale is a zero weight
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.zero_()

    def post_load(self, device: torch.device) -> None:
        super().post_load(device)
        self.local_rotary.build(device)


def _language_model_weights(
    weights: Iterable[tuple[str, torch.Tensor | WeightSource]],
) -> Iterable[tuple[str, torch.Tensor | WeightSource]]:
    """Hugging Face names of a text-only checkpoint; a multimodal one's language model renamed, the rest skipped."""
    for name, weight in weights:
        if name.startswith(_SKIPPED_PREFIXES):
            continue
        for prefix in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(prefix):
                name = "model." + name.removeprefix(prefix)
                break
        yield name.removeprefix("language_model."), weight


__all__ = ["Gemma3ForCausalLM", "GemmaRMSNorm"]
