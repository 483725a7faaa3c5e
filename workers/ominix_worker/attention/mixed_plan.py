"""Where a mixed step's single-token requests attend in the Triton paged attention, and the eager warm-up steps
that build every kernel variant that choice needs. Host integers only (no kernels), so the rule is tested on any
machine.

A mixed step holds single-token requests (decode rows) beside requests computing several tokens (prompts,
chunks, prefix-hit suffixes). Its decode rows either take a decode-kernel launch of their own, one program per
request and KV head, or ride in the prefill kernel's launch as programs of the same shape. The prefill launch
is the better home while the rows' programs are too few to fill the GPU on their own (a launch of their own
would leave most SMs idle) and none walks more keys than the prefill kernel's longest program does (the longest
prompt-side request's context), so they finish inside its time. Many rows keep their own launch, where more of
them fit on an SM than beside the prefill kernel's larger tiles.

When the decode rows take their own launch, the prefill launch need not cover them: every program of a
single-token request in it would start only to return, and a batch of 248 decode rows beside 7 prompts of 512
tokens starts 63,488 of them, which doubled that kernel's time (185 against 90 µs a layer on an H200). The
runner puts a step's prompt-side requests first, so the prefill grid spans just those (``prompt_side_requests``).
"""

from __future__ import annotations

import enum

from ominix_worker.attention.base import AttentionMetadata

# The warm-up's prompt: longer than the 16-token query tile the prefill kernel uses for short queries.
_WARM_UP_PROMPT = 100
# Contexts of the warm-up's decode rows in their own launch: one too short for an eager step to split, one long
# enough that it does.
_WARM_UP_SHORT_CONTEXT = 50
_WARM_UP_LONG_CONTEXT = 4096


class MixedPlan(enum.IntEnum):
    """Where a step's single-token requests attend when the step is not decode-only."""

    NONE = 0  # the step has none
    DECODE_KERNEL = 1  # the decode kernel, launched before the prefill kernel
    IN_PREFILL = 2  # the prefill kernel's own launch (its DECODE_ROWS variant)


def plan_mixed_step(meta: AttentionMetadata, max_rows_in_prefill: int) -> MixedPlan:
    """Decode rows ride in the prefill launch when there are at most ``max_rows_in_prefill`` of them (the SMs
    over the KV heads; 0 turns it off) and none has a longer context than the longest prompt-side request.
    Without host offsets the decode kernel launches (it skips the other requests), unless the metadata rules
    single-token requests out (a captured prefill graph)."""
    if meta.no_single_token_requests:
        return MixedPlan.NONE
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    if starts is None or lens is None:
        return MixedPlan.DECODE_KERNEL
    decode_rows = longest_decode = longest_prefill = 0
    for begin, end, seq_len in zip(starts, starts[1:], lens, strict=False):
        if end - begin == 1:
            decode_rows += 1
            longest_decode = max(longest_decode, seq_len)
        else:
            longest_prefill = max(longest_prefill, seq_len)
    if not decode_rows:
        return MixedPlan.NONE
    if decode_rows <= max_rows_in_prefill and longest_decode <= longest_prefill:
        return MixedPlan.IN_PREFILL
    return MixedPlan.DECODE_KERNEL


def prompt_side_requests(meta: AttentionMetadata) -> int:
    """How many leading requests the prefill kernel's grid must span when the decode kernel attends for the
    single-token ones: the requests computing several tokens, when they all come before every single-token
    request (the runner's order); else, or without host offsets, every request."""
    starts = meta.query_start_loc_cpu
    if starts is None:
        return meta.num_requests
    leading = 0
    for begin, end in zip(starts, starts[1:], strict=False):
        if end - begin == 1:
            break
        leading += 1
    for begin, end in zip(starts[leading + 1 :], starts[leading + 2 :], strict=False):
        if end - begin > 1:
            return len(starts) - 1  # a prompt-side request after a single-token one
    return leading


def warm_up_steps(max_rows_in_prefill: int, max_tokens: int) -> list[tuple[int, int, int]]:
    """(decode rows, their context, prompt tokens) of one eager mixed step per kernel variant
    ``plan_mixed_step`` can lead to: a few short-context rows in the prefill launch beside a prompt longer than
    16 tokens and one of 16 (the prefill kernel's query tiles differ); a row whose context outreaches a 2-token
    prompt (the decode kernel, unsplit: the variant many rows take too); one long context (the decode kernel,
    split). Shapes a step of ``max_tokens`` tokens cannot hold are left out (no step of a run has them)."""
    prompt = min(_WARM_UP_PROMPT, max_tokens - 16)
    if prompt < 2:
        return []
    steps = []
    if max_rows_in_prefill:
        rows = min(4, max_rows_in_prefill)
        steps += [(rows, prompt // 2, prompt), (rows, 8, 16)]
    steps += [(1, _WARM_UP_SHORT_CONTEXT, 2), (1, _WARM_UP_LONG_CONTEXT, prompt)]
    return steps
