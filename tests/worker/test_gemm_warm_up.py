"""``ModelRunner.warm_up_gemm_rows`` (the worker's OMINIX_WARM_GEMM_ROWS): each distinct dense linear's GEMM runs
once at the top row count of every bucket up to the step budget, the LM head's never (its rows are padded to
captured sizes), and CPU-packed weights are left alone (nothing of cuBLAS's to warm there)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ominix_worker.ops import cpu_gemm
from ominix_worker.parallel import PackableLinear, ParallelLMHead
from ominix_worker.runner import build_runner, gemm_warm_up_rows


def test_bucket_tops_up_to_the_budget() -> None:
    assert gemm_warm_up_rows(20, 8) == [8, 16, 20]
    assert gemm_warm_up_rows(16, 8) == [8, 16]
    assert gemm_warm_up_rows(5, 8) == [5]
    assert gemm_warm_up_rows(3, 1) == [1, 2, 3]


def test_every_distinct_dense_linear_once_per_bucket(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_gemm, "can_pack", lambda weight: False)  # dense weights, as on CUDA
    runner = build_runner(str(tiny_model_dir("llama")), num_blocks=16, block_size=16)
    calls: Counter[tuple[str, tuple[int, ...], int]] = Counter()
    gemm = PackableLinear.gemm

    def counting(self: PackableLinear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        assert x.is_contiguous() and x.shape[1] == self.weight.shape[1]
        calls[(type(self).__name__, tuple(self.weight.shape), x.shape[0])] += 1
        return gemm(self, x, bias)

    monkeypatch.setattr(PackableLinear, "gemm", counting)
    dense = {
        (type(m).__name__, tuple(m.weight.shape))
        for m in runner.model.modules()
        if isinstance(m, PackableLinear) and not isinstance(m, ParallelLMHead)
    }
    assert len(dense) >= 3  # qkv, o, gate_up, down: some shapes may coincide in the tiny model
    made = runner.warm_up_gemm_rows(40, 16)
    rows = [16, 32, 40]
    assert made == len(dense) * len(rows)
    assert calls == Counter({(name, shape, n): 1 for name, shape in dense for n in rows})
    assert runner.warm_up_gemm_rows(40, 0) == 0


def test_packed_cpu_weights_have_nothing_to_warm(tiny_model_dir: Callable[[str], Path]) -> None:
    runner = build_runner(str(tiny_model_dir("llama")), num_blocks=16, block_size=16)
    packed = [m for m in runner.model.modules() if isinstance(m, PackableLinear) and m.packed is not None]
    if not packed:
        pytest.skip("this CPU packs no weight (no oneDNN)")
    dense = [
        m
        for m in runner.model.modules()
        if isinstance(m, PackableLinear) and m.packed is None and not isinstance(m, ParallelLMHead)
    ]
    assert runner.warm_up_gemm_rows(40, 16) == (3 * len({(type(m), tuple(m.weight.shape)) for m in dense}))
