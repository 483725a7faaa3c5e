"""Attention sinks in the CPU reference attention, against a float64 softmax written out by hand.

A sink is one logit per query head that joins the softmax denominator and carries no value (gpt-oss). The
paged batches mix every path of the reference: a batch of single-token rows (one padded SDPA-shaped call),
a whole prompt (no mask), chunked prefill over cached context, and sliding windows whose table starts with
null entries (blocks freed behind the window).
"""

from __future__ import annotations

import math

import pytest
import torch

from ominix_runtime.contract import NULL_BLOCK_ID
from ominix_worker.attention.base import AttentionMetadata
from ominix_worker.attention.torch_ref import TorchReferenceAttention

BS = 8


def paged_batch(
    gen: torch.Generator,
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[torch.Tensor], list[torch.Tensor]]:
    """(query, kv_cache, meta, keys, values): every request's K/V in scattered blocks; with a window the
    blocks wholly behind it are nulled in the table and filled with NaN, so reading one shows."""
    backend = TorchReferenceAttention(BS)
    per_seq = [-(-s // BS) for s in seq_lens]
    num_blocks = sum(per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(per_seq) + 1
    tables = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    cache = backend.allocate_kv_cache(
        1, num_blocks, num_kv_heads, head_dim, torch.float32, torch.device("cpu")
    )[0]
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    queries, keys, values, slots = [], [], [], []
    cursor = 0
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        ids = perm[cursor : cursor + per_seq[i]]
        cursor += per_seq[i]
        tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn((seq_len, num_kv_heads, head_dim), generator=gen)
        v = torch.randn((seq_len, num_kv_heads, head_dim), generator=gen)
        pos = torch.arange(seq_len)
        slot = torch.tensor(ids)[pos // BS] * BS + pos % BS
        flat[0, slot], flat[1, slot] = k, v
        if window:
            for j in range(max(0, seq_len - q_len - window) // BS):
                cache[:, int(tables[i, j])] = float("nan")
                tables[i, j] = NULL_BLOCK_ID
        queries.append(torch.randn((q_len, num_heads, head_dim), generator=gen))
        keys.append(k.double())
        values.append(v.double())
        slots.append(slot[seq_len - q_len :])
    qsl = [0]
    for q_len in q_lens:
        qsl.append(qsl[-1] + q_len)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.cat(slots),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_decode_only=all(q == 1 for q in q_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
        sliding_window=window,
    )
    return torch.cat(queries), cache, meta, keys, values


def sink_reference(
    query: torch.Tensor,
    q_lens: list[int],
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    sinks: torch.Tensor | None,
    window: int,
    scale: float,
) -> torch.Tensor:
    """out = Σ_j exp(s_j) v_j / (Σ_j exp(s_j) + exp(sink)) over the visible keys, in float64."""
    outs, start = [], 0
    num_heads = query.shape[1]
    for q_len, k, v in zip(q_lens, keys, values, strict=True):
        seq_len = k.shape[0]
        q = query[start : start + q_len].double()
        start += q_len
        group = num_heads // k.shape[1]
        kh, vh = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("mhd,nhd->hmn", q, kh) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if window:
            visible &= k_pos > q_pos - window
        top = scores.masked_fill(~visible, float("-inf")).amax(-1, keepdim=True)
        if sinks is not None:
            top = torch.maximum(top, sinks.double().view(-1, 1, 1))
        weights = torch.exp(scores - top) * visible
        denom = weights.sum(-1, keepdim=True)
        if sinks is not None:
            denom = denom + torch.exp(sinks.double().view(-1, 1, 1) - top)
        outs.append(torch.einsum("hmn,nhd->mhd", weights / denom, vh))
    return torch.cat(outs)


CASES = [
    # (q_lens, seq_lens, window)
    ([1, 1, 1], [5, 30, 17], 0),  # single-token rows batched into one call
    ([12], [12], 0),  # a whole prompt: plain causal
    ([7, 1, 20], [40, 9, 20], 0),  # chunked prefill over cached context, a lone decode row, a prompt
    ([1, 1, 1], [5, 30, 61], 10),  # decode far past a window: freed blocks must not be read
    ([9, 25, 1], [50, 25, 33], 6),  # a chunk past the window, a prompt longer than it, a decode row
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2)])
def test_sinks_match_the_hand_written_softmax(case: int, num_heads: int, num_kv_heads: int) -> None:
    q_lens, seq_lens, window = CASES[case]
    gen = torch.Generator().manual_seed(40 + case)
    head_dim = 16
    query, cache, meta, keys, values = paged_batch(
        gen, q_lens, seq_lens, num_heads, num_kv_heads, head_dim, window
    )
    # Sinks around the scores' scale, one far above them (the keys' weights nearly vanish).
    sinks = torch.randn(num_heads, generator=gen) * 2.0
    sinks[0] = 30.0
    scale = 1.0 / math.sqrt(head_dim)
    backend = TorchReferenceAttention(BS)
    got = backend.forward(query, cache, meta, scale, sinks=sinks).double()
    assert not torch.isnan(got).any(), "a block freed behind the window was read"
    want = sink_reference(query, q_lens, keys, values, sinks, window, scale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # The sinks matter: without them the outputs differ (and match the sink-free reference).
    plain = backend.forward(query, cache, meta, scale).double()
    torch.testing.assert_close(plain, sink_reference(query, q_lens, keys, values, None, window, scale),
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    assert (plain - got).abs().max() > 1e-2
    # A head whose sink dwarfs every score attends to almost nothing.
    assert got[:, 0].abs().max() < 1e-6


def test_a_very_negative_sink_is_no_sink() -> None:
    gen = torch.Generator().manual_seed(7)
    query, cache, meta, _, _ = paged_batch(gen, [7, 1, 20], [40, 9, 20], 4, 2, 16, 0)
    backend = TorchReferenceAttention(BS)
    plain = backend.forward(query, cache, meta, 0.25)
    sunk = backend.forward(query, cache, meta, 0.25, sinks=torch.full((4,), -1e4))
    torch.testing.assert_close(sunk, plain, rtol=1e-5, atol=1e-6)
