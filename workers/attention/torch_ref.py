"""Reference paged attention in plain torch: gather each request's context from its block table, then SDPA.

Correct above all: one request at a time, no fused kernels. The CPU path runs this; faster backends are
tested against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ominix_worker.attention.base import AttentionMetadata


class TorchReferenceAttention:
    name = "torch-sdpa"

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size

    def allocate_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> list[torch.Tensor]:
        shape = (2, num_blocks, self.block_size, num_kv_heads, head_dim)
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write_kv(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key.to(kv_cache.dtype))
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(
            0, meta.slot_mapping, value.to(kv_cache.dtype)
        )

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        query_start = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
        num_heads = query.shape[1]
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        group = num_heads // num_kv_heads
        out = torch.empty_like(query)
        for i, seq_len in enumerate(seq_lens):
            start, end = query_start[i], query_start[i + 1]
            q_len = end - start
            if q_len == 0:
                continue
            num_blocks = -(-seq_len // self.block_size)
            blocks = meta.block_tables[i, :num_blocks].long()
            # (num_blocks, block_size, kv_heads, head_dim) → (seq_len, kv_heads, head_dim)
            k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            q = query[start:end].transpose(0, 1)  # (heads, q_len, head_dim)
            k = k.transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
            v = v.transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
            # Query row j sits at absolute position seq_len - q_len + j and sees keys up to it.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            out[start:end] = o.transpose(0, 1)
        return out
