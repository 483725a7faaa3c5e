"""Reference paged attention in plain torch: gather each request's context from its block table, then SDPA.

Correct above all: one request at a time, no fused kernels. The CPU path runs this; faster backends are
tested against it. An FP8 KV cache (e4m3) holds K / k_scale and V / v_scale and is dequantized when read.
Attention sinks (gpt-oss: one learned logit per query head that joins the softmax denominator and carries no
value) take an explicit softmax instead of SDPA, which has no place for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ominix_worker.attention.base import AttentionMetadata


class TorchReferenceAttention:
    name = "torch-sdpa"
    supports_sliding_window = True
    supports_sinks = True

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size
        # FP8 KV: stored values are K / k_scale and V / v_scale, saturated to the e4m3 range.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # The plans of the step's metadata (one per KV group), newest last.
        self._plans: list[tuple[AttentionMetadata, _StepPlan]] = []

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
        if _is_fp8(kv_cache):
            # CPU torch has no fp8 index_copy_: store the bytes.
            cache = kv_cache.view(torch.uint8)
            for half, x, scale in ((0, key, self.k_scale), (1, value, self.v_scale)):
                q = (x.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(kv_cache.dtype).view(torch.uint8)
                cache[half].view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, q)
            return
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key.to(kv_cache.dtype))
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(
            0, meta.slot_mapping, value.to(kv_cache.dtype)
        )

    def _gather(self, kv_cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """K and V of ``blocks`` ((2, ..., blocks, block_size, heads, dim)) in ``dtype``, dequantized if FP8."""
        if not _is_fp8(kv_cache):
            return kv_cache[:, blocks].to(dtype)
        raw = kv_cache.view(torch.uint8)[:, blocks].view(kv_cache.dtype).to(torch.float32)
        scales = torch.tensor([self.k_scale, self.v_scale], dtype=torch.float32, device=raw.device)
        return (raw * scales.view(2, *([1] * (raw.dim() - 1)))).to(dtype)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        plan = self._plan_for(meta, query.device)
        out = torch.empty_like(query)
        if plan.decode_tokens is not None:
            kv = self._gather(kv_cache, plan.decode_blocks, query.dtype).flatten(-4, -3)
            kv = kv[:, :, : plan.decode_max_len]
            q = query[plan.decode_tokens].unsqueeze(2)  # (B, heads, 1, head_dim)
            k = kv[0].transpose(1, 2)  # (B, kv_heads, max_len, head_dim)
            v = kv[1].transpose(1, 2)
            o = _attend(q, k, v, plan.decode_mask, scale, sinks)
            out[plan.decode_tokens] = o.squeeze(2)
        for start, end, num_keys, blocks, mask in plan.others:
            kv = self._gather(kv_cache, blocks, query.dtype).flatten(-4, -3)[:, :num_keys]
            q = query[start:end].transpose(0, 1)  # (heads, q_len, head_dim)
            k = kv[0].transpose(0, 1)  # (kv_heads, seq_len, head_dim)
            v = kv[1].transpose(0, 1)
            o = _attend(q, k, v, mask, scale, sinks)
            out[start:end] = o.transpose(0, 1)
        return out

    def _plan_for(self, meta: AttentionMetadata, device: torch.device) -> _StepPlan:
        """Index tensors and masks of one step, built once per KV group and shared by the group's layers."""
        for known, plan in self._plans:
            if known is meta:
                return plan
        query_start = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
        bs = self.block_size
        block_tables = meta.block_tables.long()
        window = meta.sliding_window
        decode_rows = [i for i in range(len(seq_lens)) if query_start[i + 1] - query_start[i] == 1]
        if len(decode_rows) < 2 or window:  # a lone decode row (or any, with a window) goes the general way
            decode_rows = []
        plan = _StepPlan()
        if decode_rows:
            # Every single-token row in one SDPA call: contexts padded to the longest, padding masked.
            max_len = max(seq_lens[i] for i in decode_rows)
            lens = torch.tensor([seq_lens[i] for i in decode_rows], device=device)
            plan.decode_tokens = torch.tensor([query_start[i] for i in decode_rows], device=device)
            plan.decode_blocks = block_tables[torch.tensor(decode_rows, device=device), : -(-max_len // bs)]
            plan.decode_max_len = max_len
            positions = torch.arange(max_len, device=device).unsqueeze(0)
            plan.decode_mask = (positions < lens.unsqueeze(1))[:, None, None, :]
        single = set(decode_rows)
        for i, seq_len in enumerate(seq_lens):
            start, end = query_start[i], query_start[i + 1]
            if end == start or i in single:
                continue
            q_len = end - start
            # With a window only the blocks from the first key the earliest query row sees are read: the
            # ones before may have been freed by the engine.
            first_block = max(0, seq_len - q_len - window + 1) // bs if window else 0
            first_key = first_block * bs
            mask = None  # a whole prompt at once: plain causal attention (lets SDPA pick a fused kernel)
            if q_len < seq_len or window:
                # Query row j sits at absolute position seq_len - q_len + j and sees keys up to it (and, with
                # a window, only the last ``window`` of them).
                q_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
                k_pos = torch.arange(first_key, seq_len, device=device).unsqueeze(0)
                mask = k_pos <= q_pos
                if window:
                    mask &= k_pos > q_pos - window
            blocks = block_tables[i, first_block : -(-seq_len // bs)]
            plan.others.append((start, end, seq_len - first_key, blocks, mask))
        self._plans = [*self._plans[-(_MAX_PLANS - 1) :], (meta, plan)]
        return plan


_FP8_MAX = 448.0
_MAX_PLANS = 4  # more than the KV groups of any layout, so a step never rebuilds one


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of q (..., heads, q_len, d) over k, v (..., kv_heads, keys, d); ``mask`` (broadcast to
    (..., heads, q_len, keys), True = visible) or, when None, causal over a whole prompt (q_len == keys).

    With ``sinks`` (heads,) each head's softmax denominator gains exp(sink): the weights of the real keys
    then sum to less than one."""
    if sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    heads, q_len, head_dim = q.shape[-3:]
    kv_heads, num_keys = k.shape[-3], k.shape[-2]
    group = heads // kv_heads
    # GQA without copying K/V: (..., kv_heads, group * q_len, d) against each KV head.
    qg = q.float().reshape(*q.shape[:-3], kv_heads, group * q_len, head_dim)
    scores = (qg @ k.float().transpose(-1, -2) * scale).reshape(*q.shape[:-1], num_keys)
    if mask is None:
        mask = torch.ones(q_len, num_keys, dtype=torch.bool, device=q.device).tril(num_keys - q_len)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(heads, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    probs = probs.reshape(*q.shape[:-3], kv_heads, group * q_len, num_keys)
    return (probs @ v.float()).reshape(q.shape).to(q.dtype)


def _is_fp8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class _StepPlan:
    decode_tokens: torch.Tensor | None = None  # flat token index of each single-token row
    decode_blocks: torch.Tensor | None = None  # (B, blocks) block table of those rows
    decode_max_len: int = 0
    decode_mask: torch.Tensor | None = None  # (B, 1, 1, max_len) valid context positions
    # (start, end, number of keys, blocks from the first one read, causal mask) of every other row
    others: list[tuple[int, int, int, torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
