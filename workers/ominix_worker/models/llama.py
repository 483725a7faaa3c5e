"""One Llama-family decoder over flattened (ragged) tokens and a paged KV cache.

Covers Llama 2/3/3.1 (rope scaling), Mistral, SmolLM, Qwen2/2.5 (QKV bias) and Qwen3 (per-head q/k
RMSNorm). Q/K/V and gate/up projections are fused into one matmul each; ``load_weights`` takes Hugging
Face parameter names and writes each shard into its slice of the fused weight.

Tensor parallel (``tp``, Megatron-style): QKV and gate/up are column-parallel, o_proj and down row-parallel
(one all-reduce each), the embedding and LM head vocab-parallel; each rank keeps its query heads and their KV
heads (a replicated KV head when there are fewer KV heads than ranks). With ``SINGLE`` nothing is split.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from types import ModuleType
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from ominix_worker.attention.base import UNIT_KV_SCALES, AttentionBackend, AttentionMetadata
from ominix_worker.config import ModelConfig
from ominix_worker.parallel import (
    SINGLE,
    ColumnParallelLinear,
    ParallelLMHead,
    ParallelModule,
    RowParallelLinear,
    ShardRange,
    TensorParallel,
    VocabParallelEmbedding,
    WeightSource,
    as_weight_source,
)

_FUSED: ModuleType | None = None
_FUSED_TRIED = False


def cuda_ops(x: torch.Tensor) -> ModuleType | None:
    """The Triton fused ops (``ominix_worker.ops.fused``) for CUDA tensors; None elsewhere or without triton.

    CPU keeps the reference formulas below; on CUDA each fused op replaces several launches and passes.
    """
    global _FUSED, _FUSED_TRIED
    if not x.is_cuda:
        return None
    if not _FUSED_TRIED:
        _FUSED_TRIED = True
        try:
            from ominix_worker.ops import fused

            _FUSED = fused
        except ImportError:
            _FUSED = None
    return _FUSED


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cuda_ops(x)
        if ops is not None:
            return ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        # Normalise in float32 and scale in the run dtype, as the reference implementation does.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_dim / 2,) and the attention scaling factor for the config's rope type."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return yarn_inv_freq(config, inv_freq)
    if rope_type == "freq_factors":  # GGUF rope_freqs tensor: each frequency divided by its factor
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} factors, expected {inv_freq.numel()}")
        return inv_freq / factors, 1.0
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3, yarn)")


def yarn_inv_freq(config: ModelConfig, inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss, as Hugging Face computes it): dimensions that turn fewer than ``beta_slow`` times over
    the original context are interpolated by ``factor``, those that turn more than ``beta_fast`` times are
    kept, a linear ramp blends the band between; cos/sin are scaled by the attention factor
    (0.1 · ln(factor) + 1 unless stated)."""
    scaling = config.rope_scaling
    dim = config.head_dim
    base = config.rope_theta
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else config.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide it by factor)
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, indexed per token."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.cos_sin: torch.Tensor | None = None
        # The last step's positions and their (T, 1, head_dim) cos and signed sin: every layer reuses them.
        self._looked_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def build(self, device: torch.device) -> None:
        inv_freq, attention_scaling = rope_inv_freq(self.config)
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_sin = torch.stack((emb.cos() * attention_scaling, emb.sin() * attention_scaling)).to(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.cos_sin is not None, "RotaryEmbedding.build() was not called"
        ops = cuda_ops(q)
        if ops is not None:  # in place on the (strided) views of the fused QKV output
            ops.rotary_in_place(q, positions, self.cos_sin)
            ops.rotary_in_place(k, positions, self.cos_sin)
            return q, k
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x (T, heads, head_dim) rotated out of place: x·cos + rotate_half(x)·sin.

        rotate_half(x)·sin is computed as roll(x)·[-sin₁, sin₂]; negating the factor instead of the operand
        gives the same products bit for bit, with one op where the concatenation took four.
        """
        cos, signed_sin = self._tables(positions, x.dtype)
        return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        looked_up = self._looked_up
        if looked_up is not None and looked_up[0] is positions and looked_up[1].dtype == dtype:
            return looked_up[1], looked_up[2]
        assert self.cos_sin is not None, "RotaryEmbedding.build() was not called"
        cos, sin = self.cos_sin[:, positions].unsqueeze(2).to(dtype)  # (T, 1, head_dim) each
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        self._looked_up = (positions, cos, signed_sin)
        return cos, signed_sin


class Attention(nn.Module):
    # With qk_norm on CUDA, the Q/K norms (plain RMSNorm: weight · normalised x, rounded as ``RMSNorm``) and RoPE
    # run as one fused in-place kernel; a subclass whose norms differ turns this off.
    fuse_qk_norm = True
    # RMSNorm here; a subclass may hold norms of its own (Gemma 3's).
    q_norm: nn.Module | None
    k_norm: nn.Module | None

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        heads = tp.split(config.num_heads, "the number of attention heads")
        kv_heads = tp.kv_heads(config.num_kv_heads, config.num_heads)
        hd = config.head_dim
        self.num_heads = heads.size
        self.num_kv_heads = kv_heads.size
        self.head_dim = hd
        self.q_size = heads.size * hd
        self.kv_size = kv_heads.size * hd
        self.scale = hd**-0.5
        kv_rows = ShardRange(kv_heads.start * hd, self.kv_size)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [config.q_size, config.kv_size, config.kv_size],
            [ShardRange(heads.start * hd, self.q_size), kv_rows, kv_rows],
            bias=config.qkv_bias,
        )
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, bias=config.o_proj_bias, tp=tp)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.backend = backend
        self.rotary = rotary
        # FP8 KV cache scales of this layer (``load_kv_scale``; the checkpoint's k_scale / v_scale).
        self.kv_scales = UNIT_KV_SCALES

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's attention output after o_proj: a row per token, or per index of ``keep`` (the rows the
        step still needs; every token's K and V are stored either way)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        ops = cuda_ops(qkv)
        cos_sin = self.rotary.cos_sin
        if (
            ops is not None
            and cos_sin is not None
            and self.q_norm is None
            and self.backend.takes_fused_rotary_store
        ):
            # One launch rotates Q in place and stores rotated K and V: a decode step's layer has one small
            # kernel fewer (K is never written back; attention reads it from the cache).
            heads = qkv[:, : self.q_size + self.kv_size].view(
                num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
            )
            ops.rotary_store_kv(
                heads, v, positions, cos_sin, self.num_heads, kv_cache, meta.slot_mapping,
                self.kv_scales.k, self.kv_scales.v,
            )  # fmt: skip
            q = heads[:, : self.num_heads]
        else:
            q, k = self._normed_rotated_qk(qkv, positions)
            self.backend.write_kv(kv_cache, k, v, meta, self.kv_scales)
        out = self.attend(q, kv_cache, meta).reshape(num_tokens, self.q_size)
        return self.o_proj(kept_rows(out, keep))

    def _normed_rotated_qk(
        self, qkv: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Q (T, heads, head_dim) and K (T, kv_heads, head_dim) of the QKV output, normalised (qk_norm) and
        rotated."""
        heads = qkv[:, : self.q_size + self.kv_size].view(
            qkv.shape[0], self.num_heads + self.num_kv_heads, self.head_dim
        )
        split = [self.num_heads, self.num_kv_heads]
        ops = cuda_ops(qkv)
        cos_sin = self.rotary.cos_sin
        if ops is not None and cos_sin is not None and (self.q_norm is None or self.fuse_qk_norm):
            # Q and K heads sit side by side in each QKV row: one in-place launch (normalises and) rotates both.
            if self.q_norm is not None and self.k_norm is not None:
                ops.qk_norm_rotary_in_place(
                    heads, positions, cos_sin, self.num_heads, self.q_norm.weight, self.k_norm.weight,
                    self.q_norm.eps,
                )  # fmt: skip
            else:
                ops.rotary_in_place(heads, positions, cos_sin)
            q, k = heads.split(split, dim=1)
            return q, k
        if ops is None and self.q_norm is None:
            # Elsewhere than CUDA, the same in one pass over Q and K side by side (the per-op cost dominates
            # at decode sizes).
            q, k = self.rotary.rotate(positions, heads).split(split, dim=1)
            return q, k
        q, k = heads.split(split, dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rotary(positions, q, k)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The backend's attention of this layer's queries over its cache (subclasses add sinks)."""
        return self.backend.forward(q, kv_cache, meta, self.scale, kv_scales=self.kv_scales)

    def load_kv_scale(self, which: str, source: WeightSource) -> None:
        """One of the layer's FP8 KV scales ("k" or "v"): a scalar, the same on every rank."""
        tensor = source.read()
        if tensor.numel() != 1:
            raise ValueError(
                f"a {which}_scale of shape {tuple(tensor.shape)}: only one scale per layer is supported"
            )
        value = float(tensor.float().reshape(()))
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{which}_scale {value} is not a positive number")
        self.kv_scales = replace(self.kv_scales, **{which: value})


class MLP(nn.Module):
    """SiLU-gated MLP; ``reduce_results=False`` returns the rank's partial sum (the caller reduces it)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE, reduce_results: bool = True) -> None:
        super().__init__()
        size = config.intermediate_size
        self.intermediate_size = tp.split(size, "intermediate_size").size
        self.gate_up_proj = ColumnParallelLinear.split_evenly(config.hidden_size, [size, size], False, tp)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False, tp=tp, reduce=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cuda_ops(x)
        if ops is not None:
            return self.down_proj.forward_gated(self.gate_up_proj(x), ops.silu_and_mul)
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        tp: TensorParallel = SINGLE,
        mlp: nn.Module | None = None,
        attention_class: type[Attention] = Attention,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention_class(config, backend, rotary, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp if mlp is not None else MLP(config, tp)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's output rows: every token's, or (``keep``) only those indices' (see ``last_layer_rows``)."""
        attn = self.self_attn(self.input_layernorm(hidden), positions, kv_cache, meta, keep=keep)
        hidden = kept_rows(hidden, keep) + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


# Hugging Face shard name → (fused parameter name, shard index) within a layer.
_FUSED_SHARDS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


# FP8 KV cache scales as FP8 checkpoints ship them: ``self_attn.k_scale`` (also ``self_attn.attn.k_scale``) or,
# from older exporters, the K/V projections' ``output_scale``.
_KV_SCALE_RE = re.compile(r"^layers\.(\d+)\.self_attn\.(?:attn\.)?([kv])(?:_scale|_proj\.output_scale)$")


def last_layer_rows(num_layers: int, keep: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Per layer, the rows it passes on past its attention: every token's (None) but in the last layer, where
    only ``keep``'s are read after the forward (the rows whose logits are sampled). Every layer's attention
    still stores every token's K and V, so only the last layer's o_proj, MLP and norms shrink: in a prompt step
    of thousands of tokens and a few hundred sampled rows, about one layer in ``num_layers`` of the GEMMs."""
    return (None,) * (num_layers - 1) + (keep,)


def kept_rows(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``x``'s rows at ``keep`` (a new tensor), or ``x`` itself when every row is kept (None)."""
    return x if keep is None else x.index_select(0, keep)


class LlamaForCausalLM(nn.Module):
    # Why an architecture cannot be split by tensor parallelism (None: it can); a subclass states it.
    single_rank_reason: ClassVar[str | None] = None
    # Its eager steps can be captured in pieces cut at each layer's one attention call (``piecewise_graph``); a
    # subclass whose layers attend otherwise turns it off.
    piecewise_graphs: ClassVar[bool] = True
    # Its pieces' time at a bucket's row count stands for any step padded there (``PiecewiseGraphs.time_buckets``
    # replays them with padding rows only), so a step may be sent to a larger, faster bucket.
    piecewise_bucket_timing: ClassVar[bool] = True
    norm: nn.Module  # RMSNorm here; a subclass may hold a norm of its own (Gemma 3's)

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        max_positions: int | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        if tp.size > 1 and self.single_rank_reason is not None:
            raise ValueError(self.single_rank_reason)
        super().__init__()
        self.config = config
        self.tp = tp
        self.rotary = RotaryEmbedding(config, max_positions or config.max_position_embeddings)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            self.build_layer(config, backend, tp, i) for i in range(config.num_layers)
        )
        # The KV groups of the layout (layers that attend alike share a block table) and each layer's group:
        # the forward takes one AttentionMetadata per group and hands each layer its group's.
        self.attention_groups = config.attention_groups(backend.supports_sliding_window)
        group_of = {  # a compressed group's layers keep their raw KV in a raw group (models/compressed.py)
            layer: g
            for g, group in enumerate(self.attention_groups)
            if not group.compress_ratio
            for layer in group.layers
        }
        self.layer_kv_groups = tuple(group_of[i] for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Called after each layer's launch while set (the runner's poll for an earlier step's result during a
        # long eager launch); host work only, never inside a captured graph.
        self.between_layers: Callable[[], None] | None = None

    def build_layer(
        self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel, layer_index: int
    ) -> nn.Module:
        """Decoder layer ``layer_index``; subclasses with another layer structure (Gemma 3) override it."""
        return DecoderLayer(config, backend, self.rotary, tp, self.build_mlp(config, layer_index))

    def build_mlp(self, config: ModelConfig, layer_index: int) -> nn.Module | None:
        """The MLP of layer ``layer_index``; None: the dense ``MLP``. Subclasses (MoE) override it."""
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metas: Sequence[AttentionMetadata],
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Flattened tokens (T,) → final hidden states (T, hidden), normalised; with ``keep`` (row indices,
        repeats allowed) only those rows, in that order: the last layer runs o_proj and its MLP on them alone
        (``last_layer_rows``).

        ``metas``: one AttentionMetadata per KV group (``attention_groups``); layer i reads
        ``metas[layer_kv_groups[i]]``, whose block tables and window are its group's.
        """
        hidden = self.embed_tokens(input_ids)
        ops = cuda_ops(hidden)
        if ops is not None:
            return self._forward_fused(ops, hidden, positions, kv_caches, metas, keep)
        return self.norm(self._run_layers(hidden, positions, kv_caches, metas, keep))

    def _run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metas: Sequence[AttentionMetadata],
        keep: torch.Tensor | None,
    ) -> torch.Tensor:
        """The decoder layers over the embedded tokens, unfused: the last on ``keep``'s rows past its attention
        (``last_layer_rows``), ``between_layers`` after each."""
        between = self.between_layers
        for layer, kv_cache, g, rows in zip(
            self.layers, kv_caches, self.layer_kv_groups, last_layer_rows(len(self.layers), keep), strict=True
        ):
            hidden = layer(hidden, positions, kv_cache, metas[g], rows)
            if between is not None:
                between()
        return hidden

    def _forward_fused(
        self,
        ops: ModuleType,
        residual: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metas: Sequence[AttentionMetadata],
        keep: torch.Tensor | None,
    ) -> torch.Tensor:
        """The same sums as the layers' forward, with each residual add fused into the next RMSNorm."""
        eps = self.config.rms_norm_eps
        # DecoderLayers by construction: the models whose build_layer makes other layers (Gemma 3, compressed
        # attention) have forwards of their own.
        layers = cast(list[DecoderLayer], list(self.layers))
        norm_weights = [layer.input_layernorm.weight for layer in layers[1:]] + [self.norm.weight]
        hidden = ops.rms_norm(residual, layers[0].input_layernorm.weight, eps)
        groups = self.layer_kv_groups
        between = self.between_layers
        rows_of = last_layer_rows(len(layers), keep)
        for layer, kv_cache, next_weight, g, rows in zip(
            layers, kv_caches, norm_weights, groups, rows_of, strict=True
        ):
            attn = layer.self_attn(hidden, positions, kv_cache, metas[g], keep=rows)
            # A copy when rows are kept: the fused add below updates it in place.
            residual = kept_rows(residual, rows)
            hidden = ops.fused_add_rms_norm(attn, residual, layer.post_attention_layernorm.weight, eps)
            hidden = ops.fused_add_rms_norm(layer.mlp(hidden), residual, next_weight, eps)
            if between is not None:
                between()
        return hidden

    @property
    def lm_head_tied(self) -> bool:
        """The LM head shares the embedding's weight (a tied config may load a stored, different head)."""
        return self.lm_head.weight is self.embed_tokens.weight

    def num_parameters(self) -> int:
        """The whole model's parameters, every rank's together, the LM head counted as loaded."""
        return self.config.num_parameters(tied_lm_head=self.lm_head_tied)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary on every rank (gathered under tensor parallelism)."""
        return self.lm_head.logits(hidden).float()

    # ---- weights ----------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | WeightSource]]) -> set[str]:
        """Copy Hugging Face-named tensors into this module; returns the parameter names that were set.

        Sharded layers read only this rank's slice of each tensor (``WeightSource``); the others copy it whole.

        Tied embeddings (``tie_word_embeddings``) are tied as transformers ties them on load: a checkpoint
        that stores ``lm_head.weight`` too keeps it when it differs from the embedding (untied), and one that
        stores only ``lm_head.weight`` ties the embedding to it.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        modules = dict(self.named_modules(remove_duplicate=False))
        loaded: set[str] = set()
        for hf_name, weight in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head_tied:
                self._untie_lm_head()  # its own weight until both are loaded (``_tie_loaded_weights``)
                params[name] = self.lm_head.weight
            kv_scale = _KV_SCALE_RE.match(name)
            if (
                kv_scale is not None
            ):  # optional: a cache in the run dtype ignores them, FP8 KV defaults to 1.0
                layer, which = int(kv_scale.group(1)), kv_scale.group(2)
                attention = self.layers[layer].self_attn
                assert isinstance(attention, Attention)  # every layer class keeps its Attention there
                try:
                    attention.load_kv_scale(which, as_weight_source(weight))
                except ValueError as exc:
                    raise ValueError(f"{hf_name}: {exc}") from None
                continue
            target_name, shard = name, None
            for hf_part, (fused, index) in _FUSED_SHARDS.items():
                if f".{hf_part}." in f".{name}":
                    target_name, shard = name.replace(hf_part, fused), index
                    break
            module_name, _, param_name = target_name.rpartition(".")
            if target_name not in params:
                if param_name == "weight_scale_inv" and f"{module_name}.weight" in params:
                    raise KeyError(
                        f"unexpected weight {hf_name!r}: a scale for {module_name}, which is not FP8 "
                        "(quantization_config.modules_to_not_convert lists it, or states no FP8)"
                    )
                raise KeyError(f"unexpected weight {hf_name!r}")
            module = modules[module_name]
            source = as_weight_source(weight)
            try:
                if isinstance(module, ParallelModule):
                    module.load_weight(param_name, source, shard)
                else:
                    target = params[target_name]
                    tensor = source.read()
                    if target.shape != tensor.shape:
                        raise ValueError(f"shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
                    with torch.no_grad():
                        target.copy_(tensor)
            except ValueError as exc:
                raise ValueError(f"{hf_name}: {exc}") from None
            loaded.add(f"{target_name}#{shard}" if shard is not None else target_name)
        if self.config.tie_word_embeddings:
            self._tie_loaded_weights(loaded)
        return loaded

    def _untie_lm_head(self) -> None:
        embedding = self.embed_tokens.weight
        self.lm_head.weight = nn.Parameter(torch.empty_like(embedding), requires_grad=embedding.requires_grad)

    def _tie_loaded_weights(self, loaded: set[str]) -> None:
        """A tied model whose checkpoint stored ``lm_head.weight``: an LM head equal to the stored embedding
        shares it again; with no embedding stored, the embedding becomes the LM head's weight; a different
        one stays the model's own LM head (the config's tie does not match the checkpoint)."""
        if "lm_head.weight" not in loaded or self.lm_head_tied:
            return
        if "embed_tokens.weight" not in loaded:
            self.embed_tokens.weight = self.lm_head.weight
            loaded.add("embed_tokens.weight")
        elif torch.equal(self.lm_head.weight, self.embed_tokens.weight):
            self.lm_head.weight = self.embed_tokens.weight

    def expected_weight_keys(self) -> set[str]:
        """What ``load_weights`` must have set for the model to be complete."""
        keys: set[str] = set()
        modules = dict(self.named_modules())
        for name, _ in self.named_parameters():
            module_name, _, param_name = name.rpartition(".")
            module = modules[module_name]
            fused = name.endswith(tuple(f"{f}.{param_name}" for f, _ in _FUSED_SHARDS.values()))
            if fused and isinstance(module, ParallelModule):
                keys.update(f"{name}#{i}" for i in range(module.num_parts(param_name)))
            else:
                keys.add(name)
        return keys

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights that keep activations finite at any size (std 0.02 matrices, unit norms).

        Drawn on the parameters' own device, so an 8B dummy model on a GPU initialises in seconds. Under
        tensor parallelism a sharded weight is drawn whole and cut (``ParallelModule.load_full``), so every
        group size holds slices of the same model as one rank.
        """
        modules = dict(self.named_modules())
        with torch.no_grad():
            for index, (name, param) in enumerate(self.named_parameters()):
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    generator = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + index)
                    module_name, _, param_name = name.rpartition(".")
                    module = modules[module_name]
                    full = module.full_shape(param_name) if isinstance(module, ParallelModule) else None
                    if self.tp.size == 1 or full is None:
                        param.normal_(0.0, 0.02, generator=generator)
                        continue
                    whole = torch.empty(full, dtype=param.dtype, device=param.device)
                    module.load_full(param_name, whole.normal_(0.0, 0.02, generator=generator))

    def post_load(self, device: torch.device) -> None:
        self.rotary.build(device)
        if device.type == "cpu":
            # A tied LM head shares its weight with the embedding, which still looks rows up in it.
            tied = self.lm_head_tied
            for module in self.modules():
                if isinstance(module, ParallelModule):
                    module.pack_for_cpu(keep_dense=tied and module is self.lm_head)
