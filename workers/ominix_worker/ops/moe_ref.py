"""Mixture-of-experts in plain torch: routing (softmax or sigmoid top-k, optional renormalisation) and the
per-expert gated MLP with the weighted top-k reduction. The CPU path runs this; the Triton fused kernels
(``ops/fused_moe.py``, ``ops/biased_moe.py``) are tested against it.

The gate activation is SiLU·up by default; gpt-oss's experts add biases to both projections and use a clamped
SwiGLU (``clamped_swiglu``).

Expert weights are stacked per layer: ``w13`` (E, 2I, H) holds each expert's gate rows then its up rows,
``w2`` (E, H, I) its down projection. Quantized weights arrive with their scales and are dequantized one
expert at a time (``dequantize`` from ``ominix_worker.quant``), so the reference never holds more than one
expert in the run dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits → top-k weights (T, k) float32 and expert ids (T, k) int32.

    Scores are computed in float32 (softmax over all experts, or an independent sigmoid per expert), the k
    highest kept, and with ``renormalize`` divided by their sum so each token's weights add up to 1.
    """
    logits = router_logits.float()
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring_func == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(f"unsupported MoE scoring function {scoring_func!r} (softmax, sigmoid)")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


ExpertWeights = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
# [gate | up] rows (N, 2I) → activations (N, I)
GateActivation = Callable[[torch.Tensor], torch.Tensor]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of [gate | up] halves."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on [gate | up] halves: the gate clamped from above and the up projection
    on both sides at ``limit``, then (up + 1) · gate · sigmoid(alpha · gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_experts_ref(
    x: torch.Tensor,
    expert_weights: ExpertWeights,
    num_experts: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: GateActivation = silu_and_mul,
    expert_biases: ExpertWeights | None = None,
) -> torch.Tensor:
    """Σ_k weight[t, k] · down_e(act(gate_up_e(x_t))) with e = ids[t, k], for every token t; ``act`` is
    ``activation`` (silu(gate) · up unless given).

    ``expert_weights(e)`` returns expert e's (w13 (2I, H), w2 (H, I)) in the run dtype, ``expert_biases(e)``
    (when given) its (b13 (2I,), b2 (H,)), added after each projection. Tokens are grouped by
    expert (a stable sort of the flattened assignments), each expert multiplies its rows once, and the
    weighted rows are summed back per token in float32. An id of -1 (an expert another rank holds under
    expert parallelism) contributes nothing.
    """
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    out = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out.to(x.dtype)
    flat_ids = topk_ids.reshape(-1).long()
    flat_ids = torch.where(flat_ids < 0, num_experts, flat_ids)  # skipped assignments sort last
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order].float()
    counts = torch.bincount(flat_ids, minlength=num_experts + 1).tolist()[:num_experts]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        start += count
        w13, w2 = expert_weights(expert)
        b13, b2 = expert_biases(expert) if expert_biases is not None else (None, None)
        y = F.linear(activation(F.linear(x[token_of[rows]], w13, b13)), w2, b2)
        out.index_add_(0, token_of[rows], y.float() * weight_of[rows, None])
    return out.to(x.dtype)
