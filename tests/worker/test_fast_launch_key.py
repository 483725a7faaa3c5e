"""ominix_worker.ops.launch: the fast launch's key refines Triton's own specialization of every argument (so a key
names one compiled kernel), and the binding fills defaults and separates launch options. Host-side only: Triton
is imported, nothing is launched (tests/gpu/test_fast_launch.py launches)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("under TRITON_INTERPRET every launch is Triton's own", allow_module_level=True)

from ominix_worker.ops import launch  # noqa: E402


@triton.jit
def _kernel(x_ptr, n, scale, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = 3):  # pragma: no cover
    pass


INTS = [*range(-40, 41), 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63 - 1, 2**63, 2**64 - 1, 4096, 4097]


def _tensors() -> list[torch.Tensor]:
    base16 = torch.zeros(64, dtype=torch.bfloat16)
    base32 = torch.zeros(64, dtype=torch.float32)
    return [base16[i:] for i in range(9)] + [base32[i:] for i in range(5)]


def _triton_spec(value: object) -> object:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, value, False, True, True)


def test_equal_keys_mean_equal_triton_specializations() -> None:
    values: list[object] = [*INTS, *_tensors(), True, False, 0.5, 1.0, None]
    for a, b in itertools.combinations(values, 2):
        if launch._arg_key(a) == launch._arg_key(b):
            assert _triton_spec(a) == _triton_spec(b), (a, b)
    # and the key tells apart what Triton does
    assert launch._arg_key(17) == launch._arg_key(33) != launch._arg_key(32) != launch._arg_key(1)
    assert launch._arg_key(2**31 - 1) != launch._arg_key(2**31 + 15)
    aligned, offset = _tensors()[0], _tensors()[1]
    assert launch._arg_key(aligned) != launch._arg_key(offset)  # 2 bytes off a 16-byte boundary


def test_bind_fills_defaults_and_keeps_options_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the key's device; no GPU needed here
    kernel = launch.FastKernel(_kernel)
    x = torch.zeros(8)
    values, options = kernel.bind((x, 7), {"scale": 0.5, "flag": True, "BLOCK": 64, "num_warps": 4})
    assert values == [x, 7, 0.5, True, 64, 3] and options == {"num_warps": 4}
    with pytest.raises(TypeError, match="'BLOCK' missing"):
        kernel.bind((x, 7, 0.5, True), {})
    key = kernel.key(values, options)
    assert key[1][4] == 64 and key[1][5] == 3  # constexprs by value
    with pytest.raises(launch._Unkeyable):  # a type the key does not describe: Triton's own launch serves it
        kernel.key(*kernel.bind((x, (1, 2), 0.5, True), {"BLOCK": 64}))
    again = kernel.key(*kernel.bind((x, 23, 0.25, False), {"BLOCK": 64, "num_warps": 4}))
    assert again == key  # 7 and 23: both non-1, not multiples of 16, i32; floats and bools by type
    assert kernel.key(*kernel.bind((x, 7, 0.5, True), {"BLOCK": 128, "num_warps": 4})) != key
    assert kernel.key(*kernel.bind((x, 7, 0.5, True), {"BLOCK": 64, "num_warps": 8})) != key


def test_on_only_for_a_checked_triton_and_off_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch.triton, "__version__", "3.6.0")
    kernel = launch.FastKernel(_kernel)
    assert launch.triton_checked() and kernel.enabled
    monkeypatch.setattr(launch, "KERNELS", [kernel])
    launch.set_fast_launch(False)  # the worker's OMINIX_TRITON_FAST_LAUNCH=0
    try:
        assert not kernel.enabled and not launch.FastKernel(_kernel).enabled
    finally:
        launch.set_fast_launch(True)
    assert kernel.enabled
    monkeypatch.setattr(launch.triton, "__version__", "3.7.1")  # not checked against this path
    assert not launch.triton_checked() and not launch.FastKernel(_kernel).enabled
    kernel = launch.FastKernel(_kernel)
    assert kernel[(1,)] is not None  # Triton's own launcher, returned as is
