"""gpt-oss (``GptOssForCausalLM``): the MoE decoder with attention sinks, biased experts and a biased router.

What differs from the Llama-family MoE (``models/moe.py``):

- attention: q/k/v/o projections with biases; a learned sink logit per query head joins each softmax
  denominator (``SinkAttention``, the backends' ``sinks=``); sliding-window and full-attention layers
  alternate as ``layer_types`` says; YaRN rotary embeddings (``llama.yarn_inv_freq``).
- router: a linear layer with a bias; top-k on the logits, softmax over the k kept (the same weights as a
  softmax over all experts renormalised over the top k, which ``select_experts`` computes).
- experts: biases on gate_up and down, and the clamped SwiGLU ``(up + 1) · gate · sigmoid(alpha · gate)``.
  The checkpoint stores ``gate_up_proj`` as (E, H, 2I) with gate and up columns interleaved (gate at even
  columns) and ``down_proj`` as (E, I, H); loading transposes them into the stacked layout every MoE layer
  here uses, ``w13`` (E, 2I, H) [gate rows | up rows] and ``w2`` (E, H, I).

Only bf16 / float checkpoints load: the released MXFP4 weights are refused when the config is read. One rank
only (tensor parallelism would split the biases and sinks; not implemented), no FP8.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from functools import partial

import torch
from torch import nn

from ominix_worker.attention.base import AttentionBackend, AttentionMetadata
from ominix_worker.config import ModelConfig
from ominix_worker.models.llama import Attention, DecoderLayer, RotaryEmbedding
from ominix_worker.models.moe import FusedExperts, MoeForCausalLM, SparseMoeBlock, fused_moe_ops
from ominix_worker.ops.moe_ref import clamped_swiglu, fused_experts_ref
from ominix_worker.parallel import SINGLE, TensorParallel, WeightSource, as_weight_source


class SinkAttention(Attention):
    """Attention whose softmax has one learned sink logit per query head (no value)."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__(config, backend, rotary, tp)
        if not backend.supports_sinks:
            raise ValueError(f"the {backend.name} attention backend has no attention sinks ({config.arch})")
        self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.forward(q, kv_cache, meta, self.scale, kv_scales=self.kv_scales, sinks=self.sinks)


class GptOssExperts(FusedExperts):
    """gpt-oss's experts: ``FusedExperts`` stacks plus biases ``w13_bias`` (E, 2I) [gate | up] and ``w2_bias``
    (E, H), and the clamped SwiGLU. CPU: the reference; CUDA: the fused MoE's align and grouped GEMMs with the
    biases and activation between them (``ops/biased_moe.py``)."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float, limit: float
    ) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size)
        self.alpha = alpha
        self.limit = limit
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
        self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size))

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(gate_up, self.alpha, self.limit)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if fused_moe_ops(x) is not None:
            from ominix_worker.ops.biased_moe import clamped_swiglu_cuda, fused_experts_biased

            return fused_experts_biased(
                x, self.w13_weight, self.w2_weight, self.w13_bias, self.w2_bias, topk_weights, topk_ids,
                partial(clamped_swiglu_cuda, alpha=self.alpha, limit=self.limit),
            )  # fmt: skip
        return fused_experts_ref(
            x,
            lambda e: (self.w13_weight[e], self.w2_weight[e]),
            self.num_experts,
            topk_weights,
            topk_ids,
            self.activation,
            lambda e: (self.w13_bias[e], self.w2_bias[e]),
        )

    def use_fp8(self, block: tuple[int, int] | None, name: str = "experts") -> None:
        raise ValueError(f"gpt-oss experts ({name}) have no FP8 path")

    def quantize_fp8(self, block: tuple[int, int] | None) -> None:
        raise ValueError("gpt-oss experts have no FP8 path (--quantization fp8)")

    def load_stack(self, part: str, source: WeightSource) -> str:
        """Copy one of the checkpoint's stacked expert tensors (``gate_up_proj``, ``gate_up_proj_bias``,
        ``down_proj``, ``down_proj_bias``); returns its load key."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        expected = {
            "gate_up_proj": (e, h, 2 * i),
            "gate_up_proj_bias": (e, 2 * i),
            "down_proj": (e, i, h),
            "down_proj_bias": (e, h),
        }[part]
        if tuple(source.shape) != expected:
            raise ValueError(f"shape {tuple(source.shape)} != expected {expected}")
        tensor = source.read()
        with torch.no_grad():
            if part == "gate_up_proj":  # (E, H, 2I), gate | up interleaved by column → (E, 2I, H) [gate | up]
                self.w13_weight.copy_(
                    torch.cat((tensor[..., 0::2], tensor[..., 1::2]), dim=-1).transpose(1, 2)
                )
                return "w13_weight"
            if part == "gate_up_proj_bias":
                self.w13_bias.copy_(torch.cat((tensor[..., 0::2], tensor[..., 1::2]), dim=-1))
                return "w13_bias"
            if part == "down_proj":  # (E, I, H) → (E, H, I)
                self.w2_weight.copy_(tensor.transpose(1, 2))
                return "w2_weight"
            self.w2_bias.copy_(tensor)
            return "w2_bias"

    def load_keys(self) -> set[str]:
        return {"w13_weight", "w13_bias", "w2_weight", "w2_bias"}

    def init_dummy_weights(self, seed: int) -> None:
        super().init_dummy_weights(seed)
        generator = torch.Generator(device=self.w13_bias.device).manual_seed(seed * 1_000_003 + 7)
        with torch.no_grad():
            self.w13_bias.normal_(0.0, 0.02, generator=generator)
            self.w2_bias.normal_(0.0, 0.02, generator=generator)


class GptOssMoeBlock(SparseMoeBlock):
    """Biased router and ``GptOssExperts``; routing as ``SparseMoeBlock`` (softmax, top-k renormalised)."""

    router_bias = True

    def build_experts(self, config: ModelConfig, tp: TensorParallel) -> FusedExperts:
        return GptOssExperts(
            config.num_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            config.swiglu_alpha,
            config.swiglu_limit,
        )


# layers.<i>.mlp.experts.<stacked tensor>; MXFP4 checkpoints name theirs <tensor>_blocks / <tensor>_scales.
_STACK_RE = re.compile(
    r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$"
)
_MXFP4_RE = re.compile(r"\.mlp\.experts\.\w+_(blocks|scales)$")


class GptOssForCausalLM(MoeForCausalLM):
    moe_block_class = GptOssMoeBlock
    single_rank_reason = (
        "gpt-oss runs on one rank: its sinks and expert biases are not split by tensor parallelism"
    )

    def build_layer(
        self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel, layer_index: int
    ) -> nn.Module:
        mlp = self.build_mlp(config, layer_index)
        return DecoderLayer(config, backend, self.rotary, tp, mlp, attention_class=SinkAttention)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | WeightSource]]) -> set[str]:
        loaded: set[str] = set()
        rest = self._load_expert_stacks(weights, loaded)
        loaded |= super().load_weights(rest)
        return loaded

    def _load_expert_stacks(
        self, weights: Iterable[tuple[str, torch.Tensor | WeightSource]], loaded: set[str]
    ) -> Iterator[tuple[str, torch.Tensor | WeightSource]]:
        """Loads the stacked expert tensors here; yields the rest (the router renamed to ``gate``)."""
        for hf_name, weight in weights:
            name = hf_name.removeprefix("model.")
            if _MXFP4_RE.search(name):
                raise ValueError(f"{hf_name}: MXFP4 expert weights are not supported (use a bf16 checkpoint)")
            match = _STACK_RE.match(name)
            if match is None:
                yield name.replace(".mlp.router.", ".mlp.gate."), weight
                continue
            layer, part = int(match.group(1)), match.group(2)
            experts = self._moe_block(layer).experts
            assert isinstance(experts, GptOssExperts)
            try:
                key = experts.load_stack(part, as_weight_source(weight))
            except ValueError as exc:
                raise ValueError(f"{hf_name}: {exc}") from None
            loaded.add(f"layers.{layer}.mlp.experts.{key}")


__all__ = ["GptOssExperts", "GptOssForCausalLM", "GptOssMoeBlock", "SinkAttention"]
