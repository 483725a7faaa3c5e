"""Prefill and mixed steps replayed from piecewise CUDA graphs (``piecewise_graph.PiecewiseGraphs``) against
the eager forward on the same runner: same logits, padding rows write no KV, the layers' hook runs between the
pieces, a finer bucket spacing pads a step to its own next bucket, a failed capture leaves the runner eager,
timing the buckets writes no KV and a step routed to a larger bucket keeps its logits, and execute_step gives
the same tokens. The dense Llama shape and a Qwen3-MoE shape (test_decode_graphs.py's, with three layers) both
run."""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from test_decode_graphs import _CONFIG as TWO_LAYERS
from test_decode_graphs import _MOE_CONFIG as TWO_MOE_LAYERS
from test_decode_graphs import _runner
from test_hybrid_layers_gpu import drive, tokens

if TYPE_CHECKING:  # the runner is imported inside the tests, after the CUDA skip
    from ominix_worker.piecewise_graph import PiecewiseGraphs
    from ominix_worker.runner import CachedRequest, ModelRunner, ScheduledRow

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_CONFIG = {**TWO_LAYERS, "num_hidden_layers": 3}
_MOE_CONFIG = {**TWO_MOE_LAYERS, "num_hidden_layers": 3}
CONFIGS = pytest.mark.parametrize("model_config", [_CONFIG, _MOE_CONFIG], ids=["dense", "moe"])
_runner = partial(_runner, model_config=_CONFIG)  # the dense shape unless a test names another


def _logits(runner: ModelRunner, rows: list[ScheduledRow]) -> tuple[torch.Tensor, int]:
    """Sampled rows' logits of one forward, and the bucket it replayed (0: eager)."""
    inputs = runner._prepare_inputs(rows)
    logits = runner.model.compute_logits(runner._forward(inputs))
    return logits[: len(inputs.sampling_rows)].clone(), inputs.piecewise_bucket


def _captured(tmp_path: Path, max_tokens: int = 128) -> tuple[ModelRunner, PiecewiseGraphs]:
    """A dense runner with its prefill and mixed steps captured in pieces up to ``max_tokens``."""
    runner = _runner(tmp_path)
    assert runner.capture_piecewise_graphs(max_tokens, step=32) == max_tokens // 32
    graphs = runner._piecewise_graphs
    assert graphs is not None
    return runner, graphs


def _request(rng: random.Random, name: str, prompt_len: int, blocks: list[int]) -> CachedRequest:
    from ominix_runtime.contract import SamplingParams
    from ominix_worker.runner import CachedRequest

    prompt = [rng.randrange(3, 1000) for _ in range(prompt_len)]
    return CachedRequest(name, prompt, [], SamplingParams(temperature=0.0), [blocks], 0, 0)


def _bits(kv: torch.Tensor) -> torch.Tensor:
    """A float32 KV tensor's slots (2, slots, heads, head_dim) as integers: NaN-safe equality of unwritten
    (``torch.empty``) memory."""
    return kv.view(torch.int32).view(2, -1, kv.shape[3], kv.shape[4])


@CONFIGS
@pytest.mark.parametrize("sampled_rows", [0, 3], ids=["whole-tail", "kept-tail"])
def test_pieces_match_eager_forward(
    tmp_path: Path, model_config: dict[str, object], sampled_rows: int
) -> None:
    """Two prompts, then their decode rows beside a third prompt's chunks. Each step runs from the pieces first:
    their captured KV store writes the step's slots and no other; then eagerly: the same logits, and the same
    K/V in those slots. With ``sampled_rows`` 3 every bucket is captured to run its last layer past attention
    on 3 rows (the steps sample 2 or 3); with 0 on all of its rows."""
    from ominix_worker.runner import ScheduledRow

    runner = _runner(tmp_path, model_config=model_config)
    assert runner.capture_piecewise_graphs(256, step=32, sampled_rows=sampled_rows) == 8
    graphs = runner._piecewise_graphs
    assert graphs is not None and graphs.buckets == (32, 64, 96, 128, 160, 192, 224, 256)
    assert graphs.tail_rows == sampled_rows  # no decode graphs: the LM head pads nothing
    assert all(graphs._keeps_tail(b) for b in graphs.buckets) == bool(sampled_rows)
    rng = random.Random(7)
    free_blocks = list(range(1, runner.group_num_blocks[0]))  # block 0 unused: a padding row's slot 0 shows
    rng.shuffle(free_blocks)
    a = _request(rng, "a", 40, [free_blocks.pop() for _ in range(8)])
    b = _request(rng, "b", 70, [free_blocks.pop() for _ in range(8)])
    c = _request(rng, "c", 150, [free_blocks.pop() for _ in range(12)])
    steps = [
        [ScheduledRow(a, 0, 40, True), ScheduledRow(b, 0, 70, True)],  # 110 tokens: bucket 128
        [ScheduledRow(a, 40, 41, True), ScheduledRow(b, 70, 71, True), ScheduledRow(c, 0, 62, False)],  # 64
        [ScheduledRow(c, 62, 150, True), ScheduledRow(b, 71, 72, True), ScheduledRow(a, 41, 42, True)],  # 96
        # 32 after 96: the kept rows' indices of the step before (up to 89) lie past this bucket's rows
        [ScheduledRow(b, 72, 73, True), ScheduledRow(a, 42, 43, True)],
    ]
    for req in (a, b):
        req.output_token_ids.extend(rng.randrange(3, 1000) for _ in range(3))
    expected_buckets = [128, 64, 96, 32]
    for rows, bucket in zip(steps, expected_buckets, strict=True):
        bs = runner.block_size
        step_slots = torch.tensor(
            [r.request.block_tables[0][p // bs] * bs + p % bs for r in rows for p in range(r.start, r.end)],
            device="cuda",
        )
        others = torch.ones(_bits(runner.kv_caches[0]).shape[1], dtype=torch.bool, device="cuda")
        others[step_slots] = False
        with torch.inference_mode():
            kv_before = [kv.clone() for kv in runner.kv_caches]
            pieces, graph_bucket = _logits(runner, rows)
            kv_pieces = [kv.clone() for kv in runner.kv_caches]
            runner._piecewise_graphs = None
            eager, eager_bucket = _logits(runner, rows)  # writes the step's slots again
            runner._piecewise_graphs = graphs
        assert (eager_bucket, graph_bucket) == (0, bucket)
        assert pieces.shape == eager.shape and torch.isfinite(pieces).all()
        err = (pieces - eager).norm() / eager.norm()
        assert err < 1e-4, f"bucket {bucket}: relative error {err:.2e}"
        assert torch.equal(pieces.argmax(-1), eager.argmax(-1))
        for layer, (before, written, after) in enumerate(
            zip(kv_before, kv_pieces, runner.kv_caches, strict=True)
        ):
            assert torch.equal(_bits(before)[:, others], _bits(written)[:, others]), (
                f"layer {layer}: padding wrote"
            )
            mine, ref = (
                _bits(written)[:, step_slots].view(torch.float32),
                _bits(after)[:, step_slots].view(torch.float32),
            )
            assert torch.allclose(mine, ref, rtol=1e-4, atol=1e-5), f"layer {layer}: the step's K/V differ"


def test_between_layers_runs_after_each_layer(tmp_path: Path) -> None:
    """The early-result poll runs once per layer between the pieces, each time after that layer's attention,
    as in the eager forward."""
    from ominix_worker.runner import ScheduledRow

    runner, graphs = _captured(tmp_path)
    rng = random.Random(3)
    req = _request(rng, "p", 100, list(range(1, 9)))
    attended: list[int] = []
    polled_after: list[int] = []
    forward_into = graphs.attention.forward_into

    def counting_forward_into(*args: object, **kwargs: object) -> None:
        attended.append(1)
        forward_into(*args, **kwargs)  # type: ignore[arg-type]

    graphs.attention.forward_into = counting_forward_into  # type: ignore[method-assign]
    runner.model.between_layers = lambda: polled_after.append(len(attended))
    try:
        with torch.inference_mode():
            _, bucket = _logits(runner, [ScheduledRow(req, 0, 100, True)])
    finally:
        del graphs.attention.forward_into  # type: ignore[attr-defined]
    assert bucket == 128
    assert polled_after == list(range(1, _CONFIG["num_hidden_layers"] + 1))  # type: ignore[operator]


def test_a_failed_capture_leaves_a_lone_runner_eager_and_stops_a_group_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capture that fails inside a piece (here at the last bucket) leaves no graphs, the backend's hook and
    the model's poll as they were, and the runner's steps eager; on a rank of a group it raises instead."""
    from ominix_worker.parallel import TensorParallel
    from ominix_worker.piecewise_graph import PiecewiseGraphs
    from ominix_worker.runner import ScheduledRow

    real_pass = PiecewiseGraphs._pass

    def failing_pass(self: PiecewiseGraphs, bucket: int, kv_caches: list[torch.Tensor]) -> None:
        if bucket == 32 and self._graph is not None:
            raise RuntimeError("injected: a capture that fails part-way")
        real_pass(self, bucket, kv_caches)

    monkeypatch.setattr(PiecewiseGraphs, "_pass", failing_pass)
    runner = _runner(tmp_path)
    poll = runner.model.between_layers = lambda: None
    assert runner.capture_piecewise_graphs(128, step=32) == 0
    assert runner._piecewise_graphs is None
    assert runner.backend.cut is None  # type: ignore[attr-defined]
    assert runner.model.between_layers is poll
    req = _request(random.Random(1), "p", 100, list(range(1, 9)))
    with torch.inference_mode():
        logits, bucket = _logits(runner, [ScheduledRow(req, 0, 100, True)])
    assert bucket == 0 and torch.isfinite(logits).all()

    runner.model.tp = TensorParallel(rank=1, size=2, group=object())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="rank 1"):
        runner.capture_piecewise_graphs(128, step=32)


def test_timing_the_buckets_writes_no_kv_and_a_routed_step_keeps_its_logits(tmp_path: Path) -> None:
    """After a real step (its slots in the static buffer), timing every bucket writes no KV; the times cover
    every bucket and each route goes up to a captured bucket; a step routed to a larger bucket gives the eager
    logits. An MoE model's buckets are not timed."""
    from ominix_worker.runner import ScheduledRow

    runner, graphs = _captured(tmp_path)
    rng = random.Random(4)
    first = _request(rng, "a", 70, list(range(1, 9)))
    with torch.inference_mode():
        _, bucket = _logits(runner, [ScheduledRow(first, 0, 70, True)])
        assert bucket == 96 and int(graphs.slots.max()) >= 0  # the step's slots are in the static buffer
        kv_before = [kv.clone() for kv in runner.kv_caches]
    times, routes = graphs.time_buckets(replays=1, rounds=1)
    for before, after in zip(kv_before, runner.kv_caches, strict=True):
        assert torch.equal(_bits(before), _bits(after))
    assert sorted(times) == [32, 64, 96, 128] and all(0.0 < ms < 1_000.0 for ms in times.values())
    assert all(target > b and target in graphs.buckets for b, target in routes.items())
    with pytest.raises(ValueError, match="replays"):
        graphs.time_buckets(replays=0)

    with pytest.raises(ValueError, match="32 -> 48"):
        graphs.set_routes({32: 48})
    with pytest.raises(ValueError, match="64 -> 32"):
        graphs.set_routes({64: 32})
    graphs.set_routes({32: 128, 64: 128, 96: 128})
    req = _request(rng, "p", 40, list(range(9, 17)))
    rows = [ScheduledRow(req, 0, 40, True)]
    with torch.inference_mode():
        routed, bucket = _logits(runner, rows)
        runner._piecewise_graphs = None
        eager, _ = _logits(runner, rows)
    assert bucket == 128
    err = (routed - eager).norm() / eager.norm()
    assert err < 1e-4 and torch.equal(routed.argmax(-1), eager.argmax(-1))

    timed = _runner(tmp_path)
    assert timed.capture_piecewise_graphs(128, timed=True, step=32) == 4
    assert sorted(timed.piecewise_bucket_ms) == [32, 64, 96, 128]
    moe = _runner(tmp_path, model_config=_MOE_CONFIG)
    assert moe.capture_piecewise_graphs(128, timed=True, step=32) == 4
    assert moe.piecewise_bucket_ms == {}


def test_steps_past_the_budget_and_models_without_pieces_stay_eager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ominix_worker.models.llama import LlamaForCausalLM
    from ominix_worker.runner import ScheduledRow

    runner = _runner(tmp_path)
    assert runner.capture_piecewise_graphs(64, step=32) == 2
    rng = random.Random(5)
    req = _request(rng, "p", 100, list(range(1, 9)))
    with torch.inference_mode():
        _, bucket = _logits(runner, [ScheduledRow(req, 0, 100, True)])
    assert bucket == 0  # 100 tokens: past the largest bucket

    monkeypatch.setattr(LlamaForCausalLM, "piecewise_graphs", False)
    assert _runner(tmp_path).capture_piecewise_graphs(64) == 0


def test_a_finer_spacing_captures_its_buckets_and_a_step_pads_to_the_next(tmp_path: Path) -> None:
    """``step`` (the worker's ``OMINIX_PIECEWISE_TOKEN_STEP``): buckets every 8 tokens, a 42-token step replays
    the 48 bucket with the eager forward's logits."""
    from ominix_worker.runner import ScheduledRow

    runner = _runner(tmp_path)
    assert runner.capture_piecewise_graphs(64, step=8) == 8
    graphs = runner._piecewise_graphs
    assert graphs is not None and graphs.buckets == (8, 16, 24, 32, 40, 48, 56, 64)
    req = _request(random.Random(11), "p", 42, list(range(1, 9)))
    rows = [ScheduledRow(req, 0, 42, True)]
    with torch.inference_mode():
        pieces, bucket = _logits(runner, rows)
        runner._piecewise_graphs = None
        eager, eager_bucket = _logits(runner, rows)
    assert (eager_bucket, bucket) == (0, 48)
    assert (pieces - eager).norm() / eager.norm() < 1e-4
    assert torch.equal(pieces.argmax(-1), eager.argmax(-1))


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_execute_step_same_tokens(tmp_path: Path, overlap: bool) -> None:
    """A schedule of prompts, decodes and a chunked prompt beside decodes gives the same greedy tokens with the
    eager steps replayed from pieces as without; overlapped, the mixed steps' placeholder inputs are gathered
    into the padded ids on the device."""
    from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData, SamplingParams

    rng = random.Random(9)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (9, 30, 21, 90)]

    def new(i: int, num_scheduled: int = 0) -> NewRequestData:
        return NewRequestData(
            request_id=f"q{i}",
            prompt_token_ids=prompts[i],
            sampling=SamplingParams(temperature=0.0, max_tokens=64),
            kv_block_ids=list(range(8 * i + 1, 8 * i + 9)),
            num_computed_tokens=0,
            num_scheduled_tokens=num_scheduled or len(prompts[i]),
            effective_seed=i,
        )

    def running(ids: list[str]) -> list[RunningRequestData]:
        return [RunningRequestData(request_id=r, new_kv_block_ids=[], num_scheduled_tokens=1) for r in ids]

    live = ["q0", "q1", "q2"]
    schedule = [DecodeStep(step_id=1, new_requests=[new(0), new(1), new(2)])]
    for step_id in range(2, 16):
        if step_id == 6:  # q3's prompt in two chunks beside the decodes
            schedule.append(
                DecodeStep(step_id=step_id, new_requests=[new(3, 50)], running_requests=running(live))
            )
        elif step_id == 7:
            chunk = RunningRequestData(request_id="q3", new_kv_block_ids=[], num_scheduled_tokens=40)
            schedule.append(DecodeStep(step_id=step_id, running_requests=[*running(live), chunk]))
            live = [*live, "q3"]
        else:
            schedule.append(DecodeStep(step_id=step_id, running_requests=running(live)))

    by_pieces: dict[bool, dict[str, list[int]]] = {}
    for pieces in (False, True):
        runner = _runner(tmp_path)
        assert runner.capture_decode_graphs([1, 2, 4])
        if pieces:
            assert runner.capture_piecewise_graphs(128, step=32) == 4
        runner.overlap_steps = overlap
        by_pieces[pieces] = tokens(drive(runner, schedule)[0])  # every step's result in order, no error
    assert by_pieces[True] == by_pieces[False]
    assert len(by_pieces[True]["q3"]) == 9  # its last chunk sampled, then 8 decodes
