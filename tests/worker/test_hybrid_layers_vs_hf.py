"""Hybrid KV layouts on the CPU reference path against Hugging Face transformers: models whose layers mix
sliding-window and full attention, each KV group with its own block table.

Two tiny models: Qwen2 with ``layer_types`` (a full layer, then sliding ones; in one variant the same layout
from ``max_window_layers`` in a config.json without them) and Gemma 3 text (five local layers per global one,
its norms, scaled embedding, local/global rope and, in one variant, logit soft-capping). A 12-token window
and 8-token blocks: prefill, decode well past the window, chunked prefill, a prefix hit whose sliding table
starts with null entries while the full table keeps every block, and the engine's scheduler driving the
worker on the layout the worker states. Each sampled row's logits are compared with a full-sequence HF
forward, which applies the windows itself.
"""

from __future__ import annotations

import json
from dataclasses import replace
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
from ominix_worker.runner import ModelRunner, build_runner
from ominix_worker.testing import write_tiny_hf_model

from .scheduled import capability, hf_greedy, serve_greedy, worker_groups
from .test_model_vs_hf import GREEDY, LogitsRecorder, Reference, assert_close, prompt, tokens_by_id
from .window_scenarios import (
    decode_past_the_window,
    prefix_hit_with_null_sliding_entries,
    scheduler_serves_the_layout,
)

WINDOW = 12
BS = 8
NUM_BLOCKS = 64

QWEN2_HYBRID: tuple[dict[str, object], tuple[int, ...]] = (
    dict(
        arch="qwen2",
        num_layers=3,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
        seed=11,
    ),
    (0,),
)
# name -> (write_tiny_hf_model kwargs, the layer indices of the full-attention group)
HYBRID_MODELS: dict[str, tuple[dict[str, object], tuple[int, ...]]] = {
    "qwen2": QWEN2_HYBRID,
    # The same Qwen2 layout from a config.json without layer_types (as written before transformers 4.53):
    # the windowed layers follow from max_window_layers.
    "qwen2_no_layer_types": QWEN2_HYBRID,
    # Gemma 3: five local layers per global one, tied embeddings, an attention scale apart from head_dim,
    # linear rope scaling on the global layer only.
    "gemma3": (
        dict(
            arch="gemma3_text",
            num_layers=6,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
            tie_word_embeddings=True,
            seed=12,
        ),
        (5,),
    ),
    # Gemma 3 with final logit soft-capping that bites (logits reach ~2.5), an attention soft-cap in the
    # config (which Hugging Face's Gemma 3 does not apply, and neither do we) and global layers at 2 and 5.
    "gemma3_capped": (
        dict(
            arch="gemma3_text",
            num_layers=6,
            sliding_window=WINDOW,
            sliding_window_pattern=3,
            final_logit_softcapping=3.0,
            attn_logit_softcapping=1.0,
            seed=13,
        ),
        (2, 5),
    ),
}


@pytest.fixture(scope="module", params=sorted(HYBRID_MODELS))
def hybrid(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, LogitsRecorder, Reference]:
    kwargs, _ = HYBRID_MODELS[request.param]
    folder = write_tiny_hf_model(tmp_path_factory.mktemp(f"hybrid_{request.param}"), **kwargs)  # type: ignore[arg-type]
    if request.param.endswith("_no_layer_types"):
        config = json.loads((folder / "config.json").read_text())
        del config["layer_types"]
        (folder / "config.json").write_text(json.dumps(config))
    runner = build_runner(str(folder), num_blocks=NUM_BLOCKS, block_size=BS)
    return request.param, folder, LogitsRecorder(runner), Reference(folder, attn_implementation="eager")


def tables(runner: ModelRunner, full: list[int], sliding: list[int]) -> tuple[list[int], list[list[int]]]:
    """Group 0's table and the others' (the layout is one full group, then one sliding group)."""
    assert runner.kv_windows == (0, WINDOW)
    return full, [sliding]


def test_the_layout_has_one_group_per_layer_kind(hybrid: tuple[str, Path, LogitsRecorder, Reference]) -> None:
    name, _, rec, _ = hybrid
    runner = rec.runner
    full_layers = HYBRID_MODELS[name][1]
    layout = runner.kv_layout()
    assert [g.kind for g in layout] == [AttentionKind.FULL, AttentionKind.SLIDING_WINDOW]
    assert layout[0].layer_indices == full_layers and layout[0].sliding_window == 0
    sliding = tuple(i for i in range(runner.config.num_layers) if i not in full_layers)
    assert layout[1].layer_indices == sliding and layout[1].sliding_window == WINDOW
    assert runner.max_model_len > WINDOW


def test_the_window_changes_the_reference(hybrid: tuple[str, Path, LogitsRecorder, Reference]) -> None:
    """The comparisons below are meaningful: beyond the window, windowed logits differ from full attention."""
    _, folder, _, ref = hybrid
    full = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    full.config.sliding_window = 10_000
    tokens = prompt(20, 40)
    with torch.no_grad():
        unwindowed = full(torch.tensor([tokens])).logits[0]
    windowed = ref.logits(tokens)
    assert_close(windowed[WINDOW - 1], unwindowed[WINDOW - 1])  # inside the window they agree
    rel = ((windowed[-1] - unwindowed[-1]).abs().max() / windowed[-1].abs().max()).item()
    assert rel > 1e-2, rel


def test_prefill_then_decode_past_the_window(hybrid: tuple[str, Path, LogitsRecorder, Reference]) -> None:
    _, _, rec, ref = hybrid
    full, others = tables(rec.runner, [9, 2, 30], [40, 7, 13])
    decode_past_the_window(rec, ref, full, others, last_step=29)  # 20 -> 48 tokens


def test_chunked_prefill_and_decode_in_one_step(hybrid: tuple[str, Path, LogitsRecorder, Reference]) -> None:
    _, _, rec, ref = hybrid
    rec.runner.reset()
    long = prompt(22, 45)
    short = prompt(23, 6)
    rec.step(
        DecodeStep(
            1,
            new_requests=[
                NewRequestData("long", long, GREEDY, [11, 5], 0, 13, 3, group_kv_block_ids=[[20, 21]]),
                NewRequestData("short", short, GREEDY, [40], 0, len(short), 4, group_kv_block_ids=[[41]]),
            ],
        )
    )
    rec.step(
        DecodeStep(
            2,
            running_requests=[
                RunningRequestData("long", [12, 13], 19, new_group_kv_block_ids=[[22, 23]]),
                RunningRequestData("short", [], 1),
            ],
        )
    )
    # 32 tokens computed: the sliding group's next chunk reads from position 32 - 12 + 1 = 21, so its
    # blocks 20 and 21 (positions 0-15) left the window; the engine freed them and hands block 20 to a new
    # request that writes it in this very step. The full group keeps every block.
    other = prompt(24, 9)
    result, logits = rec.step(
        DecodeStep(
            3,
            new_requests=[
                NewRequestData(
                    "other", other, GREEDY, [45, 46], 0, len(other), 5, group_kv_block_ids=[[20, 21]]
                )
            ],
            running_requests=[
                RunningRequestData("long", [14, 15], 13, new_group_kv_block_ids=[[24, 25]]),
                RunningRequestData("short", [], 1),
            ],
        )
    )
    assert_close(logits["long"], ref.logits(long)[-1])
    assert_close(logits["other"], ref.logits(other)[-1])
    long.append(tokens_by_id(result)["long"])
    _, logits = rec.step(DecodeStep(4, running_requests=[RunningRequestData("long", [], 1)]))
    assert_close(logits["long"], ref.logits(long)[-1])


def test_prefix_hit_with_null_entries_in_the_sliding_table(
    hybrid: tuple[str, Path, LogitsRecorder, Reference],
) -> None:
    _, _, rec, ref = hybrid
    prefix_hit_with_null_sliding_entries(rec, ref)


def test_bad_tables_are_refused_per_request(hybrid: tuple[str, Path, LogitsRecorder, Reference]) -> None:
    _, _, rec, _ = hybrid
    rec.runner.reset()
    tokens = prompt(28, 20)
    result = rec.runner.execute_step(
        DecodeStep(
            1,
            new_requests=[
                # A null entry in the full group's table, inside what the step reads.
                NewRequestData(
                    "null-full",
                    tokens,
                    GREEDY,
                    [NULL_BLOCK_ID, 3, 4],
                    16,
                    4,
                    6,
                    group_kv_block_ids=[[5, 6, 7]],
                ),
                # No table for the sliding group.
                NewRequestData("one-table", tokens, GREEDY, [8, 9, 10], 0, 20, 7),
                NewRequestData(
                    "fine", tokens, GREEDY, [11, 12, 13], 0, 20, 8, group_kv_block_ids=[[14, 15, 16]]
                ),
            ],
        )
    )
    by_id = {o.request_id: o for o in result.outputs}
    assert by_id["null-full"].error_kind is not None
    assert by_id["one-table"].error_kind is not None and "2 KV groups" in by_id["one-table"].error_message
    assert by_id["fine"].error_kind is None and by_id["fine"].sampled_token_id is not None


def test_the_engine_scheduler_drives_the_worker_on_its_hybrid_layout(
    hybrid: tuple[str, Path, LogitsRecorder, Reference],
) -> None:
    _, folder, _, ref = hybrid
    scheduler_serves_the_layout(build_runner(str(folder), num_blocks=40, block_size=BS), "tiny-hybrid", ref)


def test_a_long_shared_prefix_hits_through_a_window_pool_smaller_than_it(
    hybrid: tuple[str, Path, LogitsRecorder, Reference],
) -> None:
    """A 56-token prefix (7 blocks) is served from the cache although the window pool holds 8 blocks in all
    and the first request's early window blocks were reused: a hit needs only the blocks its window reads."""
    _, folder, _, ref = hybrid
    runner = build_runner(str(folder), num_blocks=40, block_size=BS)
    full, window = worker_groups(runner)
    window = replace(window, num_blocks=8)  # the engine hands out only 8 of the worker's window blocks
    cap = capability(runner, "tiny-hybrid", (full, window), max_batch_tokens=16)
    scheduler = Scheduler(cap, SchedulerConfig(), seed=1)
    first = prompt(40, 60)
    second = first[:56] + prompt(41, 6)
    produced: dict[str, list[int]] = {}
    new_requests: dict[str, NewRequestData] = {}

    def record(step: DecodeStep) -> None:
        new_requests.update({n.request_id: n for n in step.new_requests})

    for rid, tokens in (("first", first), ("second", second)):
        serve_greedy(scheduler, runner, {rid: tokens}, 8, produced, each_step=record, via_wire=False)
    hit = new_requests["second"]
    assert hit.num_computed_tokens == 56
    assert hit.group_kv_block_ids[0][:5] == [NULL_BLOCK_ID] * 5  # the window of position 56 starts at 45
    assert produced == hf_greedy(ref.model, (("first", first), ("second", second)), 8)
