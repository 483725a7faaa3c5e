"""Dense GEMMs on CPU with each weight reordered once into oneDNN's blocked layout.

``F.linear`` on CPU hands the row-major weight to the BLAS, which copies it into its own panel layout on
every call. A decode step multiplies a few rows by every weight of the model, so that copy costs about as
much as the product itself: SmolLM2-135M at 8 rows, one thread, 110-123 ms of GEMM per step with
``F.linear`` and 63-66 ms with weights packed once. The packed copy is as large as the weight. The sums are
float32 as before, in another order (outputs agree to ~1e-6).
"""

from __future__ import annotations

import torch

# Row-count hint for the packed layout: decode batches; any row count is still accepted.
_PACK_ROWS = 8
_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(weight: torch.Tensor) -> bool:
    """A 2-D CPU weight in a dtype oneDNN multiplies here (bfloat16 only where the CPU has it)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in _DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The (out, in) weight as an opaque oneDNN tensor for :func:`linear`."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_ROWS)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the weight from :func:`pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
