"""Ascend NPU device setup for a worker: torch_npu loading, device selection, dtype rules, capability.

``devices.py`` calls these lazily for ``npu[:N]`` devices; torch_npu is imported only inside the
functions here, so CPU and CUDA machines never need it.

- ``ASCEND_RT_VISIBLE_DEVICES`` (like ``CUDA_VISIBLE_DEVICES``) renumbers the visible NPUs from 0; an index
  in ``npu:N`` is an index into that visible list.
- Collectives use HCCL; Ascend has no custom all-reduce.
- Compute and KV dtypes are float16 or bfloat16.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch

from ominix_runtime.contract import ASCEND_PROFILE, BackendCapability, ModelInfo

VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"
COLLECTIVE_BACKEND = "hccl"
ASCEND_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "auto": "bfloat16"}


class AscendDeviceError(RuntimeError):
    """The requested NPU cannot be used (torch_npu missing, no such device, unsupported dtype)."""


def is_npu_device(device: str) -> bool:
    return device.split(":", 1)[0].strip().lower() == "npu"


def parse_npu_index(device: str) -> int:
    """``npu`` → 0, ``npu:3`` → 3."""
    kind, _, index = device.strip().lower().partition(":")
    if kind != "npu":
        raise AscendDeviceError(f"{device!r} is not an npu device")
    if not index:
        return 0
    if not index.isdigit():
        raise AscendDeviceError(f"bad npu device index in {device!r}")
    return int(index)


def visible_npu_ids(environ: dict[str, str] | None = None) -> list[str] | None:
    """The physical NPU ids ``ASCEND_RT_VISIBLE_DEVICES`` exposes (None when unset: all are visible)."""
    value = (environ if environ is not None else os.environ).get(VISIBLE_DEVICES_ENV)
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def ascend_dtype_name(dtype: str) -> str:
    """Canonical dtype name for an Ascend worker; float32 and others are refused."""
    name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if name not in ASCEND_DTYPES:
        raise AscendDeviceError(f"Ascend workers run float16 or bfloat16, not {dtype}")
    return name


def ascend_torch_dtype(dtype: str) -> torch.dtype:
    return ASCEND_DTYPES[ascend_dtype_name(dtype)]


def import_torch_npu() -> Any:
    """Load torch_npu (it registers the ``npu`` device with torch) or explain what is missing."""
    try:
        import torch_npu  # only on Ascend workers
    except ImportError as exc:
        raise AscendDeviceError(
            "device npu needs torch_npu (the Ascend PyTorch adapter) installed for this torch version, "
            f"with CANN's environment sourced: {exc}"
        ) from exc
    return torch_npu


def npu_available() -> bool:
    """True when torch_npu loads and at least one NPU is visible."""
    try:
        import_torch_npu()
    except AscendDeviceError:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available() and npu.device_count() > 0)


def setup_npu_device(device: str, dtype: str = "bfloat16") -> torch.device:
    """Select ``device`` for this process (``torch.npu.set_device``) and return it; check the dtype first."""
    ascend_dtype_name(dtype)
    index = parse_npu_index(device)
    import_torch_npu()
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        raise AscendDeviceError("torch_npu is installed but reports no usable NPU (is the driver loaded?)")
    count = npu.device_count()
    if index >= count:
        visible = visible_npu_ids()
        where = f" ({VISIBLE_DEVICES_ENV}={','.join(visible)})" if visible is not None else ""
        raise AscendDeviceError(f"device npu:{index} does not exist: {count} NPU(s) visible{where}")
    npu.set_device(index)
    return torch.device("npu", index)


def npu_memory_info(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of ``device``, for sizing the KV cache."""
    free, total = torch.npu.mem_get_info(device)  # type: ignore[attr-defined]  # torch_npu adds torch.npu when imported
    return int(free), int(total)


def npu_device_name(device: torch.device) -> str:
    try:
        return str(torch.npu.get_device_name(device))  # type: ignore[attr-defined]  # torch_npu adds torch.npu when imported
    except (AttributeError, RuntimeError):
        return "Ascend NPU"


def ascend_capability(
    *,
    worker_id: str,
    device: str,
    dtype: str,
    model: ModelInfo,
    kv_num_blocks: int,
    kv_bytes_per_block: int,
    tensor_parallel_size: int = 1,
    supports_graph_capture: bool | None = None,
    **overrides: Any,
) -> BackendCapability:
    """ASCEND_PROFILE with this worker's facts filled in (block size 128, HCCL, no custom all-reduce)."""
    return replace(
        ASCEND_PROFILE,
        worker_id=worker_id,
        device=device,
        dtype=ascend_dtype_name(dtype),
        model=model,
        kv_num_blocks=kv_num_blocks,
        kv_bytes_per_block=kv_bytes_per_block,
        tensor_parallel_size=tensor_parallel_size,
        collective_backend=COLLECTIVE_BACKEND,
        custom_all_reduce=False,
        supports_graph_capture=ASCEND_PROFILE.supports_graph_capture
        if supports_graph_capture is None
        else supports_graph_capture,
        **overrides,
    )


def kv_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, block_size: int = 128
) -> int:
    """Bytes one KV block takes across all layers (K and V)."""
    element = torch.tensor([], dtype=ascend_torch_dtype(dtype)).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


__all__ = [
    "ASCEND_DTYPES",
    "COLLECTIVE_BACKEND",
    "VISIBLE_DEVICES_ENV",
    "AscendDeviceError",
    "ascend_capability",
    "ascend_dtype_name",
    "ascend_torch_dtype",
    "import_torch_npu",
    "is_npu_device",
    "kv_bytes_per_block",
    "npu_available",
    "npu_device_name",
    "npu_memory_info",
    "parse_npu_index",
    "setup_npu_device",
    "visible_npu_ids",
]
