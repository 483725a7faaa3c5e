"""Triton paged attention with attention sinks (and sliding windows) vs the torch reference attention.

The torch reference's sinks are checked against a hand-written softmax on the CPU
(tests/worker/test_attention_sinks.py); here the Triton decode (split-K or not), mixed and prefill kernels
must match it on the same cache. Blocks behind each window are nulled and NaN-poisoned for Triton, as after
the engine freed them. Runs on CUDA (or, slowly, under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math

import pytest
import torch
from triton_target import triton_device  # noqa: E402

DEVICE = triton_device()

from test_triton_attention import TOLERANCE, make_batch  # noqa: E402
from test_triton_sliding_window import slide  # noqa: E402

from ominix_worker.attention.torch_ref import TorchReferenceAttention  # noqa: E402
from ominix_worker.attention.triton_paged import TritonPagedAttention  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


CASES = [
    # (q_lens, seq_lens, window); window 0: full attention
    ([1, 1, 1, 1], [700, 129, 40, 1500], 0),  # decode only, long and short contexts
    ([1, 1, 1, 1], [700, 129, 40, 1500], 128),  # decode far past gpt-oss's window
    ([96, 300, 1], [1000, 300, 513], 0),  # chunked prefill, a whole prompt, a decode row beside them
    ([96, 300, 1], [1000, 300, 513], 64),
    ([17, 1, 250], [333, 222, 250], 37),  # a window that is not a multiple of the tiles or blocks
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("decode_splits", [None, 1, 4])
@pytest.mark.parametrize("rows_in_prefill", [True, False], ids=["rows-in-prefill", "decode-kernel"])
def test_sinks_match_the_torch_reference(
    dtype: torch.dtype, case: int, decode_splits: int | None, rows_in_prefill: bool
) -> None:
    q_lens, seq_lens, window = CASES[case]
    # gpt-oss-20b's attention shape: 64 query heads over 8 KV heads of 64.
    num_heads, num_kv_heads, head_dim, block_size = 64, 8, 64, 16
    gen = torch.Generator().manual_seed(300 + case)
    backend = TritonPagedAttention(block_size=block_size)
    backend.decode_splits = decode_splits
    backend.decode_rows_in_prefill = rows_in_prefill  # where a mixed case's decode rows attend
    batch = make_batch(gen, q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, backend)
    if window:
        assert slide(batch, window, block_size) > 0
    backend.write_kv(batch.kv_cache, batch.new_key, batch.new_value, batch.meta)
    # Sinks on the scale of the scores, and one head whose sink dwarfs them.
    sinks = (torch.randn(num_heads, generator=gen) * 2.0).to(DEVICE)
    sinks[5] = 40.0
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.full_like(batch.query, float("nan"))
    backend.forward_into(batch.query, batch.kv_cache, batch.meta, scale, out, sinks=sinks)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "a null or poisoned block was read"
    # The reference reads the same cache in float32 (poison zeroed: its padded decode rows multiply it by 0).
    reference = TorchReferenceAttention(block_size)
    clean = batch.kv_cache.float().nan_to_num(0.0)
    meta = batch.meta
    meta.query_start_loc_cpu = meta.query_start_loc.tolist()
    meta.seq_lens_cpu = meta.seq_lens.tolist()
    want = reference.forward(batch.query.float(), clean, meta, scale, sinks=sinks).double().cpu()
    got = out.double().cpu()
    start = 0
    for i, q_len in enumerate(q_lens):
        g, w = got[start : start + q_len], want[start : start + q_len]
        start += q_len
        err = ((g - w).norm() / w.norm()).item()
        assert err < TOLERANCE[dtype], f"request {i} (q_len {q_len}, seq_len {seq_lens[i]}): {err:.2e}"
        assert g[:, 5].abs().max().item() < 1e-3, "the dominant sink's head should attend to almost nothing"
    # Without sinks the kernels give a different answer: the sinks took part.
    plain = backend.forward(batch.query, batch.kv_cache, batch.meta, scale)
    assert (plain.double().cpu() - got).abs().max().item() > 1e-2
