"""CUDA-graph decode steps against the eager forward on the same runner: same logits, padding rows inert.
The dense Llama shape and a Qwen3-MoE shape (Triton fused MoE inside the graph) both run."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:  # the runner is imported inside the tests, after the CUDA skip
    from ominix_worker.runner import CachedRequest, ModelRunner, ScheduledRow

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1000,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_MOE_CONFIG = {
    **_CONFIG,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 128,
    "norm_topk_prob": True,
}
CONFIGS = pytest.mark.parametrize("model_config", [_CONFIG, _MOE_CONFIG], ids=["dense", "moe"])


def _runner(tmp_path: Path, model_config: dict[str, object] = _CONFIG) -> ModelRunner:
    from ominix_worker.runner import build_runner

    config = tmp_path / "config.json"
    config.write_text(json.dumps(model_config))
    torch.backends.cuda.matmul.allow_tf32 = False
    return build_runner(
        f"dummy:{config}", device="cuda", dtype=torch.float32, num_blocks=96, max_model_len=512
    )


def _rows(requests: list[CachedRequest], decode: bool) -> list[ScheduledRow]:
    from ominix_worker.runner import ScheduledRow

    rows = []
    for req in requests:
        start = req.num_tokens - 1 if decode else 0
        rows.append(ScheduledRow(req, start, req.num_tokens, samples=True))
    return rows


@torch.inference_mode()
def _eager_logits(runner: ModelRunner, rows: list[ScheduledRow]) -> torch.Tensor:
    inputs = runner._prepare_inputs(rows)
    # Once decode graphs exist the eager LM head is padded to a captured size: the sampled rows come first.
    return runner.model.compute_logits(runner._forward(inputs))[: len(inputs.sampling_rows)]


@CONFIGS
def test_graph_decode_matches_eager(tmp_path: Path, model_config: dict[str, object]) -> None:
    from ominix_runtime.contract import SamplingParams
    from ominix_worker.runner import CachedRequest

    runner = _runner(tmp_path, model_config)
    assert runner.capture_decode_graphs([1, 2, 4, 8])
    graphs = runner._graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    assert runner.logits_row_sizes == (1, 2, 4, 8)  # eager LM heads pad to the captured sizes from now on
    rng = random.Random(7)
    free_blocks = list(range(runner.group_num_blocks[0]))
    rng.shuffle(free_blocks)  # non-contiguous block tables
    requests = []
    for i, prompt_len in enumerate((5, 17, 40, 63, 16)):
        blocks = [free_blocks.pop() for _ in range(8)]
        prompt = [rng.randrange(3, 1000) for _ in range(prompt_len)]
        requests.append(CachedRequest(f"r{i}", prompt, [], SamplingParams(temperature=0.0), [blocks], 0, 0))
    with torch.inference_mode():
        _eager_logits(runner, _rows(requests, decode=False))  # prefill writes the prompts' KV
    for step in range(6):
        live = requests if step < 3 else [requests[4], requests[0], requests[2]]  # order and size change
        for req in live:
            req.output_token_ids.append(rng.randrange(3, 1000))
        rows = _rows(live, decode=True)
        assert runner._graph_step(rows)
        with torch.inference_mode():
            graph_logits = graphs.run(rows).clone()
            eager_logits = _eager_logits(runner, rows)
        assert graph_logits.shape == eager_logits.shape
        assert torch.isfinite(graph_logits).all()
        err = (graph_logits - eager_logits).norm() / eager_logits.norm()
        assert err < 1e-4, f"step {step}: relative error {err:.2e}"


@CONFIGS
def test_graph_step_end_to_end_greedy(tmp_path: Path, model_config: dict[str, object]) -> None:
    """execute_step with graphs on gives the same greedy tokens as with graphs off."""
    from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData, SamplingParams

    tokens = {}
    for use_graphs in (False, True):
        runner = _runner(tmp_path, model_config)
        if use_graphs:
            assert runner.capture_decode_graphs([1, 2, 4])
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (9, 30, 21)]
        new = [
            NewRequestData(
                request_id=f"q{i}",
                prompt_token_ids=p,
                sampling=SamplingParams(temperature=0.0, max_tokens=8),
                kv_block_ids=list(range(8 * i, 8 * i + 8)),
                num_computed_tokens=0,
                num_scheduled_tokens=len(p),
                effective_seed=i,
            )
            for i, p in enumerate(prompts)
        ]
        out: dict[str, list[int]] = {f"q{i}": [] for i in range(3)}
        result = runner.execute_step(DecodeStep(step_id=1, new_requests=new))
        for o in result.outputs:
            out[o.request_id].append(o.sampled_token_id)
        for step_id in range(2, 8):
            running = [
                RunningRequestData(request_id=rid, new_kv_block_ids=[], num_scheduled_tokens=1) for rid in out
            ]
            result = runner.execute_step(DecodeStep(step_id=step_id, running_requests=running))
            for o in result.outputs:
                assert o.error_kind is None, o.error_message
                out[o.request_id].append(o.sampled_token_id)
        tokens[use_graphs] = out
    assert tokens[True] == tokens[False]


def test_prefill_graph_matches_eager(tmp_path: Path) -> None:
    """Short single-request chunks after cached context: graph logits of the last position = eager ones."""
    from ominix_runtime.contract import SamplingParams
    from ominix_worker.runner import CachedRequest, ScheduledRow

    runner = _runner(tmp_path)
    assert runner.capture_decode_graphs([1, 2])
    graphs = runner._graphs
    assert graphs is not None and sorted(graphs.prefill_graphs) == [16, 32, 64]
    rng = random.Random(11)
    blocks = rng.sample(range(runner.group_num_blocks[0]), 12)
    prompt = [rng.randrange(3, 1000) for _ in range(40 + 20 + 16 + 2 + 64)]
    req = CachedRequest("p", prompt, [], SamplingParams(temperature=0.0), [blocks], 0, 0)
    with torch.inference_mode():
        _eager_logits(runner, [ScheduledRow(req, 0, 40, samples=False)])
        start = 40
        for num in (20, 16, 2, 64):
            row = ScheduledRow(req, start, start + num, samples=True)
            assert graphs.fits_prefill([row])
            graph_logits = graphs.run_prefill(row).clone()
            eager_logits = _eager_logits(runner, [row])[-1:]
            err = (graph_logits - eager_logits).norm() / eager_logits.norm()
            assert err < 1e-4, f"chunk of {num}: relative error {err:.2e}"
            start += num


@pytest.mark.parametrize("pipeline_eager", [False, True], ids=["graphs", "graphs+eager"])
def test_overlapped_decode_matches_synchronous(tmp_path: Path, pipeline_eager: bool) -> None:
    """Steps launched before the previous step's ids reach the host give the same tokens, in step order.

    Greedy and seeded-sampling rows overlap; a penalty row forces the synchronous path for the steps it
    decodes in; a prefill mid-run and a finished request exercise the switches between the two. A greedy
    prompt in two chunks beside the decodes (steps 24 and 25) overlaps too with ``pipeline_eager``: its decode
    rows' inputs are then the pending step's ids, gathered on the device.
    """
    from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData, SamplingParams

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (9, 30, 21, 14, 40)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=64),
        SamplingParams(temperature=0.8, top_k=50, seed=1234, max_tokens=64),
        SamplingParams(temperature=0.0, max_tokens=64),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=64),
        SamplingParams(temperature=0.0, max_tokens=64),
    ]

    def new(i: int, num_scheduled: int = 0) -> NewRequestData:
        return NewRequestData(
            request_id=f"q{i}",
            prompt_token_ids=prompts[i],
            sampling=params[i],
            kv_block_ids=list(range(8 * i, 8 * i + 8)),
            num_computed_tokens=0,
            num_scheduled_tokens=num_scheduled or len(prompts[i]),
            effective_seed=i,
        )

    def running(ids: list[str]) -> list[RunningRequestData]:
        return [RunningRequestData(request_id=r, new_kv_block_ids=[], num_scheduled_tokens=1) for r in ids]

    # The engine's schedule, fixed in advance (it never needs a token value to decide these).
    schedule: list[DecodeStep] = [DecodeStep(step_id=1, new_requests=[new(0), new(1), new(2)])]
    live = ["q0", "q1", "q2"]
    for step_id in range(2, 30):
        if step_id == 8:
            schedule.append(
                DecodeStep(step_id=step_id, new_requests=[new(3)], running_requests=running(live))
            )
            live = [*live, "q3"]
        elif step_id == 14:  # q3 (penalties) finished: back to overlapped steps
            live = ["q0", "q1", "q2"]
            schedule.append(
                DecodeStep(step_id=step_id, finished_request_ids=["q3"], running_requests=running(live))
            )
        elif step_id == 20:
            live = ["q1", "q2"]
            schedule.append(
                DecodeStep(step_id=step_id, finished_request_ids=["q0"], running_requests=running(live))
            )
        elif step_id == 24:  # q4's prompt in two chunks beside the decodes (a mixed step, then one more)
            schedule.append(
                DecodeStep(step_id=step_id, new_requests=[new(4, 25)], running_requests=running(live))
            )
        elif step_id == 25:
            chunk = RunningRequestData(request_id="q4", new_kv_block_ids=[], num_scheduled_tokens=15)
            schedule.append(DecodeStep(step_id=step_id, running_requests=[*running(live), chunk]))
            live = [*live, "q4"]
        else:
            schedule.append(DecodeStep(step_id=step_id, running_requests=running(live)))

    tokens: dict[bool, dict[str, list[int]]] = {}
    for overlap in (False, True):
        runner = _runner(tmp_path)
        assert runner.capture_decode_graphs([1, 2, 4])
        runner.overlap_steps = overlap
        runner.pipeline_eager = pipeline_eager
        results = []
        pending_after: set[int] = set()  # steps still pending once launched
        for step in schedule:
            result = runner.execute_step(step)
            if overlap:
                assert result is None
                results.extend(runner.take_results())
                if runner.has_pending():
                    pending_after.add(step.step_id)
            else:
                results.append(result)
        runner.finish_pending()
        results.extend(runner.take_results())
        assert [r.step_id for r in results] == [s.step_id for s in schedule]
        out: dict[str, list[int]] = {}
        for r in results:
            for o in r.outputs:
                assert o.error_kind is None, o.error_message
                if o.sampled_token_id is not None:
                    out.setdefault(o.request_id, []).append(o.sampled_token_id)
        if overlap:
            assert len(pending_after) > 10  # most decode steps did overlap
            # the chunked prompt's steps overlap with the eager pipeline only
            assert ({24, 25} <= pending_after) == pipeline_eager, sorted(pending_after)
            assert all(t >= 0 for req in runner.requests.values() for t in req.output_token_ids)
        tokens[overlap] = out
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("graphs", ["eager", "decode", "piecewise"])
def test_a_whole_prompt_hit_samples_what_the_whole_prompt_did(tmp_path: Path, graphs: str) -> None:
    """A prompt found whole in the cache computes its last token alone, beside a fresh prompt (a prefill or
    mixed step) and alone (a step of one-token rows), and the Triton store leaves the shared blocks as they
    were; eagerly, with decode graphs, and with the piecewise graphs of prefill and mixed steps."""
    from ominix_runtime.contract import DecodeStep, NewRequestData, SamplingParams

    runner = _runner(tmp_path)
    assert runner.supports_whole_prompt_hits
    if graphs != "eager":
        assert runner.capture_decode_graphs([1, 2, 4])
    if graphs == "piecewise":
        assert runner.capture_piecewise_graphs(128) > 0
    rng = random.Random(7)
    prompt = [rng.randrange(3, 1000) for _ in range(32)]  # two whole blocks of 16
    other = [rng.randrange(3, 1000) for _ in range(20)]
    greedy = SamplingParams(temperature=0.0, logprobs=5)
    first = runner.execute_step(
        DecodeStep(1, new_requests=[NewRequestData("a", prompt, greedy, [3, 4], 0, 32, 0)])
    ).outputs[0]
    cached = [cache[:, [3, 4]].clone() for cache in runner.kv_caches]

    def whole_hit(rid: str) -> NewRequestData:
        return NewRequestData(rid, prompt, greedy, [3, 4], 31, 1, 0, num_cached_kv_tokens=32)

    beside = NewRequestData("c", other, greedy, [5, 6], 0, 20, 0)
    mixed = runner.execute_step(
        DecodeStep(2, new_requests=[whole_hit("b"), beside], finished_request_ids=["a"])
    )
    alone = runner.execute_step(DecodeStep(3, new_requests=[whole_hit("d")], finished_request_ids=["b", "c"]))
    assert first.logprobs is not None
    for out in (mixed.outputs[0], alone.outputs[0]):
        assert out.error_kind is None, out.error_message
        assert out.sampled_token_id == first.sampled_token_id and out.logprobs is not None
        assert [t.token_id for t in out.logprobs.top] == [t.token_id for t in first.logprobs.top]
        for got, want in zip(out.logprobs.top, first.logprobs.top, strict=True):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-3)
    for before, cache in zip(cached, runner.kv_caches, strict=True):
        assert torch.equal(before, cache[:, [3, 4]])
