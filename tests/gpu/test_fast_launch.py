"""The fast Triton launch (ominix_worker.ops.launch) on the GPU: the norm, SiLU·mul, RoPE and greedy ops give
bit-identical outputs with the fast path off and on, over views whose start address, row count and row stride
put the launches under different keys; the repeat launches take the fast path, and every one picks the kernel
Triton itself would launch (CHECK_AGAINST_TRITON, set by conftest for the GPU and worker tests). The attention
kernels are checked the same way by the attention and runner GPU tests."""

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


# (rows, offset in elements of the view's start, padding of each row): 1 row and several; views that start 2, 4
# or 6 bytes off a 16-byte boundary; row strides that are and are not multiples of 16 elements. Each changes
# what Triton specializes the launch on (an address's alignment, an int that is 1 or a multiple of 16).
CASES = [(1, 0, 0), (16, 0, 0), (17, 1, 0), (33, 3, 1), (64, 0, 7), (257, 2, 0)]


def _view(rows: int, width: int, offset: int, pad: int, dtype: torch.dtype) -> torch.Tensor:
    """A fresh (rows, width) view, the same values each call: ``offset`` elements into its storage, rows
    ``width + pad`` apart."""
    gen = torch.Generator(device="cuda").manual_seed(rows * 131 + offset)
    flat = torch.randn(offset + rows * (width + pad), device="cuda", generator=gen).to(dtype)
    return flat[offset:].view(rows, width + pad)[:, :width]


def _compare(
    op: Callable[[torch.Tensor], torch.Tensor], width: int, dtype: torch.dtype = torch.bfloat16
) -> None:
    for rows, offset, pad in CASES:
        with _fast(False):
            slow = op(_view(rows, width, offset, pad, dtype))
        for _ in range(3):  # the first launch of a key is Triton's own, the next ones the fast path's
            fast = op(_view(rows, width, offset, pad, dtype))
            assert torch.equal(fast, slow), (rows, offset, pad)


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
        ids, bad = greedy_argmax(x)
        return torch.cat([ids.float(), bad.float()])

    _compare(greedy, 32000, torch.float32)
    names = {"_rms_norm_kernel", "_silu_and_mul_kernel", "_rotary_kernel", "_greedy_kernel"}
    used = [k for k in launch.KERNELS if k.fn.__name__ in names]
    assert len(used) == 4
    for kernel in used:  # the fast path served launches, under several keys
        assert kernel.enabled and kernel.num_fast_launches > 0 and kernel.num_variants >= 3, (
            kernel.fn.__name__
        )
