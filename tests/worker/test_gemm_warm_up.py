"""``ModelRunner.warm_up_gemm_rows`` (the worker's OMINIX_WARM_GEMM_ROWS): each distinct linear layer's GEMM runs
once at the top row count of every bucket up to the step budget, as a step calls it (a column-parallel layer
with its bias, a row-parallel one without its reduction), the LM head only when asked, and CPU-packed weights
never (nothing of cuBLAS's to warm there)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ominix_worker.ops import cpu_gemm
from ominix_worker.parallel import PackableLinear, ParallelLMHead, RowParallelLinear
from ominix_worker.runner import ModelRunner, build_runner, gemm_warm_up_rows

Call = tuple[str, tuple[int, ...], bool, int]  # layer class, weight shape, bias passed, rows


def test_bucket_tops_up_to_the_budget() -> None:
    assert gemm_warm_up_rows(20, 8) == [8, 16, 20]
    assert gemm_warm_up_rows(16, 8) == [8, 16]
    assert gemm_warm_up_rows(5, 8) == [5]
    assert gemm_warm_up_rows(3, 1) == [1, 2, 3]


def _dense_runner(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, name: str
) -> tuple[ModelRunner, Counter[Call]]:
    """A runner of the tiny model ``name`` with dense weights (as on CUDA), every GEMM counted; a reduction
    across ranks fails the test."""
    monkeypatch.setattr(cpu_gemm, "can_pack", lambda weight: False)
    runner = build_runner(str(tiny_model_dir(name)), num_blocks=16, block_size=16)
    calls: Counter[Call] = Counter()
    gemm = PackableLinear.gemm

    def counting(self: PackableLinear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        assert x.is_contiguous() and x.shape[1] == self.weight.shape[1] and x.dtype == self.weight.dtype
        calls[(type(self).__name__, tuple(self.weight.shape), bias is not None, x.shape[0])] += 1
        return gemm(self, x, bias)

    def no_reduction(self: RowParallelLinear, out: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the warm-up reduced across ranks")

    monkeypatch.setattr(PackableLinear, "gemm", counting)
    monkeypatch.setattr(RowParallelLinear, "_reduced", no_reduction)
    return runner, calls


def _expected(runner: ModelRunner, rows: list[int], lm_head: bool) -> Counter[Call]:
    """One call per bucket top for each distinct layer; a column-parallel layer passes its bias."""
    layers = {
        (
            type(m).__name__,
            tuple(m.weight.shape),
            getattr(m, "bias", None) is not None and not isinstance(m, RowParallelLinear),
        )
        for m in runner.model.modules()
        if isinstance(m, PackableLinear) and (lm_head or not isinstance(m, ParallelLMHead))
    }
    return Counter({(*layer, n): 1 for layer in layers for n in rows})


@pytest.mark.parametrize("name", ["llama", "qwen2"])  # qwen2: biased q, k, v and a tied LM head
def test_every_distinct_linear_once_per_bucket(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    runner, calls = _dense_runner(tiny_model_dir, monkeypatch, name)
    expected = _expected(runner, [16, 32, 40], lm_head=False)
    assert len({call[:3] for call in expected}) >= 3  # qkv, o, gate_up, down (some may coincide here)
    if name == "qwen2":
        assert any(call[2] for call in expected)  # a biased projection, warmed with its bias
    assert runner.warm_up_gemm_rows(40, 16) == sum(expected.values())
    assert calls == expected
    assert runner.warm_up_gemm_rows(40, 0) == 0


def test_the_lm_head_only_when_asked(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, calls = _dense_runner(tiny_model_dir, monkeypatch, "llama")
    expected = _expected(runner, [8, 16], lm_head=True)
    assert any(call[0] == "ParallelLMHead" for call in expected)
    assert runner.warm_up_gemm_rows(16, 8, lm_head=True) == sum(expected.values())
    assert calls == expected


def test_packed_cpu_weights_are_left_alone(tiny_model_dir: Callable[[str], Path]) -> None:
    runner = build_runner(str(tiny_model_dir("llama")), num_blocks=16, block_size=16)
    layers = [m for m in runner.model.modules() if isinstance(m, PackableLinear)]
    if not all(m.packed is not None for m in layers if not isinstance(m, ParallelLMHead)):
        pytest.skip("this CPU does not pack every layer's weight (no oneDNN for its dtype)")
    assert runner.warm_up_gemm_rows(40, 16) == 0
