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
        out = torch.empty_like(query)
        decode_rows = [i for i in range(len(seq_lens)) if query_start[i + 1] - query_start[i] == 1]
        if len(decode_rows) > 1:
            self._decode_batch(query, kv_cache, meta, scale, decode_rows, query_start, seq_lens, out)
        single = set(decode_rows) if len(decode_rows) > 1 else set()
        for i, seq_len in enumerate(seq_lens):
            start, end = query_start[i], query_start[i + 1]
            if end > start and i not in single:
                out[start:end] = self._one_request(
                    query[start:end], kv_cache, meta.block_tables[i], seq_len, scale
                )
        return out

    def _gather(self, kv_cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """(2, ..., num_blocks * block_size, kv_heads, head_dim) for block tables of any leading shape."""
        blocks = block_table[..., :num_blocks].long()
        gathered = kv_cache[:, blocks]  # (2, *lead, num_blocks, block_size, kv_heads, head_dim)
        return gathered.flatten(-4, -3)

    def _one_request(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
        scale: float,
    ) -> torch.Tensor:
        q_len = query.shape[0]
        kv = self._gather(kv_cache, block_table, -(-seq_len // self.block_size))[:, :seq_len]
        q = query.transpose(0, 1)  # (heads, q_len, head_dim)
        k = kv[0].transpose(0, 1).to(q.dtype)  # (kv_heads, seq_len, head_dim)
        v = kv[1].transpose(0, 1).to(q.dtype)
        # Query row j sits at absolute position seq_len - q_len + j and sees keys up to it.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
        mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.transpose(0, 1)

    def _decode_batch(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        rows: list[int],
        query_start: list[int],
        seq_lens: list[int],
        out: torch.Tensor,
    ) -> None:
        """Every single-token row in one SDPA call: contexts padded to the longest, padding masked."""
        device = query.device
        row_index = torch.tensor(rows, device=device)
        token_index = torch.tensor([query_start[i] for i in rows], device=device)
        lens = torch.tensor([seq_lens[i] for i in rows], device=device)
        max_len = max(seq_lens[i] for i in rows)
        kv = self._gather(kv_cache, meta.block_tables[row_index], -(-max_len // self.block_size))[
            :, :, :max_len
        ]
        q = query[token_index].unsqueeze(2)  # (B, heads, 1, head_dim)
        k = kv[0].transpose(1, 2).to(q.dtype)  # (B, kv_heads, max_len, head_dim)
        v = kv[1].transpose(1, 2).to(q.dtype)
        mask = (torch.arange(max_len, device=device).unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[token_index] = o.squeeze(2)
