"""Reference paged attention in plain torch: gather each request's context from its block table, then SDPA.

Correct above all, no fused kernels: prompts one request at a time, every decode row of a step in one SDPA
call. The CPU path runs this; faster backends are tested against it. An FP8 KV cache (e4m3) holds K / k_scale
and V / v_scale (the layer's ``KVScales``) and is dequantized when read. Attention sinks (gpt-oss: one learned
logit per query head that joins the softmax denominator and carries no value) take an explicit softmax instead
of SDPA, which has no place for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from ominix_worker.attention.base import (
    FP8_KV_DTYPES,
    UNIT_KV_SCALES,
    AttentionMetadata,
    KVScales,
    PiecewiseAttention,
)


class TorchReferenceAttention:
    name = "torch-sdpa"
    supports_sliding_window = True
    supports_sinks = True
    skips_unset_slots = True  # write_kv filters slot -1 out when the metadata says there is one
    takes_fused_rotary_store = False  # the reference keeps its own store (it runs on CUDA in comparisons)

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size
        # The plans of the step's metadata (one per KV group), newest last.
        self._plans: list[tuple[AttentionMetadata, _StepPlan]] = []

    def piecewise_attention(self) -> PiecewiseAttention | None:
        """Its steps are not captured (no CUDA graphs here)."""
        return None

    def mixed_warm_up_steps(
        self, num_kv_heads: int, max_tokens: int, device: torch.device
    ) -> list[tuple[int, int, int]]:
        return []  # nothing compiles at run time

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
        self,
        kv_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: AttentionMetadata,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> None:
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        if meta.has_unset_slots:  # index_copy_ has no skip: keep the rows that have a slot
            stored = meta.slot_mapping >= 0
            key, value = key[stored], value[stored]
            meta = replace(meta, slot_mapping=meta.slot_mapping[stored])
        if _is_fp8(kv_cache):
            # CPU torch has no fp8 index_copy_: store the bytes.
            cache = kv_cache.view(torch.uint8)
            for half, x, scale in ((0, key, kv_scales.k), (1, value, kv_scales.v)):
                q = (x.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(kv_cache.dtype).view(torch.uint8)
                cache[half].view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, q)
            return
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key.to(kv_cache.dtype))
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(
            0, meta.slot_mapping, value.to(kv_cache.dtype)
        )

    def _gather(
        self, kv_cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype, kv_scales: KVScales
    ) -> torch.Tensor:
        """K and V of ``blocks`` ((2, ..., blocks, block_size, heads, dim)) in ``dtype``, dequantized if FP8."""
        if not _is_fp8(kv_cache):
            return kv_cache[:, blocks].to(dtype)
        raw = kv_cache.view(torch.uint8)[:, blocks].view(kv_cache.dtype).to(torch.float32)
        scales = torch.tensor([kv_scales.k, kv_scales.v], dtype=torch.float32, device=raw.device)
        return (raw * scales.view(2, *([1] * (raw.dim() - 1)))).to(dtype)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales = UNIT_KV_SCALES,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        plan = self._plan_for(meta, query, kv_cache.shape[1])
        if (
            plan.decode_tokens is not None
            and not plan.others
            and plan.decode_tokens.numel() == query.shape[0]
        ):
            return self._decode(
                query, kv_cache, plan, scale, kv_scales, sinks
            )  # a pure decode step: no row to pick
        out = torch.empty_like(query)
        if plan.decode_tokens is not None:
            out[plan.decode_tokens] = self._decode(
                query[plan.decode_tokens], kv_cache, plan, scale, kv_scales, sinks
            )
        for start, end, num_keys, blocks, mask in plan.others:
            kv = self._gather(kv_cache, blocks, query.dtype, kv_scales).flatten(-4, -3)[:, :num_keys]
            q = query[start:end].transpose(0, 1)  # (heads, q_len, head_dim)
            k = kv[0].transpose(0, 1)  # (kv_heads, seq_len, head_dim)
            v = kv[1].transpose(0, 1)
            o = _attend(q, k, v, mask, scale, sinks)
            out[start:end] = o.transpose(0, 1)
        return out

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: _StepPlan,
        scale: float,
        kv_scales: KVScales,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Every single-token row in one attention call over contexts padded to whole blocks (padding masked).

        K and V of all rows come out of one ``index_select`` of whole blocks (rows of block_size × heads ×
        dim contiguous values). Without sinks, the query heads that share a KV head are that head's query
        rows, so SDPA sees (rows, kv_heads, group, head_dim) against (rows, kv_heads, keys, head_dim) and
        repeats nothing.
        """
        assert (
            plan.decode_blocks is not None and plan.decode_gather is not None and plan.decode_mask is not None
        )
        rows, num_heads, head_dim = query.shape
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        if _is_fp8(kv_cache):
            kv = self._gather(kv_cache, plan.decode_blocks, query.dtype, kv_scales)
        else:
            flat = kv_cache.view(2 * num_blocks, block_size * num_kv_heads * head_dim)
            kv = flat.index_select(0, plan.decode_gather).to(query.dtype)
        kv = kv.view(2, rows, -1, num_kv_heads, head_dim)
        k = kv[0].transpose(1, 2)  # (rows, kv_heads, keys, head_dim)
        v = kv[1].transpose(1, 2)
        if sinks is not None:
            return _attend(query.unsqueeze(2), k, v, plan.decode_mask, scale, sinks).squeeze(2)
        q = query.reshape(rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.decode_bias, scale=scale)
        return o.reshape(rows, num_heads, head_dim)

    def _plan_for(self, meta: AttentionMetadata, query: torch.Tensor, num_blocks: int) -> _StepPlan:
        """Index tensors and masks of one step, built once per KV group and shared by the group's layers."""
        for known, plan in self._plans:
            if known is meta and plan.num_blocks == num_blocks:
                return plan
        device = query.device
        query_start = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
        bs = self.block_size
        block_tables = meta.block_tables.long()
        window = meta.sliding_window
        decode_rows = [i for i in range(len(seq_lens)) if query_start[i + 1] - query_start[i] == 1]
        if len(decode_rows) < 2 or window:  # a lone decode row (or any, with a window) goes the general way
            decode_rows = []
        plan = _StepPlan(num_blocks)
        if decode_rows:
            # Every single-token row in one SDPA call: contexts padded to whole blocks, padding masked.
            max_len = max(seq_lens[i] for i in decode_rows)
            used = -(-max_len // bs)
            lens = torch.tensor([seq_lens[i] for i in decode_rows], device=device)
            plan.decode_tokens = torch.tensor([query_start[i] for i in decode_rows], device=device)
            plan.decode_blocks = block_tables[torch.tensor(decode_rows, device=device), :used]
            # Rows of the (2 * num_blocks, block) view: every row's K blocks, then the same blocks' V.
            k_rows = plan.decode_blocks.reshape(-1)
            plan.decode_gather = torch.cat((k_rows, k_rows + num_blocks))
            positions = torch.arange(used * bs, device=device).unsqueeze(0)
            plan.decode_mask = (positions < lens.unsqueeze(1))[:, None, None, :]
            # SDPA turns a boolean mask into this on every call; once per step is enough.
            plan.decode_bias = torch.zeros(
                plan.decode_mask.shape, dtype=query.dtype, device=device
            ).masked_fill(~plan.decode_mask, float("-inf"))
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
        # A leading batch dimension for 3-D inputs: on CPU, SDPA sends 3-D inputs to its math fallback and 4-D
        # ones to the flash kernel (a 2,048-token SmolLM2 prompt: 307 against 16 ms a layer).
        unbatched = q.dim() == 3
        if unbatched:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        return out.squeeze(0) if unbatched else out
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
    return kv_cache.dtype in FP8_KV_DTYPES


@dataclass
class _StepPlan:
    num_blocks: int  # of the KV cache the decode gather indexes
    decode_tokens: torch.Tensor | None = None  # flat token index of each single-token row
    decode_blocks: torch.Tensor | None = None  # (B, blocks) block table of those rows
    decode_gather: torch.Tensor | None = None  # (2 * B * blocks,) K then V rows of the flat cache view
    decode_mask: torch.Tensor | None = None  # (B, 1, 1, blocks * block_size) valid context positions
    decode_bias: torch.Tensor | None = None  # 0 / -inf of the same, in the query dtype
    # (start, end, number of keys, blocks from the first one read, causal mask) of every other row
    others: list[tuple[int, int, int, torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
