"""Experts with biased projections and a custom gate activation on CUDA (gpt-oss), built from the fused MoE's
align kernel and grouped GEMMs (``ops/fused_moe.py``).

Per layer over T tokens routed to k experts each: align the T·k assignments by expert, one grouped GEMM for
gate_up (one row per assignment) that adds the expert's gate_up bias in its epilogue, the activation, a second
grouped GEMM that adds the down bias and multiplies by the routing weight in its epilogue, and the fused MoE's
kernel sums the k rows of each token. Every shape depends on T only and nothing reads device values on the
host, so CUDA graphs capture it. ``clamped_swiglu_cuda`` is gpt-oss's activation in one pass (a torch
composition reads and writes the (T·k, 2I) rows once per elementwise op).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ominix_worker.ops import cdiv, next_power_of_2
from ominix_worker.ops.fused_moe import grouped_gemm, moe_align, moe_sum, pick_config
from ominix_worker.ops.moe_ref import GateActivation


@triton.jit
def _clamped_swiglu_kernel(x_ptr, out_ptr, inter, stride_x, stride_out, alpha, limit, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    out = (up + 1.0) * gate * tl.sigmoid(gate * alpha)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def clamped_swiglu_cuda(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``moe_ref.clamped_swiglu`` in one kernel: (N, 2I) [gate | up] → (N, I), computed in float32."""
    rows, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, next_power_of_2(inter))
        _clamped_swiglu_kernel[(rows, cdiv(inter, block))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), alpha, limit, BLOCK=block, num_warps=4
        )
    return out


def fused_experts_biased(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor,
    b2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: GateActivation,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Σ_k topk_weights[t, k] · (w2[e] act(w13[e] x_t + b13[e]) + b2[e]) with e = topk_ids[t, k].

    ``x`` (T, H); ``w13`` (E, 2I, H) [gate rows | up rows]; ``w2`` (E, H, I); ``b13`` (E, 2I); ``b2`` (E, H);
    ``activation`` maps [gate | up] rows (N, 2I) to (N, I).
    """
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    cfg = dict(config or pick_config(num_experts, two_i, hidden, num_tokens, False))
    sorted_ids, expert_ids, num_post_pad = moe_align(topk_ids, num_experts, cfg["BLOCK_M"])
    num_assignments = num_tokens * top_k
    gate_up = torch.empty((num_assignments, two_i), dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, gate_up, sorted_ids, expert_ids, num_post_pad, num_assignments, top_k, cfg, bias=b13)
    hidden_act = activation(gate_up).contiguous()
    weights = topk_weights.reshape(-1).float()
    down = torch.empty((num_assignments, hidden), dtype=x.dtype, device=x.device)
    grouped_gemm(
        hidden_act, w2, down, sorted_ids, expert_ids, num_post_pad, num_assignments, 1, cfg,
        topk_weights=weights, bias=b2,
    )  # fmt: skip
    return moe_sum(down, num_tokens, top_k)


__all__ = ["clamped_swiglu_cuda", "fused_experts_biased"]
