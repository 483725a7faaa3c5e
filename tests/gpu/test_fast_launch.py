"""The fast Triton launch (ominix_worker.ops.launch) on the GPU: each wrapped op gives bit-identical outputs with
the fast path off and on, over inputs whose alignment and sizes put them in different specialization classes;
the repeat launches take the fast path, and every one picks the kernel Triton itself would launch
(CHECK_AGAINST_TRITON, set for all GPU tests by conftest)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@contextmanager
def _fast(enabled: bool) -> Iterator[None]:
    from ominix_worker.ops import launch

    saved = [k.enabled for k in launch.KERNELS]
    for kernel, was in zip(launch.KERNELS, saved, strict=True):
        kernel.enabled = enabled and was
    try:
        yield
    finally:
        for kernel, was in zip(launch.KERNELS, saved, strict=True):
            kernel.enabled = was


def _cases() -> list[tuple[int, int]]:
    # (rows, first row offset): 1 row, multiples of 16 and not, and views that start off a 16-byte boundary
    return [(1, 0), (16, 0), (17, 0), (33, 1), (64, 3), (257, 0)]


def _compare(op: Callable[[torch.Tensor], torch.Tensor], width: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, offset in _cases():
        base = torch.randn(rows + offset, width, device="cuda", dtype=torch.bfloat16, generator=gen)
        x = base[offset:]
        with _fast(False):
            slow = op(x.clone())
        for _ in range(3):  # the first launch of a class is Triton's own, the next ones the fast path's
            fast = op(x.clone())
            assert torch.equal(fast, slow), (rows, offset)


def test_fused_ops_match_with_and_without_the_fast_launch() -> None:
    from ominix_worker.ops import fused, launch
    from ominix_worker.ops.greedy import greedy_argmax

    hidden = 4096
    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    residual_base = torch.randn(300, hidden, device="cuda", dtype=torch.bfloat16)

    def add_norm(x: torch.Tensor) -> torch.Tensor:
        residual = residual_base[: x.shape[0]].clone()
        out = fused.fused_add_rms_norm(x, residual, weight, 1e-5)
        return torch.cat([out, residual])

    _compare(lambda x: fused.rms_norm(x, weight, 1e-5), hidden)
    _compare(add_norm, hidden)
    _compare(lambda x: fused.silu_and_mul(x), 2 * 1792)
    positions_all = torch.arange(300, device="cuda") * 7 % 2048
    table = torch.randn(2, 2048, 128, device="cuda", dtype=torch.float32)

    def rotary(x: torch.Tensor) -> torch.Tensor:
        heads = x.view(x.shape[0], -1, 128)
        fused.rotary_in_place(heads, positions_all[: x.shape[0]], table)
        return heads

    _compare(rotary, 8 * 128)

    def greedy(x: torch.Tensor) -> torch.Tensor:
        ids, bad = greedy_argmax(x.float())
        return torch.cat([ids.float(), bad.float()])

    _compare(greedy, 32000)
    names = {"_rms_norm_kernel", "_silu_and_mul_kernel", "_rotary_kernel", "_greedy_kernel"}
    used = [k for k in launch.KERNELS if k.fn.__name__ in names]
    assert len(used) == 4 and all(k.enabled and k.num_fast_launches > 0 for k in used)
