"""Pure-torch emulation of the three torch_npu ops the Ascend backend calls, from their documented semantics.

Each op first checks the input contract the real op enforces (dtypes, shapes, host vs device, cumulative
vs per-request lengths), so a preparation mistake fails here as it would on an NPU. Math runs in float64.
"""

from __future__ import annotations

import torch

MASK_SIZE = 2048


def _gqa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, allowed: torch.Tensor
) -> torch.Tensor:
    """q (Lq, N, D), k/v (Lk, KVH, D), allowed (Lq, Lk) bool → (Lq, N, D) float64."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qnd,knd->nqk", q.double(), k) * scale
    scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("nqk,knd->qnd", probs, v)


def _gather(cache: torch.Tensor, block_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """First ``length`` tokens of one request from a (blocks, block_size, ...) cache."""
    num_blocks = -(-length // block_size)
    blocks = block_row[:num_blocks].long()
    return cache[blocks].reshape(num_blocks * block_size, *cache.shape[2:])[:length]


class EmulatedNpuOps:
    """Implements ominix_worker.attention.ascend.NpuOps without an NPU; records the calls it got."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_indices: torch.Tensor,
    ) -> None:
        self.calls.append("reshape_and_cache")
        assert slot_indices.dtype == torch.int32, "slot_indices must be int32"
        assert key.dim() == 3 and key.shape == value.shape, "key/value must be (T, num_kv_heads, head_dim)"
        assert key.shape[0] == slot_indices.shape[0], "one slot per token"
        assert key_cache.dim() == 4 and key_cache.shape[2:] == key.shape[1:], (
            "cache must be (blocks, bs, kvh, hd)"
        )
        assert key.dtype == key_cache.dtype, "key dtype must match the cache"
        block_size = key_cache.shape[1]
        slots = slot_indices.long()
        assert slots.numel() == 0 or int(slots.max()) < key_cache.shape[0] * block_size, (
            "slot outside the cache"
        )
        key_cache[slots // block_size, slots % block_size] = key
        value_cache[slots // block_size, slots % block_size] = value

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        num_kv_heads: int,
        num_heads: int,
        scale_value: float,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        self.calls.append("paged_attention")
        assert context_lens.device.type == "cpu" and context_lens.dtype == torch.int32, (
            "context_lens: int32 on host"
        )
        assert block_table.dtype == torch.int32 and block_table.dim() == 2, (
            "block_table: int32 (B, max_blocks)"
        )
        assert query.dim() == 3 and query.shape[1] == num_heads, (
            "query must be (B, num_heads, head_dim), one token each"
        )
        assert key_cache.shape[2] == num_kv_heads and num_heads % num_kv_heads == 0
        assert query.shape[0] == context_lens.shape[0] == block_table.shape[0]
        assert out.shape == query.shape
        block_size = key_cache.shape[1]
        for b in range(query.shape[0]):
            length = int(context_lens[b])
            assert block_table.shape[1] * block_size >= length, "block table too narrow for the context"
            k = _gather(key_cache, block_table[b], length, block_size)
            v = _gather(value_cache, block_table[b], length, block_size)
            allowed = torch.ones(1, length, dtype=torch.bool)
            out[b] = _gqa_attention(query[b : b + 1], k, v, scale_value, allowed)[0].to(out.dtype)

    def fused_infer_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        atten_mask: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        actual_seq_lengths: list[int],
        actual_seq_lengths_kv: list[int],
        num_heads: int,
        num_key_value_heads: int,
        scale: float,
        sparse_mode: int,
        input_layout: str,
    ) -> torch.Tensor:
        self.calls.append("fused_infer_attention")
        assert input_layout == "TND" and query.dim() == 3 and query.shape[1] == num_heads
        assert sparse_mode == 3, "the backend asks for right-down causal (sparse_mode 3)"
        assert atten_mask.shape == (MASK_SIZE, MASK_SIZE) and atten_mask.dtype == torch.bool
        assert torch.equal(atten_mask, torch.triu(torch.ones_like(atten_mask), diagonal=1)), (
            "compressed causal mask"
        )
        assert block_table.dtype == torch.int32 and block_table.dim() == 2
        head_dim = query.shape[2]
        assert key.dim() == 3 and key.shape[1] == block_size, "paged key must be (blocks, block_size, kvh*hd)"
        assert key.shape[2] == num_key_value_heads * head_dim
        assert len(actual_seq_lengths) == len(actual_seq_lengths_kv) == block_table.shape[0]
        assert all(b >= a for a, b in zip([0, *actual_seq_lengths], actual_seq_lengths, strict=False)), (
            "cumulative"
        )
        assert actual_seq_lengths[-1] == query.shape[0], "TND: the last cumulative length is the row count"
        k_cache = key.view(key.shape[0], block_size, num_key_value_heads, head_dim)
        v_cache = value.view(value.shape[0], block_size, num_key_value_heads, head_dim)
        out = torch.empty_like(query)
        start = 0
        for b, end in enumerate(actual_seq_lengths):
            q_len, kv_len = end - start, actual_seq_lengths_kv[b]
            assert kv_len >= q_len, "per-request kv length (not cumulative) must cover the query rows"
            k = _gather(k_cache, block_table[b], kv_len, block_size)
            v = _gather(v_cache, block_table[b], kv_len, block_size)
            # sparse_mode 3: query row i sees keys up to kv_len - q_len + i (causal, bottom-right aligned).
            rows = torch.arange(q_len).unsqueeze(1) + (kv_len - q_len)
            allowed = torch.arange(kv_len).unsqueeze(0) <= rows
            out[start:end] = _gqa_attention(query[start:end], k, v, scale, allowed).to(out.dtype)
            start = end
        return out
