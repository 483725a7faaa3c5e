"""Batched sampling on the device: penalties, temperature, top-k / top-p / min-p, seeded Gumbel-max, logprobs.

Randomness is counter-based: the noise for (seed, output position, token id) is a hash computed with torch
integer ops, so a request draws the same tokens whatever else is in the batch and after it is preempted
and resumed (the position continues from its previous output). No global RNG is touched.

Logprobs are taken from ``log_softmax`` of the raw model logits (before penalties, temperature and
truncation): they describe the model, not the sampling transform, and stay comparable across requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ominix_runtime.contract.sampling import GREEDY_TEMPERATURE

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _signed32(value: int) -> int:
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


_MUL_A = _signed32(0x7FEB352D)
_MUL_B = _signed32(0x846CA68B)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32) on int32 tensors.

    Products wrap modulo 2^32 and right shifts are masked to act as logical shifts; int32 (not int64)
    keeps the multiplies vectorised on CPUs without 64-bit vector multiply.
    """
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _MUL_A
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _MUL_B
    return x ^ ((x >> 16) & 0xFFFF)


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) → the int32 with the same low 32 bits."""
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) float32 of shape (B, V) determined by (seed, position, token id) only.

    ``seeds`` holds each request's 64-bit seed as int64 (two's complement), ``positions`` its output index.
    """
    seed_lo = _to_int32(seeds & _MASK32)
    seed_hi = _to_int32((seeds >> 32) & _MASK32)
    row = _mix32(_mix32(seed_lo ^ _mix32(seed_hi + _signed32(_GOLDEN))) ^ _to_int32(positions & _MASK32))
    token = torch.arange(vocab_size, device=seeds.device, dtype=torch.int32) * _signed32(_GOLDEN)
    bits = _mix32(_mix32(row.unsqueeze(1) ^ token.unsqueeze(0)))
    # 23 random bits, offset by half a step: (k + 0.5) / 2^23 is exact in float32 for every k < 2^23, so the
    # values lie in [2^-24, 1 - 2^-24] and 0 and 1 never occur. With 24 bits the top value (2^24 - 0.5) / 2^24
    # rounds to 1.0, whose Gumbel noise is +inf: that token would win whatever its logit or mask.
    return (((bits >> 9) & 0x7FFFFF).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters for one step, already on the device. Built by the runner."""

    temperature: torch.Tensor  # float32 (B,), below GREEDY_TEMPERATURE (0 included) = greedy
    top_k: torch.Tensor  # int64 (B,), vocab_size = no limit
    top_p: torch.Tensor  # float32 (B,)
    min_p: torch.Tensor  # float32 (B,)
    seeds: torch.Tensor  # int64 (B,)
    output_positions: torch.Tensor  # int64 (B,), index of the token being sampled within the output
    repetition_penalty: torch.Tensor | None = None  # float32 (B,)
    frequency_penalty: torch.Tensor | None = None  # float32 (B,)
    presence_penalty: torch.Tensor | None = None  # float32 (B,)
    output_counts: torch.Tensor | None = None  # float32 (B, V): occurrences in the output so far
    prompt_mask: torch.Tensor | None = None  # bool (B, V): present in the prompt
    banned_mask: torch.Tensor | None = None  # bool (B, V): eos / stop ids before min_tokens is reached
    num_logprobs: int = -1  # most top-N asked by any row; -1: no row wants logprobs
    needs_top_k: bool = False
    needs_top_p: bool = False
    needs_min_p: bool = False
    all_greedy: bool = False


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # int64 (B,)
    bad_rows: torch.Tensor  # bool (B,): logits were NaN
    sampled_logprobs: torch.Tensor | None = None  # float32 (B,)
    top_logprobs: torch.Tensor | None = None  # float32 (B, N)
    top_token_ids: torch.Tensor | None = None  # int64 (B, N)


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    if t.repetition_penalty is not None and t.output_counts is not None:
        seen = t.output_counts > 0
        if t.prompt_mask is not None:
            seen = seen | t.prompt_mask
        penalty = t.repetition_penalty.unsqueeze(1)
        # Positive logits shrink, negative ones grow: both make a seen token less likely.
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if t.output_counts is not None and t.frequency_penalty is not None and t.presence_penalty is not None:
        logits = logits - t.frequency_penalty.unsqueeze(1) * t.output_counts
        logits = logits - t.presence_penalty.unsqueeze(1) * (t.output_counts > 0).to(logits.dtype)
    if t.banned_mask is not None:
        logits = logits.masked_fill(t.banned_mask, float("-inf"))
    return logits


def apply_truncation(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Mask tokens below min-p × max prob, then those outside top-k and the top-p nucleus of what is left (on
    scaled logits): vLLM's order, so top-p measures its mass after min-p."""
    if t.needs_min_p:
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * t.min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if t.needs_top_k or t.needs_top_p:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if t.needs_top_k:
            ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
            remove |= ranks >= t.top_k.unsqueeze(1)
        if t.needs_top_p:
            probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            top_p = t.top_p.unsqueeze(1)
            # A row of top_p 1 keeps everything: its cumulative mass may round to 1 before the tail ends.
            remove |= (mass_before >= top_p) & (top_p < 1.0)
        remove[:, 0] = False  # the most likely token always survives
        logits = logits.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))
    return logits


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first maximum of each row of float32 ``logits`` (B, V), and whether the row holds a NaN. On CUDA one
    kernel that spreads a row over many programs (``ops.greedy``); elsewhere ``max``, which propagates NaN."""
    if logits.is_cuda and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(-1) == 1:
        from ominix_worker.ops.greedy import greedy_argmax  # Triton: CUDA only

        return greedy_argmax(logits)
    best, ids = logits.max(dim=-1)
    return ids, torch.isnan(best)


def sample(logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
    """logits float32 (B, V) → sampled ids and, when asked, logprobs. Runs fully batched on the device."""
    raw = logits
    logits = apply_penalties(raw, t)
    if t.all_greedy and logits is raw:
        # One pass over the vocabulary instead of three: the first maximum and the NaN check together.
        first_max, bad_rows = greedy(raw)
    else:
        bad_rows = torch.isnan(raw).any(dim=-1)
        first_max = logits.argmax(dim=-1)
    if t.all_greedy:
        token_ids = first_max
    else:
        # Greedy rows are divided by 1 and their draw discarded: a temperature below the threshold would
        # overflow the division (GREEDY_TEMPERATURE says why).
        sampled_rows = t.temperature >= GREEDY_TEMPERATURE
        temperature = torch.where(sampled_rows, t.temperature, torch.ones_like(t.temperature))
        scaled = apply_truncation(logits / temperature.unsqueeze(1), t)
        # Gumbel-max: argmax(logits + Gumbel noise) is a draw from softmax(logits).
        noise = uniform_noise(t.seeds, t.output_positions, logits.shape[-1])
        gumbel = -torch.log(-torch.log(noise))
        drawn = (scaled + gumbel).argmax(dim=-1)
        token_ids = torch.where(sampled_rows, drawn, first_max)
    out = SamplerOutput(token_ids=token_ids, bad_rows=bad_rows)
    if t.num_logprobs >= 0:
        logprobs = raw.log_softmax(dim=-1)
        out.sampled_logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        if t.num_logprobs > 0:
            out.top_logprobs, out.top_token_ids = logprobs.topk(t.num_logprobs, dim=-1)
    return out
