"""Parse and check the worker's device (cpu, cuda:N, npu:N) and pick its default dtype."""

from __future__ import annotations

import functools
import re

import torch

from ominix_runtime.byte_sizes import DTYPE_ALIASES
from ominix_runtime.contract import BackendKind

_DEVICE_RE = re.compile(r"^(cpu|cuda|npu)(?::(\d+))?$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeviceError(RuntimeError):
    """The requested device does not exist or its runtime is not installed."""


def parse_device(spec: str) -> torch.device:
    """'cpu', 'cuda', 'cuda:N', 'npu:N' → a torch.device that exists on this machine, else DeviceError."""
    match = _DEVICE_RE.match(spec.strip().lower())
    if not match:
        raise DeviceError(f"bad device {spec!r}: expected cpu, cuda:N or npu:N")
    kind, index_text = match.group(1), match.group(2)
    if kind == "cpu":
        if index_text not in (None, "0"):
            raise DeviceError(f"bad device {spec!r}: the CPU has no index")
        return torch.device("cpu")
    index = int(index_text or 0)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {spec} not found: CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if index >= count:
            raise DeviceError(f"device {spec} not found: this machine has {count} CUDA device(s)")
        return torch.device("cuda", index)
    try:
        import torch_npu  # noqa: F401  (registers the npu device with torch)
    except ImportError:
        raise DeviceError(f"device {spec} needs torch_npu, which is not installed") from None
    count = torch.npu.device_count()  # type: ignore[attr-defined]  # torch_npu adds torch.npu when imported
    if index >= count:
        raise DeviceError(f"device {spec} not found: this machine has {count} NPU(s)")
    return torch.device("npu", index)


def make_current(device: torch.device) -> None:
    """Make a CUDA ``device`` this process's current one: Triton kernels launch, and CUDA graphs capture, on the
    current device whatever device their tensors are on (a worker on cuda:1 left at cuda:0 fails at warm-up).
    A bare ``cuda`` names the current device already: nothing to change."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def backend_kind(device: torch.device) -> BackendKind:
    return {"cpu": BackendKind.CPU, "cuda": BackendKind.CUDA, "npu": BackendKind.ASCEND}[device.type]


@functools.cache
def sm_count(device: torch.device, off_gpu: int = 1) -> int:
    """Streaming multiprocessors of a CUDA device; ``off_gpu`` elsewhere (Triton's CPU interpreter), where a
    kernel's grid is sized as if for that many."""
    return (
        torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else off_gpu
    )


def device_name(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"


def cpu_has_native_bf16() -> bool:
    """The CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX) and oneDNN takes bfloat16 here."""
    probes = [
        getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    ]
    native = any(probe() for probe in probes if probe is not None)
    return native and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' → bfloat16, except float32 on a CPU without native bfloat16; otherwise the named dtype.

    Decode on a CPU reads every weight each step, so bfloat16 weights halve the bytes a step moves. With
    hardware bfloat16 products (AVX512-BF16, AMX), SmolLM2-135M's median TPOT through the service on a quiet
    2-core box was 57.3 ms in bfloat16 against 68.9 ms in float32 (bench/RESULTS.md, CPU daemon). vLLM's CPU
    backend defaults to bfloat16 too.
    Without those instructions oneDNN would emulate the products, so float32 stays the default there."""
    key = DTYPE_ALIASES.get(name.lower(), name.lower())
    if key == "auto":
        if device.type == "cpu" and not cpu_has_native_bf16():
            return torch.float32
        return torch.bfloat16
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}: auto, float32, bfloat16 or float16")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
