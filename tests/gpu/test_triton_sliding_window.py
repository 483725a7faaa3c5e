"""Triton paged attention with a sliding window vs a float64 windowed attention computed from scratch.

Blocks wholly behind each request's window get a null (-1) block-table entry and NaN contents, as after the
engine freed them: any read of one turns the output NaN. Runs on CUDA (or, slowly, under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math

import pytest
import torch
from triton_target import triton_device  # noqa: E402

DEVICE = triton_device()

from test_triton_attention import TOLERANCE, Batch, make_batch  # noqa: E402

from ominix_runtime.contract import NULL_BLOCK_ID  # noqa: E402
from ominix_worker.attention.triton_paged import TritonPagedAttention  # noqa: E402

pytestmark = pytest.mark.gpu


def slide(batch: Batch, window: int, block_size: int) -> int:
    """Null and poison the blocks the engine would have freed: wholly before context_len - window."""
    tables = batch.meta.block_tables.cpu()
    nulled = 0
    for i, (q_len, seq_len) in enumerate(zip(batch.q_lens, batch.seq_lens, strict=True)):
        gone = max(0, seq_len - q_len - window) // block_size
        for j in range(gone):
            batch.kv_cache[:, int(tables[i, j])] = float("nan")
            tables[i, j] = NULL_BLOCK_ID
            nulled += 1
    batch.meta.block_tables = tables.to(batch.meta.block_tables.device)
    batch.meta.sliding_window = window
    return nulled


def windowed_reference(batch: Batch, window: int, scale: float) -> list[torch.Tensor]:
    outs = []
    start = 0
    num_heads = batch.query.shape[1]
    for q_len, seq_len, k, v in zip(batch.q_lens, batch.seq_lens, batch.keys, batch.values, strict=True):
        q = batch.query[start : start + q_len].double().cpu()
        start += q_len
        group = num_heads // k.shape[1]
        kh = k.repeat_interleave(group, dim=1)
        vh = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("mhd,nhd->hmn", q, kh) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = (k_pos <= q_pos) & (k_pos > q_pos - window)
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hmn,nhd->mhd", torch.softmax(scores, dim=-1), vh))
    return outs


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


CASES = [
    # (q_lens, seq_lens, window): a decode batch far past the window, one short of it, one inside it
    ([1, 1, 1, 1], [700, 129, 40, 1500], 128),
    # chunked prefill with a long context, a whole prompt longer than the window, a decode row beside them
    ([96, 300, 1], [1000, 300, 513], 64),
    # a window that is not a multiple of the tiles or blocks
    ([17, 1, 250], [333, 222, 250], 37),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("decode_splits", [None, 1, 4])
@pytest.mark.parametrize("rows_in_prefill", [True, False], ids=["rows-in-prefill", "decode-kernel"])
def test_windowed_attention_matches_the_reference(
    dtype: torch.dtype, case: int, decode_splits: int | None, rows_in_prefill: bool
) -> None:
    q_lens, seq_lens, window = CASES[case]
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    gen = torch.Generator().manual_seed(100 + case)
    backend = TritonPagedAttention(block_size=block_size)
    backend.decode_splits = decode_splits
    backend.decode_rows_in_prefill = rows_in_prefill  # where a mixed case's decode rows attend
    batch = make_batch(gen, q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, backend)
    assert slide(batch, window, block_size) > 0
    backend.write_kv(batch.kv_cache, batch.new_key, batch.new_value, batch.meta)
    out = torch.full_like(batch.query, float("nan"))
    scale = 1.0 / math.sqrt(head_dim)
    backend.forward_into(batch.query, batch.kv_cache, batch.meta, scale, out)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "a null or poisoned block behind the window was read"
    got_all = out.double().cpu()
    start = 0
    for i, ref in enumerate(windowed_reference(batch, window, scale)):
        got = got_all[start : start + ref.shape[0]]
        start += ref.shape[0]
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < TOLERANCE[dtype], f"request {i} (q_len {q_lens[i]}, seq_len {seq_lens[i]}): {err:.2e}"
