"""The compressed-attention reference layer (``models/compressed.py``, shaped like DeepSeek-V4's layers)
against its dense recomputation from the whole token history (``models/compressed_dense.py``).

A tiny ``llama_compressed`` model (dummy weights, scaled up so attention is far from uniform): layer 0 attends
within an 8-token window, layer 1 also reads one row per 4 tokens, layer 2 one per 8. Block tables come from
the engine's real KV registry on the layout the worker states (one sliding-window group, two compressed
groups), and steps go through protobuf as the engine sends them: prefill, decode across many chunk
boundaries, chunked prefill with chunks that split compress chunks, a prefix hit on shared compressed
blocks, and the engine's scheduler driving the worker under KV pressure (preemption, prefix hits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ominix_runtime import wire
from ominix_runtime.contract import (
    NULL_BLOCK_ID,
    AttentionKind,
    DecodeStep,
    NewRequestData,
    RequestOutput,
    RunningRequestData,
    StepResult,
)
from ominix_runtime.engine.config import SchedulerConfig
from ominix_runtime.engine.kv_registry import KVRegistry, PrefixHit
from ominix_runtime.engine.scheduler import Scheduler
from ominix_runtime.pb import worker_pb2
from ominix_worker.config import ModelConfigError, config_from_hf_dict
from ominix_worker.kv_cache import kv_bytes_per_block
from ominix_worker.models.compressed import LlamaCompressedForCausalLM
from ominix_worker.models.compressed_dense import dense_compressed_logits, dense_greedy
from ominix_worker.runner import ModelRunner, build_runner
from ominix_worker.server import stated_kv_groups

from .scheduled import capability, serve_greedy, worker_groups
from .test_model_vs_hf import GREEDY, LogitsRecorder, assert_close, prompt, tokens_by_id

CONFIG = Path(__file__).resolve().parents[2] / "bench" / "configs" / "compressed-tiny-config.json"
BS = 4
NUM_BLOCKS = 64


def _sharpen(runner: ModelRunner) -> None:
    """Dummy weights are drawn at std 0.02; ten times that makes attention (and the gates) peaked, so a
    wrong key, row or mask shows in the logits."""
    with torch.no_grad():
        for name, param in runner.model.named_parameters():
            if "norm" not in name:
                param.mul_(10)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    runner = build_runner(f"dummy:{CONFIG}", num_blocks=NUM_BLOCKS, block_size=BS)
    _sharpen(runner)
    return runner


@pytest.fixture()
def rec(runner: ModelRunner) -> LogitsRecorder:
    runner.reset()
    return LogitsRecorder(runner)


def model_of(runner: ModelRunner) -> LlamaCompressedForCausalLM:
    assert isinstance(runner.model, LlamaCompressedForCausalLM)
    return runner.model


def reference(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    return dense_compressed_logits(model_of(runner), tokens)


class Engine:
    """Block tables from the engine's registry on the layout the worker states; steps through protobuf."""

    def __init__(self, rec: LogitsRecorder) -> None:
        self.rec = rec
        self.groups = rec.runner.kv_layout()
        self.registry = KVRegistry("w", NUM_BLOCKS, BS, layout=self.groups)
        self.step_id = 0
        self.sent: dict[str, list[int]] = {}  # table lengths already sent, per group
        self.computed: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}

    def new(self, rid: str, tokens: list[int], n: int, hit: PrefixHit | None = None) -> NewRequestData:
        start = hit.num_tokens if hit else 0
        assert self.registry.allocate(rid, start + n, hit, num_computed_tokens=start) is not None
        lease = self.registry.lease(rid)
        assert lease is not None
        self.sent[rid] = [len(t) for t in lease.block_tables]
        self.computed[rid] = start + n
        self.tokens[rid] = list(tokens)
        return NewRequestData(
            rid, tokens, GREEDY, list(lease.block_tables[0]), start, n, 1,
            group_kv_block_ids=[list(t) for t in lease.block_tables[1:]],
        )  # fmt: skip

    def running(self, rid: str, n: int) -> RunningRequestData:
        computed = self.computed[rid]
        assert self.registry.allocate(rid, computed + n, num_computed_tokens=computed) is not None
        lease = self.registry.lease(rid)
        assert lease is not None
        added = [list(t[k:]) for t, k in zip(lease.block_tables, self.sent[rid], strict=True)]
        self.sent[rid] = [len(t) for t in lease.block_tables]
        self.computed[rid] = computed + n
        return RunningRequestData(rid, added[0], n, added[1:])

    def step(
        self,
        new: Sequence[NewRequestData] = (),
        running: Sequence[RunningRequestData] = (),
        finished: Sequence[str] = (),
    ) -> tuple[StepResult, dict[str, torch.Tensor]]:
        self.step_id += 1
        step = DecodeStep(self.step_id, list(new), list(running), list(finished))
        sent = wire.step_from_pb(worker_pb2.DecodeStep.FromString(wire.step_to_pb(step).SerializeToString()))
        result, logits = self.rec.step(sent)
        assert all(o.error_kind is None for o in result.outputs), result.outputs
        for rid, token in tokens_by_id(result).items():
            self.tokens[rid].append(token)
        for rid in self.computed:
            self.registry.cache_blocks(rid, self.tokens[rid], self.computed[rid])
        self.registry.check_integrity()
        return result, logits

    def free(self, rid: str) -> None:
        self.registry.free(rid)
        del self.computed[rid], self.sent[rid]


def test_the_worker_states_three_groups(runner: ModelRunner) -> None:
    config = runner.config
    assert config.compress_ratios == (0, 4, 8)
    groups = stated_kv_groups(runner, kv_bytes_per_block(config, BS, torch.float32))
    assert [(g.kind, g.layer_indices, g.compress_ratio) for g in groups] == [
        (AttentionKind.SLIDING_WINDOW, (0, 1, 2), 0),
        (AttentionKind.COMPRESSED, (1,), 4),
        (AttentionKind.COMPRESSED, (2,), 8),
    ]
    assert groups[0].sliding_window == 8 and len(runner.kv_caches) == 5  # 3 raw + 2 of rows
    assert groups[0].bytes_per_token_per_layer == 2 * 2 * 16 * 4  # K and V, 2 heads of 16 floats
    assert config.num_parameters() == sum(p.numel() for p in runner.model.parameters())


def test_the_rows_change_the_reference(runner: ModelRunner) -> None:
    """Compressed rows matter: dropping them (a window-only model) changes the logits past the first chunk."""
    tokens = prompt(40, 30, vocab=512)
    model = model_of(runner)
    with_rows = dense_compressed_logits(model, tokens)
    saved = [layer.self_attn.compress_ratio for layer in model.layers]
    try:
        for layer in model.layers:
            layer.self_attn.compress_ratio = 0
        window_only = dense_compressed_logits(model, tokens)
    finally:
        for layer, ratio in zip(model.layers, saved, strict=True):
            layer.self_attn.compress_ratio = ratio
    assert_close(with_rows[2], window_only[2])  # no chunk complete yet: the same
    rel = ((with_rows[-1] - window_only[-1]).abs().max() / with_rows[-1].abs().max()).item()
    assert rel > 1e-2, rel


def test_prefill_then_decode_across_chunk_boundaries(rec: LogitsRecorder) -> None:
    eng = Engine(rec)
    tokens = prompt(41, 27, vocab=512)
    _, logits = eng.step([eng.new("a", tokens, len(tokens))])
    ours = [logits["a"]]
    for _ in range(30):  # 27 → 57 tokens: rows of ratio 4 and 8 complete along the way, window slides
        _, logits = eng.step(running=[eng.running("a", 1)])
        ours.append(logits["a"])
    full = eng.tokens["a"]
    expected = reference(rec.runner, full[:-1])
    for i, row in enumerate(ours):
        assert_close(row, expected[26 + i])
    lease = eng.registry.lease("a")
    assert lease is not None and [len(t) for t in lease.block_tables] == [15, 4, 2]
    eng.free("a")


def test_chunked_prefill_splits_compress_chunks(rec: LogitsRecorder) -> None:
    """Chunks of 5, 7, 11 and 10 tokens: compress chunks straddle step boundaries, rows are written by the
    step that completes them and read by later steps; a second request shares the steps."""
    eng = Engine(rec)
    long = prompt(42, 33, vocab=512)
    other = prompt(43, 6, vocab=512)
    eng.step([eng.new("long", long, 5)])
    eng.step(running=[eng.running("long", 7)])
    _, logits = eng.step([eng.new("other", other, len(other))], [eng.running("long", 11)])
    assert_close(logits["other"], reference(rec.runner, other)[-1])
    _, logits = eng.step(running=[eng.running("long", 10), eng.running("other", 1)])
    assert_close(logits["long"], reference(rec.runner, long)[-1])
    assert_close(logits["other"], reference(rec.runner, eng.tokens["other"][:-1])[-1])
    for _ in range(6):
        _, logits = eng.step(running=[eng.running("long", 1)])
        assert_close(logits["long"], reference(rec.runner, eng.tokens["long"][:-1])[-1])


def test_a_prefix_hit_reuses_compressed_rows(rec: LogitsRecorder) -> None:
    """A second prompt sharing 40 tokens hits 32 of them (whole blocks of every group: 8 rows of ratio 4,
    4 of ratio 8) and computes only the rest; its logits still equal the dense recomputation."""
    eng = Engine(rec)
    shared = prompt(44, 40, vocab=512)
    first = shared + prompt(45, 5, vocab=512)
    eng.step([eng.new("first", first, len(first))])
    eng.free("first")
    second = shared + prompt(46, 9, vocab=512)
    hit = eng.registry.find_prefix(second)
    assert hit.num_tokens == 32 and [len(g) for g in hit.group_block_ids] == [8, 2, 1]
    result, logits = eng.step([eng.new("second", second, len(second) - 32, hit)], finished=["first"])
    assert result.num_tokens == len(second) - 32
    assert_close(logits["second"], reference(rec.runner, second)[-1])
    for _ in range(10):
        _, logits = eng.step(running=[eng.running("second", 1)])
        assert_close(logits["second"], reference(rec.runner, eng.tokens["second"][:-1])[-1])


def _outputs(runner: ModelRunner, step: DecodeStep) -> list[RequestOutput]:
    result = runner.execute_step(step)
    assert result is not None
    return result.outputs


def test_a_table_short_of_a_compressed_row_is_refused(rec: LogitsRecorder) -> None:
    tokens = prompt(47, 20, vocab=512)  # 5 rows of ratio 4 need 2 blocks; only 1 is given
    result = rec.runner.execute_step(
        DecodeStep(
            1,
            new_requests=[
                NewRequestData(
                    "bad", tokens, GREEDY, list(range(5)), 0, 20, 1, group_kv_block_ids=[[9], [10]]
                )
            ],
        )
    )
    (out,) = result.outputs
    assert out.error_kind is not None and "compressed KV group cannot hold 20 tokens" in out.error_message
    result = rec.runner.execute_step(
        DecodeStep(2, new_requests=[NewRequestData("bad2", tokens, GREEDY, list(range(5)), 0, 20, 1)])
    )
    (out,) = result.outputs
    assert out.error_kind is not None and "block tables for a layout of 3 KV groups" in out.error_message
    null_row = NewRequestData(
        "bad3", tokens, GREEDY, list(range(5)), 0, 20, 1, group_kv_block_ids=[[9, NULL_BLOCK_ID], [10]]
    )
    (out,) = _outputs(rec.runner, DecodeStep(3, new_requests=[null_row]))
    assert (
        out.error_kind is not None and "KV block id outside [0, 64)" in out.error_message
    )  # only windows slide
    # The worker goes on serving after refusing them.
    good = NewRequestData(
        "good", tokens, GREEDY, list(range(5)), 0, 20, 1, group_kv_block_ids=[[9, 11], [10]]
    )
    (out,) = _outputs(rec.runner, DecodeStep(4, new_requests=[good]))
    assert out.error_kind is None and out.sampled_token_id is not None


def test_config_checks() -> None:
    raw = {
        "model_type": "llama_compressed", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "sliding_window": 4, "compress_ratios": [0, 4],
    }  # fmt: skip
    assert config_from_hf_dict(raw).compress_ratios == (0, 4)
    with pytest.raises(ModelConfigError, match="one ratio >= 0 per layer"):
        config_from_hf_dict({**raw, "compress_ratios": [4]})
    with pytest.raises(ModelConfigError, match="at least every compress ratio"):
        config_from_hf_dict({**raw, "compress_ratios": [0, 8]})


def test_the_engine_scheduler_drives_the_worker_on_its_compressed_layout(runner: ModelRunner) -> None:
    """The engine's scheduler on the stated layout (3 groups), every step through protobuf: a prompt sharing
    a prefix with an earlier one hits it, requests too many for the compressed pools are preempted and
    resumed; every greedy token equals the dense recomputation's."""
    runner.reset()
    num_blocks = 64
    groups = worker_groups(runner)
    # Small compressed pools: the rows, not the window, bound how many requests run at once.
    groups = (groups[0], *(replace(g, num_blocks=8) for g in groups[1:]))
    cap = capability(
        runner, "tiny-compressed", groups, max_batch_tokens=24, num_blocks=num_blocks, max_model_len=4096
    )
    scheduler = Scheduler(cap, SchedulerConfig(), seed=1)
    shared = prompt(50, 36, vocab=512)
    prompts = {f"r{i}": shared + prompt(51 + i, 10 + 7 * i, vocab=512) for i in range(5)}
    produced: dict[str, list[int]] = {}

    def serve(rids: list[str]) -> None:
        serve_greedy(scheduler, runner, {rid: prompts[rid] for rid in rids}, 16, produced)

    serve(["r0"])
    serve(["r4"])  # after r0: its first 32 shared tokens (whole blocks of every group) are a hit
    assert scheduler.counters.cached_tokens == 32
    serve(["r1", "r2", "r3"])  # together they overflow the 8 blocks of the ratio-4 group
    assert scheduler.counters.preemptions > 0
    model = model_of(runner)
    for rid, tokens in prompts.items():
        assert produced[rid] == dense_greedy(model, tokens, 16), rid


def test_tensor_parallelism_is_refused() -> None:
    from ominix_runtime.models import resolve_model
    from ominix_worker.attention.torch_ref import TorchReferenceAttention
    from ominix_worker.loader import ModelLoadError, load_model
    from ominix_worker.parallel import TensorParallel

    tp = TensorParallel(rank=0, size=2, group=object())  # type: ignore[arg-type]  # refused before any collective
    with pytest.raises(ModelLoadError, match="without tensor parallelism"):
        load_model(
            resolve_model(f"dummy:{CONFIG}"),
            torch.device("cpu"),
            torch.float32,
            TorchReferenceAttention(),
            tp=tp,
        )
