"""Experts with biased projections and a custom gate activation on CUDA (gpt-oss), built from the fused MoE's
align kernel and grouped GEMMs (``ops/fused_moe.py``).

Per layer over T tokens routed to k experts each: align the T·k assignments by expert, one grouped GEMM for
gate_up (one row per assignment), then plain torch ops add each assignment's expert bias (a gather by expert
id) and apply the activation, a second grouped GEMM multiplies by the expert's down projection and the routing
weight, the routing-weighted down bias is added, and the fused MoE's kernel sums the k rows of each token.
Every shape depends on T only and nothing reads device values on the host, so CUDA graphs capture it. The
bias and activation passes are separate launches: a fused epilogue in the grouped GEMM would save them.
"""

from __future__ import annotations

import torch

from ominix_worker.ops.fused_moe import grouped_gemm, moe_align, moe_sum, pick_config
from ominix_worker.ops.moe_ref import GateActivation


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
    flat_ids = topk_ids.reshape(-1).long()
    gate_up = torch.empty((num_assignments, two_i), dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, gate_up, sorted_ids, expert_ids, num_post_pad, num_assignments, top_k, cfg)
    hidden_act = activation(gate_up + b13.index_select(0, flat_ids)).contiguous()
    weights = topk_weights.reshape(-1).float()
    down = torch.empty((num_assignments, hidden), dtype=x.dtype, device=x.device)
    grouped_gemm(
        hidden_act, w2, down, sorted_ids, expert_ids, num_post_pad, num_assignments, 1, cfg,
        topk_weights=weights,
    )  # fmt: skip
    down += (b2.index_select(0, flat_ids).float() * weights[:, None]).to(down.dtype)
    return moe_sum(down, num_tokens, top_k)


__all__ = ["fused_experts_biased"]
