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
