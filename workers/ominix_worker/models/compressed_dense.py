"""The compressed-attention definition (``models/compressed.py``) recomputed densely from a whole token
history: no paging, no block tables, no steps. It is the reference the paged layer and the served model are
tested against, so it is written independently of the paged code: explicit per-position loops over the
window, the chunk rows and the heads, in float64."""

from __future__ import annotations

import torch

from ominix_worker.models.compressed import (
    CompressedAttention,
    CompressedDecoderLayer,
    LlamaCompressedForCausalLM,
)


def dense_compressed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    scale: float,
    rows_k: list[torch.Tensor],
    rows_v: list[torch.Tensor],
    ratio: int,
) -> torch.Tensor:
    """q (T, heads, dim), k and v (T, kv_heads, dim) of positions 0..T-1 and the rows of every complete
    chunk of ``ratio`` tokens ((kv_heads, dim) each; none when ``ratio`` is 0) → attention output (T, heads,
    dim)."""
    q, k, v = q.double(), k.double(), v.double()
    num_tokens, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = torch.zeros_like(q)
    for p in range(num_tokens):
        seen = list(range(max(0, p - window + 1), p + 1))
        num_rows = (p + 1) // ratio if ratio else 0  # chunks complete at p
        keys = torch.cat([k[seen], *(r.double().unsqueeze(0) for r in rows_k[:num_rows])])
        values = torch.cat([v[seen], *(r.double().unsqueeze(0) for r in rows_v[:num_rows])])
        for h in range(num_heads):
            logits = keys[:, h // group] @ q[p, h] * scale
            out[p, h] = torch.softmax(logits, dim=0) @ values[:, h // group]
    return out


def _rows(
    attn: CompressedAttention, k: torch.Tensor, v: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The row of every complete chunk, from the keys before rotation: a per-channel softmax over the chunk
    of ``v ⊙ gate + position bias`` pools k (then RMS-normed and rotated to the chunk's first position) and v."""
    ratio = attn.compress_ratio
    rows_k, rows_v = [], []
    for c in range(k.shape[0] // ratio):
        chunk_k, chunk_v = k[c * ratio : (c + 1) * ratio].double(), v[c * ratio : (c + 1) * ratio].double()
        scores = chunk_v * attn.compress_gate.double() + attn.compress_position_bias.double()
        weights = torch.softmax(scores, dim=0)  # (ratio, kv_heads, dim)
        pooled = (weights * chunk_k).sum(0)
        normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + attn.compress_norm.eps)
        normed = (normed * attn.compress_norm.weight.double()).float().unsqueeze(0)
        row_k, _ = attn.rotary(torch.tensor([c * ratio]), normed, normed)
        rows_k.append(row_k[0])
        rows_v.append((weights * chunk_v).sum(0))
    return rows_k, rows_v


@torch.no_grad()
def dense_compressed_logits(model: LlamaCompressedForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """Logits (T, vocab) of every position of ``token_ids``, recomputed from the whole history."""
    config = model.config
    ids = torch.tensor(token_ids, dtype=torch.int64)
    positions = torch.arange(len(token_ids))
    hidden = model.embed_tokens(ids)
    for layer in model.layers:
        assert isinstance(layer, CompressedDecoderLayer)  # build_layer's
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.reshape(len(token_ids), attn.num_heads, attn.head_dim)
        k = k.reshape(len(token_ids), attn.num_kv_heads, attn.head_dim)
        v = v.reshape(len(token_ids), attn.num_kv_heads, attn.head_dim)
        rows_k, rows_v = _rows(attn, k, v) if attn.compress_ratio else ([], [])
        q, k = attn.rotary(positions, q, k)
        out = dense_compressed_attention(
            q, k, v, config.sliding_window, attn.scale, rows_k, rows_v, attn.compress_ratio
        ).to(hidden.dtype)
        hidden = hidden + attn.o_proj(out.reshape(len(token_ids), attn.q_size))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.compute_logits(model.norm(hidden))


def dense_greedy(model: LlamaCompressedForCausalLM, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation of ``prompt``, each token from a dense recomputation of the whole history."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(int(dense_compressed_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


__all__ = ["dense_compressed_attention", "dense_compressed_logits", "dense_greedy"]
