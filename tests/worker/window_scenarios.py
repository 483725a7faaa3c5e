"""Scenarios shared by the worker-vs-HF tests of models with one full-attention and one sliding-window KV
group (group 0 full, group 1 sliding; 8-token blocks): decode far past the window, a prefix hit whose sliding
table starts with null entries, and the engine's scheduler driving the worker on the layout it states.
"""

from __future__ import annotations

from ominix_runtime.contract import (
    NULL_BLOCK_ID,
    AttentionKind,
    DecodeStep,
    NewRequestData,
    RunningRequestData,
)
from ominix_runtime.engine.config import SchedulerConfig
from ominix_runtime.engine.scheduler import Scheduler
from ominix_worker.runner import ModelRunner

from .scheduled import capability, hf_greedy, serve_greedy, worker_groups
from .test_model_vs_hf import GREEDY, LogitsRecorder, Reference, assert_close, prompt, tokens_by_id

BS = 8


def decode_past_the_window(
    rec: LogitsRecorder, ref: Reference, full: list[int], others: list[list[int]], last_step: int
) -> None:
    """A 19-token prompt, then decode steps up to ``last_step``; every row's logits against HF. ``full`` and
    ``others`` are the first tables, different block ids per group: a layer reading the other group's table
    would read the wrong K/V."""
    rec.runner.reset()
    tokens = prompt(21, 19)
    result, logits = rec.step(
        DecodeStep(
            1,
            new_requests=[
                NewRequestData("a", tokens, GREEDY, full, 0, len(tokens), 1, group_kv_block_ids=others)
            ],
        )
    )
    ours = [logits["a"]]
    tokens.append(tokens_by_id(result)["a"])
    for step_id in range(2, last_step + 1):
        grow = len(tokens) % BS == 0
        new_full = [31 + len(tokens) // BS] if grow else []
        new_sliding = [[50 + len(tokens) // BS]] if grow else [[]]
        result, logits = rec.step(
            DecodeStep(
                step_id,
                running_requests=[RunningRequestData("a", new_full, 1, new_group_kv_block_ids=new_sliding)],
            )
        )
        ours.append(logits["a"])
        tokens.append(tokens_by_id(result)["a"])
    reference = ref.logits(tokens[:-1])
    for i, row in enumerate(ours):
        assert_close(row, reference[18 + i])


def prefix_hit_with_null_sliding_entries(rec: LogitsRecorder, ref: Reference) -> None:
    """A 32-token shared prefix (4 blocks) hit by a second request: the window of position 32 starts at 21, so
    the sliding table's first two entries are null (freed); the full table shares all four."""
    rec.runner.reset()
    shared = prompt(25, 32)
    first = shared + prompt(26, 7)
    rec.step(
        DecodeStep(
            1,
            new_requests=[
                NewRequestData(
                    "first", first, GREEDY, [1, 2, 3, 4, 5], 0, len(first), 4,
                    group_kv_block_ids=[[6, 7, 8, 9, 10]],
                )
            ],
        )
    )  # fmt: skip
    second = shared + prompt(27, 10)
    result, logits = rec.step(
        DecodeStep(
            2,
            finished_request_ids=["first"],
            new_requests=[
                NewRequestData(
                    "second", second, GREEDY, [1, 2, 3, 4, 20, 21], 32, len(second) - 32, 5,
                    group_kv_block_ids=[[NULL_BLOCK_ID, NULL_BLOCK_ID, 8, 9, 30, 31]],
                )
            ],
        )
    )  # fmt: skip
    assert result.num_tokens == len(second) - 32
    assert_close(logits["second"], ref.logits(second)[-1])
    second.append(tokens_by_id(result)["second"])
    _, logits = rec.step(DecodeStep(3, running_requests=[RunningRequestData("second", [], 1)]))
    assert_close(logits["second"], ref.logits(second)[-1])


def scheduler_serves_the_layout(runner: ModelRunner, name: str, ref: Reference) -> None:
    """The engine's scheduler on the layout the worker states, steps through protobuf, against HF greedy;
    the sliding table holds null entries at some step, the full one never."""
    groups = worker_groups(runner)
    assert [g.kind for g in groups] == [AttentionKind.FULL, AttentionKind.SLIDING_WINDOW]
    scheduler = Scheduler(capability(runner, name, groups, max_batch_tokens=24), SchedulerConfig(), seed=1)
    prompts = {f"r{i}": prompt(30 + i, 30 + 7 * i) for i in range(4)}
    produced: dict[str, list[int]] = {}
    saw_null = []

    def watch(_: DecodeStep) -> None:
        for rid in scheduler.running:
            lease = scheduler.registry.lease(rid)
            assert lease is not None and NULL_BLOCK_ID not in lease.block_tables[0]
            saw_null.append(NULL_BLOCK_ID in lease.block_tables[1])

    serve_greedy(scheduler, runner, prompts, 16, produced, each_step=watch)
    assert any(saw_null)
    assert produced == hf_greedy(ref.model, prompts.items(), 16)
