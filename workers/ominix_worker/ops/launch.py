"""Triton kernel launches with less host work per call.

An eager step of a Llama-8B-shaped model launches about 190 Triton kernels. Triton's own launch path binds and
specializes every argument, builds and hashes the cache key and builds launch metadata on every call (~80 µs
a launch under cProfile on the GPU machine's host). Launching a 1,024-token mixed step through this path
instead took 12.1 against 13.4 ms on one H200 machine and 16.0 against 26.9 ms on another, in paired runs
(2026-11-29, bench/prefix_step.py ``--triton-launch`` and ``mixed_step_host_launch``); the hosts' launch times
vary up to 2x between machines and runs. Decode steps replay CUDA graphs.

The MoE and FP8 kernels keep Triton's own launch: wrapped as well, a Qwen3-30B-A3B-shaped eager step's launch
was slower at the median, not faster, in six of six pairs on two H200 machines (bench/RESULTS.md, 2026-11-29
17:46 UTC).

``fast_kernel(jit_fn)`` wraps a kernel launched from the host: ``kernel[grid](*args, **kwargs)`` as before. Its
key holds, for every argument, what Triton specializes that argument on and more (a tensor's dtype and whether
its address is a multiple of 16; an int's type range, whether it is 1, whether it is a multiple of 16; a
constexpr's value; every launch option and Triton's debug and instrumentation settings), so a key maps to
exactly one of Triton's compiled kernels. A key seen before launches that kernel directly through its launcher;
a new key goes through Triton's own launch (which compiles when needed) and remembers the kernel it launched.
Triton's own launch serves every call under ``TRITON_INTERPRET``, with a Triton other than the versions this
was checked against (``CHECKED_TRITON``), after ``set_fast_launch(False)`` (the worker's
``OMINIX_TRITON_FAST_LAUNCH=0``), for a callable grid, an argument of a type the key does not describe, or a
kernel with pre-run hooks.

``CHECK_AGAINST_TRITON`` (tests) makes every fast launch first ask Triton which kernel it would launch for the
same arguments and fail if that is not the remembered one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    from triton import knobs as _knobs
    from triton.runtime.jit import JITFunction as _JITFunction
except ImportError:  # a Triton without knobs: every launch is Triton's own
    triton = None
    _knobs = None
    _JITFunction = None

# Triton versions (major, minor) whose specialization rules and launcher call were checked against this path
# (on a GPU, every fast launch of the GPU tests compared with Triton's own choice).
CHECKED_TRITON = frozenset({(3, 6)})
CHECK_AGAINST_TRITON = False
KERNELS: list[FastKernel] = []  # every wrapped kernel
_fast_launch_on = True  # set_fast_launch
_INT32 = (-(2**31), 2**31 - 1)
_UINT64_FROM = 2**63


class _Unkeyable(Exception):
    """An argument the key does not describe: the launch is Triton's own."""


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
    if value is None:
        return None
    raise _Unkeyable(type(value).__name__)


def _active_hook(hook: Any) -> Any:
    """A launch hook to pass on, or None: Triton 3.6 keeps an empty hook chain when nothing is hooked."""
    if hook is None or getattr(hook, "calls", True) == []:
        return None
    return hook


def _resolved(kernel: Any) -> Any:
    """Triton's compiled kernel (it hands back a future when it compiles asynchronously)."""
    return kernel.result() if hasattr(kernel, "result") else kernel


def triton_checked() -> bool:
    """This Triton is one the fast path was checked against, and not its interpreter."""
    if triton is None or _knobs is None or _knobs.runtime.interpret:
        return False
    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    return (major, minor) in CHECKED_TRITON


class FastKernel:
    """A launched ``@triton.jit`` kernel whose repeat launches skip Triton's per-call binding and keying."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        # The fast path can serve this kernel; ``enabled``: it does.
        self.available = _JITFunction is not None and isinstance(fn, _JITFunction) and triton_checked()
        self.enabled = self.available and _fast_launch_on
        self._cache: dict[tuple[Any, ...], Any] = {}
        self.num_fast_launches = 0  # launches that took the remembered kernel
        params = getattr(fn, "params", [])
        self._names = [p.name for p in params]
        self._index = {name: i for i, name in enumerate(self._names)}
        self._constexpr = [bool(p.is_constexpr) for p in params]
        self._defaults = [p.default for p in params]
        # The kernel's own debug flag (jit(debug=...)), read once; Triton's knob is read per call.
        self._debug = getattr(fn, "debug", None)

    @property
    def num_variants(self) -> int:
        """Keys remembered so far (each names one compiled kernel)."""
        return len(self._cache)

    def forget(self) -> None:
        """Drop every compiled variant, Triton's and the ones remembered here (the next launches compile)."""
        self._cache.clear()
        device_caches = getattr(self.fn, "device_caches", None)
        if device_caches is not None:
            device_caches.clear()

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        if not self.enabled or callable(grid) or self.fn.pre_run_hooks:
            return self.fn[grid]
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
        """The launch's key; raises _Unkeyable for an argument it does not describe."""
        specs = tuple(
            value if constexpr else _arg_key(value)
            for value, constexpr in zip(values, self._constexpr, strict=True)
        )
        # What Triton's own launch adds to every call's options (a change must not reuse an older kernel).
        debug = self._debug or (_knobs.runtime.debug if _knobs is not None else None)
        mode = _knobs.compilation.instrumentation_mode if _knobs is not None else None
        return (torch.cuda.current_device(), specs, tuple(sorted(options.items())), debug, mode)

    def _launch(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        values, options = self.bind(args, kwargs)
        try:
            key = self.key(values, options)
            kernel = self._cache.get(key)
        except (_Unkeyable, TypeError):  # TypeError: a constexpr that cannot be hashed
            self.fn.run(*args, grid=grid, warmup=False, **kwargs)
            return
        if kernel is None:  # Triton's own launch: binds, compiles if needed, launches
            self._cache[key] = _resolved(self.fn.run(*args, grid=grid, warmup=False, **kwargs))
            return
        if CHECK_AGAINST_TRITON:
            chosen = _resolved(self.fn.run(*args, grid=grid, warmup=True, **kwargs))
            if chosen is not kernel:
                raise AssertionError(
                    f"{self.fn.__name__}: the fast launch's kernel is not Triton's for {key}"
                )
        self.num_fast_launches += 1
        stream = torch._C._cuda_getCurrentRawStream(key[0])
        enter = _active_hook(_knobs.runtime.launch_enter_hook)
        leave = _active_hook(_knobs.runtime.launch_exit_hook)
        hooked = enter is not None or leave is not None
        metadata = kernel.launch_metadata(grid, stream, *values) if hooked else None
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kernel.run(
            grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, metadata, enter, leave, *values
        )


def set_fast_launch(on: bool) -> None:
    """Turn the fast path on or off for every wrapped kernel, and for the ones wrapped later."""
    global _fast_launch_on
    _fast_launch_on = on
    for kernel in KERNELS:
        kernel.enabled = kernel.available and on


def fast_kernel(fn: Any) -> FastKernel:
    """Decorator, above ``@triton.jit``, for kernels launched from the host (never for ones other kernels
    call)."""
    kernel = FastKernel(fn)
    KERNELS.append(kernel)
    return kernel
