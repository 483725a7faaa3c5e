"""A Llama-family decoder with compressed attention, shaped like DeepSeek-V4's layers (CPU reference).

Each layer keeps a raw sliding window of its recent tokens (KV group 0, a sliding-window group over every
layer) and, when its ``compress_ratio`` r is > 0, one compressed KV row per complete chunk of r tokens (a
compressed KV group per distinct ratio). The reference definition, for one layer with window W and ratio r:

- q, k, v are the Llama projections, q and k rotated at their own positions.
- Chunk c covers positions ``[c * r, (c + 1) * r)``. Its row is a gated pool of the chunk's keys and values,
  per channel (KV head and dimension): ``g_j = v_j ⊙ compress_gate + compress_position_bias[j - c * r]``,
  ``a = softmax_j(g)`` over the chunk, ``K_c = rope(rms_norm(Σ_j a_j ⊙ k̂_j) * compress_norm, c * r)`` with
  ``k̂_j`` the key before rotation, and ``V_c = Σ_j a_j ⊙ v_j``. Like DeepSeek-V4's heavily compressed
  attention: a softmax over the chunk of a learned score plus a learned position bias, a norm, and the rotary
  embedding of the chunk's first position; here the score reads the value and the pool reads the keys and
  values themselves, so the raw window alone holds what a row needs (the paged layer un-rotates the stored
  keys). The row is written into the compressed group's paged cache by the step that computes the chunk's
  last token.
- A query at position p attends, in one softmax, to the raw keys at positions ``(p - W, p]`` and to the
  rows of the chunks complete at p (``c < (p + 1) // r``), like DeepSeek-V4's sliding window plus compressed
  entries. A partial chunk has no row: its tokens are read raw, which needs ``W >= r`` (checked by the
  config).

Every request row is computed on its own from the paged caches (host block tables), so chunked prefill,
prefix hits and decode across chunk boundaries all read exactly what a dense recomputation from the whole
token history would. Not implemented from DeepSeek-V4: the lightning indexer's top-k selection, overlapping
windows (CSA), shared K=V heads, attention sinks, low-rank and grouped projections, hyper-connections, MoE.
The layer runs on the CPU only (per-request host loops; no CUDA graphs) and without tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ominix_worker.attention.base import AttentionBackend, AttentionMetadata
from ominix_worker.config import ModelConfig
from ominix_worker.kv_cache import kv_tensor_indices
from ominix_worker.models.llama import (
    MLP,
    Attention,
    LlamaForCausalLM,
    RMSNorm,
    RotaryEmbedding,
    kept_rows,
    last_layer_rows,
)
from ominix_worker.parallel import SINGLE, TensorParallel


@dataclass(slots=True)
class _RowPlan:
    """What one request row of a step reads and writes in a layer of one compress ratio."""

    start: int  # flat query rows [start, end)
    end: int
    raw_slots: torch.Tensor  # (n_raw,) flat slots of the raw keys read, positions [first_raw, seq_len)
    raw_mask: torch.Tensor  # (q_len, n_raw) window and causality
    chunks: torch.Tensor  # (n_chunks,) the chunks this step completes
    chunk_slots: torch.Tensor  # (n_chunks, r) their raw slots
    row_slots: torch.Tensor  # (n_chunks,) compressed slots their rows go to
    read_row_slots: torch.Tensor  # (n_rows,) compressed slots of every complete row read
    row_mask: torch.Tensor  # (q_len, n_rows) a row is read once its chunk is complete


class CompressedStepPlanner:
    """Index tensors of one step per compress ratio, built once and shared by every layer of that ratio."""

    def __init__(self, window: int, block_size: int) -> None:
        self.window = window
        self.block_size = block_size
        self._meta: AttentionMetadata | None = None
        self._plans: dict[int, list[_RowPlan]] = {}

    def plan(
        self, meta: AttentionMetadata, rows_meta: AttentionMetadata | None, ratio: int, device: torch.device
    ) -> list[_RowPlan]:
        """``meta``: the raw group's (its tables, the step's shape); ``rows_meta``: the compressed group's."""
        if self._meta is not meta:
            self._meta, self._plans = meta, {}
        plans = self._plans.get(ratio)
        if plans is None:
            plans = self._plans[ratio] = self._build(meta, rows_meta, ratio, device)
        return plans

    def _build(
        self, meta: AttentionMetadata, rows_meta: AttentionMetadata | None, ratio: int, device: torch.device
    ) -> list[_RowPlan]:
        bs, window = self.block_size, self.window
        query_start = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
        raw_tables = meta.block_tables.tolist()
        row_tables: list[list[int]] = []
        if ratio:
            assert rows_meta is not None, "a compressed layer needs its group's block tables"
            row_tables = rows_meta.block_tables.tolist()
        plans = []
        for i, seq_len in enumerate(seq_lens):
            start, end = query_start[i], query_start[i + 1]
            if end == start:
                continue
            first = seq_len - (end - start)  # first position computed
            raw_table = raw_tables[i]

            def raw_slot(p: int, table: list[int] = raw_table) -> int:
                return table[p // bs] * bs + p % bs

            q_pos = torch.arange(first, seq_len, device=device).unsqueeze(1)
            first_raw = max(0, first - window + 1)
            k_pos = torch.arange(first_raw, seq_len, device=device).unsqueeze(0)
            raw_mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
            raw_slots = torch.tensor([raw_slot(p) for p in range(first_raw, seq_len)], device=device)
            empty = torch.zeros(0, dtype=torch.int64, device=device)
            chunks, chunk_slots, row_slots, read_slots = empty, empty.view(0, max(ratio, 1)), empty, empty
            row_mask = torch.zeros((end - start, 0), dtype=torch.bool, device=device)
            if ratio:
                table = row_tables[i]
                completed = range(first // ratio, seq_len // ratio)  # chunks whose last token is computed now
                chunks = torch.tensor(list(completed), dtype=torch.int64, device=device)
                chunk_slots = torch.tensor(
                    [[raw_slot(c * ratio + j) for j in range(ratio)] for c in completed],
                    dtype=torch.int64,
                    device=device,
                ).view(len(completed), ratio)
                row_slots = torch.tensor(
                    [table[c // bs] * bs + c % bs for c in completed], dtype=torch.int64, device=device
                )
                num_rows = seq_len // ratio
                read_slots = torch.tensor(
                    [table[c // bs] * bs + c % bs for c in range(num_rows)], dtype=torch.int64, device=device
                )
                rows = torch.arange(num_rows, device=device).unsqueeze(0)
                row_mask = rows < (q_pos + 1) // ratio
            plans.append(
                _RowPlan(
                    start, end, raw_slots, raw_mask, chunks, chunk_slots, row_slots, read_slots, row_mask
                )
            )
        return plans


class CompressedAttention(Attention):
    """Sliding-window attention plus compressed rows (see the module docstring for the definition)."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        planner: CompressedStepPlanner,
        compress_ratio: int,
    ) -> None:
        super().__init__(config, backend, rotary)
        self.planner = planner
        self.window = config.sliding_window
        self.compress_ratio = compress_ratio
        if compress_ratio:
            self.compress_gate = nn.Parameter(torch.empty(self.num_kv_heads, self.head_dim))
            self.compress_position_bias = nn.Parameter(
                torch.empty(compress_ratio, self.num_kv_heads, self.head_dim)
            )
            self.compress_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """The rotary embedding of ``positions`` on x (..., heads, head_dim), or (``inverse``) its undoing."""
        assert self.rotary.cos_sin is not None
        cos = self.rotary.cos_sin[0, positions].unsqueeze(-2).to(x.dtype)
        sin = self.rotary.cos_sin[1, positions].unsqueeze(-2).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos - rotated * sin if inverse else x * cos + rotated * sin

    def compress(
        self, keys: torch.Tensor, values: torch.Tensor, chunks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the complete ``chunks``: their stored (rotated) keys and values (n_chunks, r, kv_heads,
        head_dim) → the rows' keys and values (n_chunks, kv_heads, head_dim)."""
        r = self.compress_ratio
        positions = chunks.unsqueeze(1) * r + torch.arange(r, device=chunks.device)
        keys = self._rotate(keys.float(), positions, inverse=True)
        scores = values.float() * self.compress_gate.float() + self.compress_position_bias.float()
        weights = scores.softmax(dim=1)  # over the chunk's tokens, per channel
        pooled_k = self.compress_norm((weights * keys).sum(1).to(values.dtype))
        row_k = self._rotate(pooled_k, chunks * r)
        return row_k, (weights * values.float()).sum(1).to(values.dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        compressed_cache: torch.Tensor | None = None,
        rows_meta: AttentionMetadata | None = None,
        *,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        self.backend.write_kv(kv_cache, k, v, meta)
        raw = kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)
        rows = (
            compressed_cache.view(2, -1, self.num_kv_heads, self.head_dim)
            if compressed_cache is not None
            else None
        )
        out = torch.empty_like(q)
        for plan in self.planner.plan(meta, rows_meta, self.compress_ratio, q.device):
            keys = raw[0, plan.raw_slots].to(q.dtype)
            values = raw[1, plan.raw_slots].to(q.dtype)
            mask = plan.raw_mask
            if rows is not None:
                if plan.row_slots.numel():
                    chunk_k, chunk_v = self.compress(
                        raw[0, plan.chunk_slots], raw[1, plan.chunk_slots], plan.chunks
                    )
                    rows[0].index_copy_(0, plan.row_slots, chunk_k.to(rows.dtype))
                    rows[1].index_copy_(0, plan.row_slots, chunk_v.to(rows.dtype))
                keys = torch.cat((keys, rows[0, plan.read_row_slots].to(q.dtype)))
                values = torch.cat((values, rows[1, plan.read_row_slots].to(q.dtype)))
                mask = torch.cat((mask, plan.row_mask), dim=1)
            o = F.scaled_dot_product_attention(
                q[plan.start : plan.end].transpose(0, 1),
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=True,
            )
            out[plan.start : plan.end] = o.transpose(0, 1)
        return self.o_proj(kept_rows(out.reshape(num_tokens, self.q_size), keep))


class CompressedDecoderLayer(nn.Module):
    """A pre-norm decoder layer whose attention is :class:`CompressedAttention`."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        planner: CompressedStepPlanner,
        compress_ratio: int,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = CompressedAttention(config, backend, rotary, planner, compress_ratio)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        compressed_cache: torch.Tensor | None,
        rows_meta: AttentionMetadata | None,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attn = self.self_attn(
            self.input_layernorm(hidden), positions, kv_cache, meta, compressed_cache, rows_meta, keep=keep
        )
        hidden = kept_rows(hidden, keep) + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaCompressedForCausalLM(LlamaForCausalLM):
    """``llama_compressed``: every layer attends within ``sliding_window``; layers with a compress ratio also
    read compressed rows. KV groups (``config.attention_groups``): the raw window group(s), then one compressed
    group per ratio; KV tensors: one raw per layer, then one of rows per compressed layer (kv_cache.py)."""

    single_rank_reason = "compressed attention runs without tensor parallelism"
    # Its compressed layers attend through calls of their own, not the backend's forward.
    piecewise_graphs = False

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        max_positions: int | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        self._planner: CompressedStepPlanner | None = None
        super().__init__(config, backend, max_positions, tp)
        # Per layer: its compressed group and the index of its row tensor in the KV list (-1: window only).
        self.row_groups = [-1] * config.num_layers
        self.row_cache_index = [-1] * config.num_layers
        placement = kv_tensor_indices(self.attention_groups, config.num_layers)
        for g, (group, indices) in enumerate(zip(self.attention_groups, placement, strict=True)):
            if group.compress_ratio:
                for layer, index in zip(group.layers, indices, strict=True):
                    self.row_groups[layer], self.row_cache_index[layer] = g, index

    def build_layer(
        self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel, layer_index: int
    ) -> nn.Module:
        if self._planner is None:  # one per model: layers of one ratio share a step's index tensors
            self._planner = CompressedStepPlanner(config.sliding_window, backend.block_size)
        return CompressedDecoderLayer(
            config, backend, self.rotary, self._planner, config.compress_ratios[layer_index]
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metas: Sequence[AttentionMetadata],
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Flattened tokens (T,) → final hidden states (T, hidden), normalised (no fused CUDA path); with
        ``keep``, those rows only (``LlamaForCausalLM.forward``)."""
        if len(kv_caches) != self.config.num_kv_cache_layers:
            raise ValueError(f"{len(kv_caches)} KV tensors for {self.config.num_kv_cache_layers}")
        hidden = self.embed_tokens(input_ids)
        between = self.between_layers
        kept = last_layer_rows(len(self.layers), keep)
        for i, layer in enumerate(self.layers):
            raw = metas[self.layer_kv_groups[i]]
            if self.row_groups[i] < 0:
                hidden = layer(hidden, positions, kv_caches[i], raw, None, None, kept[i])
            else:
                rows = kv_caches[self.row_cache_index[i]]
                hidden = layer(hidden, positions, kv_caches[i], raw, rows, metas[self.row_groups[i]], kept[i])
            if between is not None:
                between()
        return self.norm(hidden)


__all__ = ["CompressedAttention", "CompressedStepPlanner", "LlamaCompressedForCausalLM"]
