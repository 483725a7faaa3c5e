"""bench/attention_kernels.py's decode-overlap case on a real device, at a small size: every part is timed and
the concurrent run is reported beside the parts it overlaps."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_overlap_decode_times_each_part_and_both_at_once() -> None:
    pytest.importorskip("triton")
    from bench import attention_kernels

    attention_kernels.ROWS.clear()
    attention_kernels.overlap_decode(torch.Generator().manual_seed(0), batch=16, layers=2, lo=64, hi=96)
    rows = {r["impl"]: r for r in attention_kernels.ROWS if r["kind"] == "overlap"}
    assert set(rows) == {
        "paged attention alone",
        "layer GEMMs alone, M=16",
        "layer GEMMs alone, 2 x M=8",
        "attention then GEMMs (sum)",
        "attention beside GEMMs, two streams",
    }
    assert all(r["ms"] > 0 for r in rows.values())
    a, g = rows["paged attention alone"]["ms"], rows["layer GEMMs alone, M=16"]["ms"]
    assert rows["attention then GEMMs (sum)"]["ms"] == pytest.approx(a + g)
    both = rows["attention beside GEMMs, two streams"]
    assert both["hidden"] == pytest.approx((a + g - both["ms"]) / min(a, g))


def test_prefill_rows_time_torch_flash_varlen_beside_ours() -> None:
    """A fresh-prompt case reports torch's FlashAttention-2 varlen row beside SDPA and ours, each close to SDPA's
    output; a case after a cached prefix has no such row (the packed kernel takes the step's own K/V only)."""
    pytest.importorskip("triton")
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        pytest.skip("this torch has no FlashAttention varlen entry point")
    from bench import attention_kernels

    attention_kernels.ROWS.clear()
    gen = torch.Generator().manual_seed(0)
    attention_kernels.bench_prefill(2, 64, 0, 1e15, gen, [None])
    attention_kernels.bench_prefill(1, 32, 64, 1e15, gen, [None])
    fresh = {r["impl"]: r for r in attention_kernels.ROWS if r["case"] == "B=2 new=64 prefix=0"}
    assert set(fresh) == {"torch sdpa (contiguous KV)", "torch flash varlen (packed KV)", "triton paged"}
    assert all(r["ms"] > 0 for r in fresh.values())
    assert fresh["torch flash varlen (packed KV)"]["err_vs_sdpa"] < 1e-2
    assert fresh["triton paged"]["err_vs_sdpa"] < 1e-2
    after_prefix = [r["impl"] for r in attention_kernels.ROWS if r["case"] == "B=1 new=32 prefix=64"]
    assert "torch flash varlen (packed KV)" not in after_prefix and "triton paged" in after_prefix


def test_decode_grid_order_times_both_orders_with_equal_outputs() -> None:
    pytest.importorskip("triton")
    from bench import attention_kernels

    attention_kernels.ROWS.clear()
    gen = torch.Generator().manual_seed(0)
    attention_kernels.decode_grid_order(16, 64, 96, 1e12, gen, layers=2, rounds=2)
    rows = [r for r in attention_kernels.ROWS if r["kind"] == "decode"]
    assert [r["impl"] for r in rows] == [
        "heads first, round 1",
        "requests first, round 1",
        "heads first, round 2",
        "requests first, round 2",
    ]
    assert all(r["ms"] > 0 and r["elements_differing"] == 0 for r in rows)
