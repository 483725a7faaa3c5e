"""Ascend attention path on the CPU: input preparation plus emulated torch_npu ops vs a float64 reference.

Scenarios: decode, prefill, chunked prefill over a cached prefix, mixed batches, GQA/MQA/MHA. The real
torch_npu is never imported in this process.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import pytest
import torch
from npu_emulation import EmulatedNpuOps

from ominix_runtime.contract import ASCEND_PROFILE
from ominix_worker.attention.ascend import (
    ASCEND_BLOCK_SIZE,
    FIA_MASK_SIZE,
    AscendPagedAttention,
    causal_mask,
    pad_block_tables,
    prepare_ascend_inputs,
    slot_indices_for,
)
from ominix_worker.attention.base import AttentionMetadata
from ominix_worker.attention.torch_ref import TorchReferenceAttention

BS = ASCEND_BLOCK_SIZE
HEAD_DIM = 16


@dataclass
class Seq:
    """One request: its whole K/V history (float64 truth) and how much of it is already cached."""

    keys: torch.Tensor  # (seq_len, kvh, hd)
    values: torch.Tensor
    queries: torch.Tensor  # (seq_len, heads, hd): row t is the query of position t
    num_cached: int
    blocks: list[int]

    @property
    def seq_len(self) -> int:
        return self.keys.shape[0]


def make_seqs(
    shapes: list[tuple[int, int]], num_heads: int, num_kv_heads: int, num_blocks: int, seed: int = 0
) -> list[Seq]:
    """shapes: (num_cached, num_new) per request. Blocks are scattered (a random permutation)."""
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = []
    for num_cached, num_new in shapes:
        n = num_cached + num_new
        blocks = [free.pop() for _ in range(math.ceil(n / BS))]
        seqs.append(
            Seq(
                keys=torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen, dtype=torch.float64),
                values=torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen, dtype=torch.float64),
                queries=torch.randn(n, num_heads, HEAD_DIM, generator=gen, dtype=torch.float64),
                num_cached=num_cached,
                blocks=blocks,
            )
        )
    return seqs


def step_meta(
    seqs: list[Seq], rows: list[tuple[int, int]], table_width: int | None = None
) -> AttentionMetadata:
    """Metadata for computing positions [start, end) of each request (rows), contexts ending at ``end``."""
    width = table_width or max(len(s.blocks) for s in seqs)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, s in enumerate(seqs):
        tables[i, : len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.int32)
    query_start = [0]
    for start, end in rows:
        query_start.append(query_start[-1] + end - start)
    seq_lens = [end for _, end in rows]
    slots = slot_indices_for(tables, query_start, seq_lens, BS).to(torch.int64)
    q_lens = [end - start for start, end in rows]
    return AttentionMetadata(
        query_start_loc=torch.tensor(query_start, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=slots,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_decode_only=all(q == 1 for q in q_lens),
        query_start_loc_cpu=query_start,
        seq_lens_cpu=seq_lens,
    )


def gather_rows(tensors: list[torch.Tensor], rows: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([t[start:end] for t, (start, end) in zip(tensors, rows, strict=True)])


def reference(seqs: list[Seq], rows: list[tuple[int, int]], scale: float) -> torch.Tensor:
    """Dense float64 causal attention straight from each request's unpaged history."""
    outs = []
    for s, (start, end) in zip(seqs, rows, strict=True):
        group = s.queries.shape[1] // s.keys.shape[1]
        q = s.queries[start:end]
        k = s.keys[:end].repeat_interleave(group, dim=1)
        v = s.values[:end].repeat_interleave(group, dim=1)
        scores = torch.einsum("qnd,knd->nqk", q, k) * scale
        allowed = torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        outs.append(torch.einsum("nqk,knd->qnd", probs, v))
    return torch.cat(outs)


def run_step(
    backend: AscendPagedAttention | TorchReferenceAttention,
    kv: torch.Tensor,
    seqs: list[Seq],
    rows: list[tuple[int, int]],
    scale: float,
) -> torch.Tensor:
    meta = step_meta(seqs, rows)
    dtype = kv.dtype
    backend.write_kv(
        kv,
        gather_rows([s.keys.to(dtype) for s in seqs], rows),
        gather_rows([s.values.to(dtype) for s in seqs], rows),
        meta,
    )
    return backend.forward(gather_rows([s.queries.to(dtype) for s in seqs], rows), kv, meta, scale)


def fill_prefix(backend: AscendPagedAttention, kv: torch.Tensor, seqs: list[Seq]) -> None:
    """Write every request's cached prefix as an earlier step would have."""
    cached = [(s, (0, s.num_cached)) for s in seqs if s.num_cached]
    if not cached:
        return
    meta = step_meta([s for s, _ in cached], [r for _, r in cached])
    backend.write_kv(
        kv,
        gather_rows([s.keys.to(kv.dtype) for s, _ in cached], [r for _, r in cached]),
        gather_rows([s.values.to(kv.dtype) for s, _ in cached], [r for _, r in cached]),
        meta,
    )


def check_scenario(
    shapes: list[tuple[int, int]], num_heads: int, num_kv_heads: int, expect_op: str, dtype: torch.dtype
) -> None:
    num_blocks = 24
    ops = EmulatedNpuOps()
    backend = AscendPagedAttention(ops=ops)
    seqs = make_seqs(shapes, num_heads, num_kv_heads, num_blocks)
    kv = torch.zeros(2, num_blocks, BS, num_kv_heads, HEAD_DIM, dtype=dtype)
    scale = HEAD_DIM**-0.5
    fill_prefix(backend, kv, seqs)
    rows = [(s.num_cached, s.seq_len) for s in seqs]
    out = run_step(backend, kv, seqs, rows, scale)
    want = reference(seqs, rows, scale)
    tol = 1e-10 if dtype == torch.float64 else 2e-2
    assert out.shape == want.shape
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    assert ops.calls[-1] == expect_op
    # The CPU reference backend agrees on the same cache and metadata.
    ref_out = TorchReferenceAttention(BS).forward(
        gather_rows([s.queries.to(dtype) for s in seqs], rows), kv, step_meta(seqs, rows), scale
    )
    torch.testing.assert_close(out.double(), ref_out.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 1)])
def test_decode_matches_reference(num_heads: int, num_kv_heads: int) -> None:
    # Contexts inside one block, exactly at a block edge, and spanning three blocks.
    check_scenario([(4, 1), (127, 1), (300, 1)], num_heads, num_kv_heads, "paged_attention", torch.float64)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2)])
def test_prefill_matches_reference(num_heads: int, num_kv_heads: int) -> None:
    check_scenario(
        [(0, 1), (0, 17), (0, 200)], num_heads, num_kv_heads, "fused_infer_attention", torch.float64
    )


def test_chunked_prefill_with_cached_prefix() -> None:
    # A prefix-cache hit of whole blocks, and a second chunk after a partial first chunk.
    check_scenario([(128, 64), (50, 100), (256, 129)], 8, 2, "fused_infer_attention", torch.float64)


def test_mixed_decode_and_prefill_batch() -> None:
    check_scenario([(40, 1), (0, 33), (130, 1), (128, 70)], 4, 1, "fused_infer_attention", torch.float64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_caches(dtype: torch.dtype) -> None:
    check_scenario([(60, 1), (0, 40)], 8, 2, "fused_infer_attention", dtype)
    check_scenario([(60, 1), (200, 1)], 8, 2, "paged_attention", dtype)


def test_decode_steps_after_prefill_accumulate_in_cache() -> None:
    """Prefill, then three decode steps, each writing its token before attending (the runner's order)."""
    ops = EmulatedNpuOps()
    backend = AscendPagedAttention(ops=ops)
    seqs = make_seqs([(0, 130), (0, 5)], 4, 2, 8, seed=3)
    kv = torch.zeros(2, 8, BS, 2, HEAD_DIM, dtype=torch.float64)
    scale = 0.3
    prompt = [(0, 127), (0, 2)]
    torch.testing.assert_close(run_step(backend, kv, seqs, prompt, scale), reference(seqs, prompt, scale))
    for step in range(3):
        rows = [(127 + step, 128 + step), (2 + step, 3 + step)]
        out = run_step(backend, kv, seqs, rows, scale)
        torch.testing.assert_close(out, reference(seqs, rows, scale))
    assert ops.calls.count("paged_attention") == 3


def test_prepared_inputs_have_the_ops_forms() -> None:
    seqs = make_seqs([(10, 3), (0, 1), (250, 1)], 4, 2, 16)
    rows = [(10, 13), (0, 1), (250, 251)]
    meta = step_meta(seqs, rows)
    inputs = prepare_ascend_inputs(meta, block_table_width=16)
    assert inputs.block_tables.shape == (3, 16) and inputs.block_tables.dtype == torch.int32
    assert torch.equal(inputs.block_tables[:, :2], meta.block_tables[:, :2])
    assert torch.count_nonzero(inputs.block_tables[:, 2:]) == 0  # padding is block 0
    assert inputs.context_lens.dtype == torch.int32 and inputs.context_lens.device.type == "cpu"
    assert inputs.context_lens.tolist() == [13, 1, 251]
    assert inputs.actual_seq_lengths_q == [3, 4, 5]  # cumulative row ends (TND)
    assert inputs.actual_seq_lengths_kv == [13, 1, 251]  # per request
    assert inputs.query_lens == [3, 1, 1] and inputs.num_tokens == 5 and not inputs.decode_only
    assert inputs.slot_indices.dtype == torch.int32
    expected_slots = [seqs[0].blocks[0] * BS + p for p in (10, 11, 12)]
    expected_slots += [seqs[1].blocks[0] * BS, seqs[2].blocks[1] * BS + 250 - BS]
    assert inputs.slot_indices.tolist() == expected_slots


def test_preparation_rejects_inconsistent_metadata() -> None:
    seqs = make_seqs([(0, 200)], 4, 2, 4)
    meta = step_meta(seqs, [(0, 200)])
    with pytest.raises(ValueError, match="block table width 1"):
        prepare_ascend_inputs(meta, block_table_width=1)
    narrow = step_meta(seqs, [(0, 200)])
    narrow.block_tables = narrow.block_tables[:, :1]
    with pytest.raises(ValueError, match="needs 2 blocks"):
        prepare_ascend_inputs(narrow)
    too_many = step_meta(seqs, [(0, 200)])
    too_many.seq_lens_cpu = [100]
    with pytest.raises(ValueError, match="context of only 100"):
        prepare_ascend_inputs(too_many)
    with pytest.raises(ValueError, match="block size 128"):
        prepare_ascend_inputs(meta, block_size=16)


def test_block_size_128_is_enforced() -> None:
    assert ASCEND_PROFILE.kv_block_size == ASCEND_BLOCK_SIZE == 128
    with pytest.raises(ValueError, match="block size 128"):
        AscendPagedAttention(16, ops=EmulatedNpuOps())
    backend = AscendPagedAttention(ops=EmulatedNpuOps())
    caches = backend.allocate_kv_cache(2, 3, 2, HEAD_DIM, torch.bfloat16, torch.device("cpu"))
    assert [c.shape for c in caches] == [(2, 3, 128, 2, HEAD_DIM)] * 2
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        backend.allocate_kv_cache(1, 3, 2, HEAD_DIM, torch.float32, torch.device("cpu"))


def test_pad_block_tables_truncates_only_unused_columns() -> None:
    table = torch.tensor([[5, 6, 7, 0], [1, 0, 0, 0]], dtype=torch.int64)
    assert pad_block_tables(table, 3, [3, 1]).tolist() == [[5, 6, 7], [1, 0, 0]]
    assert pad_block_tables(table, 6, [3, 1]).tolist() == [[5, 6, 7, 0, 0, 0], [1, 0, 0, 0, 0, 0]]
    with pytest.raises(ValueError):
        pad_block_tables(table, 2, [3, 1])


def test_causal_mask_is_the_compressed_2048_mask() -> None:
    mask = causal_mask("cpu")
    assert mask.shape == (FIA_MASK_SIZE, FIA_MASK_SIZE) and mask.dtype == torch.bool
    assert not mask[5, 5] and mask[5, 6] and not mask[6, 5]


def test_real_ops_need_torch_npu_and_it_is_never_imported() -> None:
    # On this CPU machine constructing the real ops fails clearly instead of crashing later.
    if "torch_npu" in sys.modules:
        pytest.skip("torch_npu is present in this process")
    with pytest.raises(RuntimeError, match="torch_npu"):
        AscendPagedAttention()
    import ominix_worker.devices_ascend  # noqa: F401  (module import must not load torch_npu)

    assert "torch_npu" not in sys.modules
