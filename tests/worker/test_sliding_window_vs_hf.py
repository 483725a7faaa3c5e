"""True sliding-window attention (Mistral) in the CPU reference path, against Hugging Face transformers.

A tiny MistralForCausalLM with a 12-token window and 16-token blocks: prefill, decode far past the window,
chunked prefill while another request reuses a block the window left, and a prefix hit whose table starts
with null entries (blocks the engine freed behind the window). Each sampled row's logits are compared with
a full-sequence HF forward, which applies the window itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from ominix_runtime.contract import (
    NULL_BLOCK_ID,
    AttentionKind,
    DecodeStep,
    NewRequestData,
    RunningRequestData,
)
from ominix_runtime.engine.config import SchedulerConfig
from ominix_runtime.engine.scheduler import Scheduler
from ominix_worker.runner import build_runner
from ominix_worker.testing import write_tiny_hf_model

from .scheduled import capability, hf_greedy, serve_greedy, worker_groups
from .test_model_vs_hf import GREEDY, LogitsRecorder, Reference, assert_close, prompt, tokens_by_id

WINDOW = 12
BS = 16


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(
        tmp_path_factory.mktemp("tiny_mistral"), arch="mistral", sliding_window=WINDOW, seed=8
    )


@pytest.fixture(scope="module")
def pair(mistral_dir: Path) -> tuple[LogitsRecorder, Reference]:
    runner = build_runner(str(mistral_dir), num_blocks=48, block_size=BS)
    assert runner.kv_windows == (WINDOW,)
    assert runner.max_model_len > WINDOW  # no longer capped at the window
    return LogitsRecorder(runner), Reference(mistral_dir)


def test_the_window_changes_the_reference(mistral_dir: Path, pair: tuple[LogitsRecorder, Reference]) -> None:
    """The comparisons below are meaningful: beyond the window, windowed logits differ from full attention."""
    _, ref = pair
    full = transformers.AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32).eval()
    full.config.sliding_window = None
    tokens = prompt(20, 40)
    with torch.no_grad():
        unwindowed = full(torch.tensor([tokens])).logits[0]
    windowed = ref.logits(tokens)
    assert_close(windowed[WINDOW - 1], unwindowed[WINDOW - 1])  # inside the window they agree
    rel = ((windowed[-1] - unwindowed[-1]).abs().max() / windowed[-1].abs().max()).item()
    assert rel > 1e-2, rel


def test_prefill_then_decode_past_the_window(pair: tuple[LogitsRecorder, Reference]) -> None:
    rec, ref = pair
    rec.runner.reset()
    tokens = prompt(21, 37)
    result, logits = rec.step(
        DecodeStep(1, new_requests=[NewRequestData("a", tokens, GREEDY, [9, 2, 30], 0, len(tokens), 1)])
    )
    ours = [logits["a"]]
    tokens.append(tokens_by_id(result)["a"])
    for step_id in range(2, 30):  # 37 -> 65 tokens: crosses two block boundaries, many windows later
        new_blocks = [17 + len(tokens) // BS] if len(tokens) % BS == 0 else []
        result, logits = rec.step(
            DecodeStep(step_id, running_requests=[RunningRequestData("a", new_blocks, 1)])
        )
        ours.append(logits["a"])
        tokens.append(tokens_by_id(result)["a"])
    reference = ref.logits(tokens[:-1])
    for i, row in enumerate(ours):
        assert_close(row, reference[36 + i])


def test_chunked_prefill_while_a_slid_out_block_is_reused(pair: tuple[LogitsRecorder, Reference]) -> None:
    rec, ref = pair
    rec.runner.reset()
    long = prompt(22, 50)
    rec.step(DecodeStep(1, new_requests=[NewRequestData("long", long, GREEDY, [11, 5], 0, 13, 3)]))
    rec.step(DecodeStep(2, running_requests=[RunningRequestData("long", [], 19)]))
    # 32 tokens computed: the next chunk reads from position 32 - 12 + 1 = 21, so block 11 (positions 0-15)
    # left the window; the engine frees it and hands it to "other", which writes it in this very step.
    other = prompt(23, 9)
    result, logits = rec.step(
        DecodeStep(
            3,
            new_requests=[NewRequestData("other", other, GREEDY, [11], 0, len(other), 4)],
            running_requests=[RunningRequestData("long", [6, 7], 18)],
        )
    )
    assert_close(logits["long"], ref.logits(long)[-1])
    assert_close(logits["other"], ref.logits(other)[-1])
    long.append(tokens_by_id(result)["long"])
    _, logits = rec.step(DecodeStep(4, running_requests=[RunningRequestData("long", [], 1)]))
    assert_close(logits["long"], ref.logits(long)[-1])


def test_prefix_hit_with_null_entries_behind_the_window(pair: tuple[LogitsRecorder, Reference]) -> None:
    rec, ref = pair
    rec.runner.reset()
    shared = prompt(24, 32)
    first = shared + prompt(25, 7)
    rec.step(
        DecodeStep(1, new_requests=[NewRequestData("first", first, GREEDY, [20, 21, 22], 0, len(first), 4)])
    )
    # The hit covers 32 tokens; the window of position 32 starts at 21, so block 0 of the table is null.
    second = shared + prompt(26, 10)
    result, logits = rec.step(
        DecodeStep(
            2,
            finished_request_ids=["first"],
            new_requests=[
                NewRequestData("second", second, GREEDY, [NULL_BLOCK_ID, 21, 40], 32, len(second) - 32, 5)
            ],
        )
    )
    assert result.num_tokens == len(second) - 32
    assert_close(logits["second"], ref.logits(second)[-1])
    second.append(tokens_by_id(result)["second"])
    _, logits = rec.step(DecodeStep(3, running_requests=[RunningRequestData("second", [], 1)]))
    assert_close(logits["second"], ref.logits(second)[-1])


def test_a_null_block_inside_the_window_is_refused(pair: tuple[LogitsRecorder, Reference]) -> None:
    rec, _ = pair
    rec.runner.reset()
    tokens = prompt(27, 40)
    result = rec.runner.execute_step(
        DecodeStep(1, new_requests=[NewRequestData("bad", tokens, GREEDY, [3, NULL_BLOCK_ID, 4], 32, 8, 6)])
    )
    (out,) = result.outputs
    assert out.error_kind is not None and "null" in out.error_message


def test_the_engine_scheduler_drives_the_worker_on_its_sliding_layout(
    mistral_dir: Path, pair: tuple[LogitsRecorder, Reference]
) -> None:
    """The engine's scheduler on the layout the worker states, steps through protobuf, against HF greedy.

    12 blocks of 16 tokens cannot hold even three 80-token requests with full attention; with the 12-token
    window each decoding request keeps two blocks, so all four run, and their tokens match HF's."""
    _, ref = pair
    num_blocks = 12
    runner = build_runner(str(mistral_dir), num_blocks=num_blocks, block_size=BS)
    groups = worker_groups(runner)
    assert [g.kind for g in groups] == [AttentionKind.SLIDING_WINDOW] and groups[0].sliding_window == WINDOW
    cap = capability(runner, "tiny-mistral", groups, max_batch_tokens=32, num_blocks=num_blocks)
    scheduler = Scheduler(cap, SchedulerConfig(), seed=1)
    prompts = {f"r{i}": prompt(30 + i, 60) for i in range(4)}
    produced: dict[str, list[int]] = {}
    seen = {"peak_running": 0, "null": False}

    def watch(_: DecodeStep) -> None:
        seen["peak_running"] = max(seen["peak_running"], scheduler.num_running)
        for rid in scheduler.running:
            lease = scheduler.registry.lease(rid)
            seen["null"] |= lease is not None and NULL_BLOCK_ID in lease.kv_block_ids

    serve_greedy(scheduler, runner, prompts, 20, produced, each_step=watch)
    assert seen["null"] and seen["peak_running"] == 4
    assert produced == hf_greedy(ref.model, prompts.items(), 20)
