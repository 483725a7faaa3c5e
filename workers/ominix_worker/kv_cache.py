"""Size and allocate the paged KV cache: from a byte budget on the CPU, from measured free memory on GPUs."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from ominix_worker.attention.base import AttentionBackend
from ominix_worker.config import ModelConfig

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "t": 1000**4,
    "tb": 1000**4,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """'1GiB', '512MiB', '1e9'-free integers, '2GB' → bytes."""
    if isinstance(text, int):
        return text
    match = _BYTES_RE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"bad byte size {text!r}: use e.g. 1073741824, 512MiB or 1GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def resolve_kv_cache_dtype(name: str, run_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """--kv-cache-dtype: "auto" keeps the run dtype; "fp8_e4m3" stores e4m3 (CPU reference and CUDA kernels)."""
    key = name.lower()
    if key == "auto":
        return run_dtype
    if key in ("fp8", "fp8_e4m3", "float8_e4m3fn"):
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"--kv-cache-dtype {name} is not supported on {device.type}")
        return torch.float8_e4m3fn
    raise ValueError(f"unknown --kv-cache-dtype {name!r}: auto or fp8_e4m3")


def kv_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None
) -> int:
    """K and V, all layers (and compressed rows), one block; ``num_kv_heads``: the heads one tensor-parallel
    rank keeps."""
    element = torch.tensor([], dtype=dtype).element_size()
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * config.num_kv_cache_layers * block_size * heads * config.head_dim * element


def num_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    return max(0, budget_bytes // bytes_per_block)


def measure_gpu_kv_budget(
    device: torch.device, utilization: float, profile_forward: Callable[[], None], accel: Any = None
) -> int:
    """Bytes left for KV on a GPU: utilization × total, minus what stays in use (weights, context, other
    processes) and minus the activation peak of a forward of the largest step the worker accepts.

    ``accel`` is torch.cuda (or torch.npu); tests pass a stand-in.
    """
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    if accel is None:
        accel = torch.cuda if device.type == "cuda" else getattr(torch, device.type)
    accel.synchronize(device)
    accel.empty_cache()
    accel.reset_peak_memory_stats(device)
    profile_forward()
    accel.synchronize(device)
    accel.empty_cache()  # cached activation blocks would otherwise count twice (in use and as the peak)
    free, total = accel.mem_get_info(device)
    peak_activations = accel.max_memory_allocated(device) - accel.memory_allocated(device)
    in_use = total - free
    return int(total * utilization - in_use - peak_activations)


def allocate_kv_cache(
    backend: AttentionBackend,
    config: ModelConfig,
    num_blocks: int,
    dtype: torch.dtype,
    device: torch.device,
    num_kv_heads: int | None = None,
) -> list[torch.Tensor]:
    """One KV tensor per layer, then one of compressed rows per compressed layer (in layer order); every
    group gets ``num_blocks`` blocks. ``num_kv_heads``: the heads one tensor-parallel rank keeps (default: all)."""
    if num_blocks <= 0:
        raise ValueError("the KV cache budget leaves no room for a single block")
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    return backend.allocate_kv_cache(
        config.num_kv_cache_layers, num_blocks, heads, config.head_dim, dtype, device
    )
