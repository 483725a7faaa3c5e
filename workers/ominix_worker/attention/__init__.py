"""Attention backends chosen by device capability: torch reference (CPU), Triton paged (CUDA), Ascend (npu).

The CUDA and Ascend modules are imported lazily so a CPU machine never needs triton or torch_npu.
"""

from __future__ import annotations

import importlib
import logging

from ominix_worker.attention.base import AttentionBackend, AttentionMetadata
from ominix_worker.attention.torch_ref import TorchReferenceAttention

log = logging.getLogger(__name__)

ASCEND_BLOCK_SIZE = 128


def _load_class(module: str, names: tuple[str, ...]) -> type | None:
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        log.warning("attention module %s unavailable (%s)", module, exc)
        return None
    for name in names:
        cls = getattr(mod, name, None)
        if cls is not None:
            return cls
    # Fall back to the first class in the module that looks like a backend.
    for value in vars(mod).values():
        if isinstance(value, type) and hasattr(value, "write_kv") and hasattr(value, "allocate_kv_cache"):
            return value
    return None


def get_attention_backend(name_or_device: str, block_size: int = 16) -> AttentionBackend:
    """ "torch" / "cpu" → reference; "triton" / "cuda[:N]" → Triton paged when importable, else reference;
    "ascend" / "npu[:N]" → torch_npu paged attention (block size 128)."""
    key = name_or_device.split(":")[0].lower()
    if key in ("torch", "cpu", "torch-sdpa"):
        return TorchReferenceAttention(block_size)
    if key in ("triton", "cuda", "triton-paged"):
        cls = _load_class("ominix_worker.attention.triton_paged", ("TritonPagedAttention",))
        if cls is None:
            log.warning("falling back to the torch reference attention on %s", name_or_device)
            return TorchReferenceAttention(block_size)
        return cls(block_size)
    if key in ("ascend", "npu", "npu-paged"):
        cls = _load_class("ominix_worker.attention.ascend", ("AscendPagedAttention", "AscendAttention"))
        if cls is None:
            raise RuntimeError("the Ascend attention backend is unavailable (needs torch_npu)")
        return cls(ASCEND_BLOCK_SIZE)
    raise ValueError(f"unknown attention backend {name_or_device!r} (torch, triton, ascend)")


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchReferenceAttention", "get_attention_backend"]
