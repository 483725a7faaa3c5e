"""Where a mixed step's decode rows attend (``mixed_plan.plan_mixed_step``), and that the worker's warm-up steps
(``mixed_plan.warm_up_steps``) lead to every kernel variant a step of a run can: host integers only, so this runs
on any machine (the GPU test ``tests/gpu/test_mixed_warm_up.py`` counts the compiled kernels themselves)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ominix_worker.attention.base import AttentionMetadata
from ominix_worker.attention.mixed_plan import (
    MixedPlan,
    plan_mixed_step,
    prompt_side_requests,
    warm_up_steps,
)

# An eager step splits a decode row's keys only past this many (triton_paged's _EAGER_MIN_TOKENS_PER_SPLIT).
EAGER_SPLIT_FROM = 1025


def _meta(
    q_lens: list[int], seq_lens: list[int], host: bool = True, no_single: bool = False
) -> AttentionMetadata:
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    empty = torch.empty(0)
    return AttentionMetadata(
        query_start_loc=empty,
        seq_lens=empty,
        block_tables=empty,
        slot_mapping=empty,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_decode_only=max(q_lens) == 1,
        query_start_loc_cpu=starts if host else None,
        seq_lens_cpu=list(seq_lens) if host else None,
        no_single_token_requests=no_single,
    )


@pytest.mark.parametrize(
    ("q_lens", "seq_lens", "max_rows", "want"),
    [
        (
            [1, 1, 300, 1, 40],
            [120, 300, 300, 7, 90],
            16,
            MixedPlan.IN_PREFILL,
        ),  # all within the prompt's reach
        ([1, 1, 300, 1, 40], [120, 301, 300, 7, 90], 16, MixedPlan.DECODE_KERNEL),  # one context past it
        ([1, 1, 300, 1, 40], [120, 300, 300, 7, 90], 2, MixedPlan.DECODE_KERNEL),  # more rows than it takes
        ([1, 1, 300], [120, 300, 300], 0, MixedPlan.DECODE_KERNEL),  # turned off
        ([300, 40], [300, 90], 16, MixedPlan.NONE),  # no decode row
    ],
)
def test_decode_rows_ride_in_the_prefill_launch_only_within_its_reach(
    q_lens: list[int], seq_lens: list[int], max_rows: int, want: MixedPlan
) -> None:
    assert plan_mixed_step(_meta(q_lens, seq_lens), max_rows) == want


def test_without_host_offsets_the_decode_kernel_serves_unless_the_metadata_rules_decode_rows_out() -> None:
    assert plan_mixed_step(_meta([1, 30], [20, 30], host=False), 16) == MixedPlan.DECODE_KERNEL
    assert plan_mixed_step(_meta([40], [300], host=False, no_single=True), 16) == MixedPlan.NONE


@pytest.mark.parametrize(
    ("q_lens", "want"),
    [
        ([300, 40, 1, 1, 1], 2),  # the runner's order: the prefill grid spans the first two
        ([300, 40], 2),  # no decode row
        ([2, 1], 1),
        ([300, 1, 40], 3),  # a prompt-side request after a decode row: every request
        ([1, 300, 1], 3),
    ],
)
def test_prefill_grid_spans_the_leading_prompt_side_requests(q_lens: list[int], want: int) -> None:
    assert prompt_side_requests(_meta(q_lens, [q + 10 for q in q_lens])) == want


def test_without_host_offsets_the_prefill_grid_spans_every_request() -> None:
    meta = _meta([300, 1], [300, 20], host=False)
    meta = replace(meta, seq_lens=torch.zeros(2, dtype=torch.int32))
    assert prompt_side_requests(meta) == 2


def _variant(rows: int, context: int, prompt: int, max_rows: int) -> tuple[MixedPlan, bool] | None:
    """The kernel variant a mixed step of ``rows`` decode rows at ``context`` beside a fresh ``prompt`` takes:
    (plan, prompt of at most 16 tokens) in the prefill launch, (plan, split) in the decode kernel."""
    plan = plan_mixed_step(_meta([1] * rows + [prompt], [context + 1] * rows + [prompt]), max_rows)
    if plan == MixedPlan.IN_PREFILL:
        return plan, prompt <= 16
    if plan == MixedPlan.DECODE_KERNEL:
        return plan, max(context + 1, prompt) >= EAGER_SPLIT_FROM
    return None


@pytest.mark.parametrize("max_rows", [0, 1, 3, 16, 66, 132])
@pytest.mark.parametrize("max_tokens", [64, 512, 8192])
def test_the_warm_up_reaches_every_variant_a_step_can_take(max_rows: int, max_tokens: int) -> None:
    """``max_rows``: SMs // KV heads (0 when a GPU has fewer SMs than the model has KV heads); every step of the
    sweep fits a step of ``max_tokens`` tokens."""
    warmed = {_variant(r, c, p, max_rows) for r, c, p in warm_up_steps(max_rows, max_tokens)}
    reachable = set()
    for rows in (1, 2, 3, 4, 8, 16, 17, 33, 67, 133, 255):
        for context in (1, 8, 50, 500, 1000, 3000, 8000):
            for prompt in (2, 12, 16, 17, 100, 1000, 4000):
                if rows + prompt <= max_tokens:
                    reachable.add(_variant(rows, context, prompt, max_rows))
    assert reachable - warmed == set()
