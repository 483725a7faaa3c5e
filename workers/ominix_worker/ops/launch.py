"""Triton kernel launches with less host work per call.

An eager step of a Llama-8B-shaped model launches about 190 Triton kernels. Triton's own launch path binds
and specializes every argument, builds and hashes the cache key, and builds launch metadata on every call:
~55 µs a launch on the GPU machine's host, about 15 of the 26 ms it took to launch a 1,024-token mixed step,
longer than the device took to run it (cProfile, H200 machine, 2026-11-29; bench/prefix_step.py
``--launch-pstats``). Decode steps replay CUDA graphs and are not affected.

``fast_kernel(jit_fn)`` wraps a launched kernel: ``kernel[grid](*args, **kwargs)`` as before. Its key holds,
for every argument, what Triton specializes that argument on and more (a tensor's dtype and whether its
address is a multiple of 16; an int's type range, whether it is 1, whether it is a multiple of 16; a
constexpr's value; every launch option), so a key maps to exactly one of Triton's compiled kernels. A key seen
before launches that kernel directly through its launcher; a new key goes through Triton's own launch (which
compiles when needed) and remembers the kernel it launched. Under ``TRITON_INTERPRET``, with a Triton without
the parts used here, or with ``OMINIX_TRITON_FAST_LAUNCH=0`` in the environment, every launch is Triton's own.

``CHECK_AGAINST_TRITON`` (tests) makes every fast launch first ask Triton which kernel it would launch for the
same arguments and fail if that is not the remembered one.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

try:
    from triton import knobs as _knobs
    from triton.runtime.jit import JITFunction as _JITFunction
except ImportError:  # an older Triton: every launch is Triton's own
    _knobs = None
    _JITFunction = None

CHECK_AGAINST_TRITON = False
KERNELS: list[FastKernel] = []  # every wrapped kernel (tests switch the fast path off and on)
_INT32 = (-(2**31), 2**31 - 1)
_UINT64_FROM = 2**63


def _arg_key(value: Any) -> Any:
    """What Triton specializes a non-constexpr argument on, refined: equal keys, equal specializations."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() & 15 == 0)
    if type(value) is bool:
        return ("u1",)
    if type(value) is int:
        in_i32 = _INT32[0] <= value <= _INT32[1]
        return ("int", value == 1, value & 15 == 0, in_i32, value >= _UINT64_FROM)
    if type(value) is float:
        return ("fp32",)
    return ("value", value)  # None, and anything else by value (over-specializing is only more entries)


def _active_hook(hook: Any) -> Any:
    """A launch hook to pass on, or None: Triton 3.6+ keeps an empty hook chain when nothing is hooked."""
    if hook is None or getattr(hook, "calls", True) == []:
        return None
    return hook


class FastKernel:
    """A launched ``@triton.jit`` kernel whose repeat launches skip Triton's per-call binding and keying."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.enabled = (
            _JITFunction is not None
            and _knobs is not None
            and isinstance(fn, _JITFunction)
            and not _knobs.runtime.interpret
            and os.environ.get("OMINIX_TRITON_FAST_LAUNCH", "1") != "0"
        )
        self._cache: dict[tuple[Any, ...], Any] = {}
        self.num_fast_launches = 0  # launches that took the remembered kernel
        if self.enabled:
            params = fn.params
            self._names = [p.name for p in params]
            self._index = {name: i for i, name in enumerate(self._names)}
            self._constexpr = [bool(p.is_constexpr) for p in params]
            self._defaults = [p.default for p in params]

    def forget(self) -> None:
        """Drop every compiled variant, Triton's and the ones remembered here (the next launches compile)."""
        self._cache.clear()
        device_caches = getattr(self.fn, "device_caches", None)
        if device_caches is not None:
            device_caches.clear()

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        if not self.enabled:
            return self.fn[grid]  # type: ignore[no-any-return]
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """Every parameter's value in signature order (defaults filled in), and the launch options."""
        values: list[Any] = list(args) + [inspect.Parameter.empty] * (len(self._names) - len(args))
        options: dict[str, Any] = {}
        for name, value in kwargs.items():
            i = self._index.get(name)
            if i is None:
                options[name] = value  # num_warps, num_stages, ...
            else:
                values[i] = value
        for i in range(len(args), len(values)):
            if values[i] is inspect.Parameter.empty:
                if self._defaults[i] is inspect.Parameter.empty:
                    raise TypeError(f"{self._names[i]!r} missing in a launch of {self.fn.__name__}")
                values[i] = self._defaults[i]
        return values, options

    def key(self, values: list[Any], options: dict[str, Any]) -> tuple[Any, ...]:
        specs = tuple(
            value if constexpr else _arg_key(value)
            for value, constexpr in zip(values, self._constexpr, strict=True)
        )
        return (torch.cuda.current_device(), specs, tuple(sorted(options.items())))

    def _launch(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        values, options = self.bind(args, kwargs)
        key = self.key(values, options)
        kernel = self._cache.get(key)
        if kernel is None:  # Triton's own launch: binds, compiles if needed, launches
            kernel = self.fn.run(*args, grid=grid, warmup=False, **kwargs)
            if hasattr(kernel, "result"):  # compiled asynchronously
                kernel = kernel.result()
            self._cache[key] = kernel
            return
        if CHECK_AGAINST_TRITON:
            chosen = self.fn.run(*args, grid=grid, warmup=True, **kwargs)
            if hasattr(chosen, "result"):
                chosen = chosen.result()
            if chosen is not kernel:
                raise AssertionError(
                    f"{self.fn.__name__}: the fast launch's kernel is not Triton's for {key}"
                )
        self.num_fast_launches += 1
        device = key[0]
        stream = torch._C._cuda_getCurrentRawStream(device)
        enter = _active_hook(_knobs.runtime.launch_enter_hook)  # type: ignore[union-attr]
        leave = _active_hook(_knobs.runtime.launch_exit_hook)  # type: ignore[union-attr]
        metadata = kernel.launch_metadata(grid, stream, *values) if enter is not None else None
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kernel.run(
            grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, metadata, enter, leave, *values
        )


def fast_kernel(fn: Any) -> FastKernel:
    """Decorator, above ``@triton.jit``, for kernels launched from the host (never for ones other kernels
    call)."""
    kernel = FastKernel(fn)
    KERNELS.append(kernel)
    return kernel
