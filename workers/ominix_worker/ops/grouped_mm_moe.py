"""Mixture-of-experts for prefill-sized batches on torch's grouped GEMM (``torch._grouped_mm``, CUTLASS on Hopper).

With many tokens every expert gets hundreds of rows and the layer is compute-bound; there the library grouped GEMM
runs closer to the tensor cores' peak than the Triton tile kernel of ``fused_moe``, which is tuned for the
bandwidth-bound decode sizes. The assignments (T·k) are sorted by expert once (a stable device sort, no host
sync), the token rows gathered in that order, both GEMMs run over the per-expert row ranges (``offs``: cumulative
counts), and the weighted rows are put back in assignment order and summed per token in float32.

Used by ``fused_experts`` and ``fused_experts_biased`` for bf16 weights on Hopper from ``GROUPED_MM_MIN_TOKENS``
tokens (see ``use_grouped_mm``); FP8 weights and expert parallelism keep the Triton path.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

# From this many tokens a MoE layer runs on torch's grouped GEMM (bench/kernels.py --moe-prefill measures both
# paths per shape); 0 turns the path off. The environment variable overrides it for measurements.
GROUPED_MM_MIN_TOKENS = int(os.environ.get("OMINIX_GROUPED_MM_MIN_TOKENS", "1024"))


@functools.cache
def _hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


def use_grouped_mm(x: torch.Tensor, w13: torch.Tensor, min_tokens: int | None = None) -> bool:
    """True for bf16 activations and weights on a Hopper GPU with at least ``min_tokens`` tokens (default
    ``GROUPED_MM_MIN_TOKENS``) when torch has the grouped GEMM; never while a CUDA graph is being captured."""
    threshold = GROUPED_MM_MIN_TOKENS if min_tokens is None else min_tokens
    if threshold <= 0 or x.shape[0] < threshold or not hasattr(torch, "_grouped_mm"):
        return False
    if not x.is_cuda or x.dtype != torch.bfloat16 or w13.dtype != torch.bfloat16:
        return False
    if torch.cuda.is_current_stream_capturing():
        return False
    return _hopper(x.device.index if x.device.index is not None else torch.cuda.current_device())


def experts_grouped_mm(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_k topk_weights[t, k] · (w2[e] act(w13[e] x_t + b13[e]) + b2[e]) with e = topk_ids[t, k].

    ``x`` (T, H) bf16; ``w13`` (E, 2I, H); ``w2`` (E, H, I); optional biases ``b13`` (E, 2I), ``b2`` (E, H);
    ``activation`` maps [gate | up] rows (N, 2I) to (N, I)."""
    num_tokens, hidden = x.shape
    num_experts = w13.shape[0]
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # assignment ids grouped by expert
    expert_of_row = flat.index_select(0, order)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # bincount would sync on its size
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = x.index_select(0, order // top_k)
    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)
    if b13 is not None:
        gate_up += b13.index_select(0, expert_of_row)
    hidden_act = activation(gate_up)
    down = torch._grouped_mm(hidden_act, w2.transpose(1, 2), offs=offs)
    if b2 is not None:
        down += b2.index_select(0, expert_of_row)
    # Weighted in float32 and stored in bf16 per assignment, then summed in float32: as the Triton path does.
    weights = topk_weights.reshape(-1).float().index_select(0, order)[:, None]
    weighted = (down.float() * weights).to(down.dtype)
    by_assignment = torch.empty_like(weighted).index_copy_(0, order, weighted)
    return by_assignment.view(num_tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)


__all__ = ["GROUPED_MM_MIN_TOKENS", "experts_grouped_mm", "use_grouped_mm"]
