"""Hybrid KV layouts on CUDA: Triton paged attention honours each layer's window.

1. Kernels: a Gemma-3-like stack of layers (windowed and global, each with its own cache and block table;
   blocks behind a window nulled and NaN-poisoned as after the engine freed them) against the torch
   reference backend on the same data.
2. The whole runner on CUDA (Triton, float32) against the CPU runner (torch reference) on tiny Gemma 3 and
   Qwen2-with-layer_types models: prefill, chunked prefill, decode far past the window, a prefix hit whose
   sliding tables start with nulls. Logits of every sampled row and the greedy tokens agree.
3. CUDA-graph decode (one block table and slot row per KV group in the static buffers), synchronous and
   overlapped, gives the eager runner's tokens, and a graph replay's logits equal the eager forward's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from ominix_runtime.contract import (
    NULL_BLOCK_ID,
    DecodeStep,
    NewRequestData,
    RunningRequestData,
    SamplingParams,
    StepResult,
)

if TYPE_CHECKING:
    from ominix_worker.runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

WINDOW = 12
BS = 16
GREEDY = SamplingParams(temperature=0.0)
HYBRID_MODELS: dict[str, dict[str, object]] = {
    "gemma3": dict(
        arch="gemma3_text",
        num_layers=6,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        tie_word_embeddings=True,
        seed=12,
    ),
    "gemma3_capped": dict(
        arch="gemma3_text",
        num_layers=6,
        sliding_window=WINDOW,
        sliding_window_pattern=3,
        final_logit_softcapping=3.0,
        seed=13,
    ),
    "qwen2": dict(
        arch="qwen2",
        num_layers=3,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
        seed=11,
    ),
}


# ---- 1. kernels ---------------------------------------------------------------------------------------


@pytest.fixture
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.usefixtures("_no_tf32")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("decode_splits", [None, 1, 4])
def test_gemma_like_layers_match_the_torch_reference(dtype: torch.dtype, decode_splits: int | None) -> None:
    pytest.importorskip("triton")
    from test_triton_attention import TOLERANCE, make_batch
    from test_triton_sliding_window import slide

    from ominix_worker.attention.torch_ref import TorchReferenceAttention
    from ominix_worker.attention.triton_paged import TritonPagedAttention

    # Decode rows far past the window and inside it, a chunk after a long context, a whole prompt.
    q_lens, seq_lens = [1, 1, 37, 1, 200], [700, 9, 300, 129, 200]
    num_heads, num_kv_heads, head_dim = 8, 4, 64
    scale = 1.0 / math.sqrt(head_dim)
    backend = TritonPagedAttention(block_size=BS)
    backend.decode_splits = decode_splits
    reference = TorchReferenceAttention(block_size=BS)
    windows = [64, 64, 64, 64, 64, 0]  # five local layers, one global
    outputs: list[torch.Tensor] = []
    for layer, window in enumerate(windows):
        gen = torch.Generator().manual_seed(200 + layer)
        batch = make_batch(gen, q_lens, seq_lens, num_heads, num_kv_heads, head_dim, BS, dtype, backend)
        if window:
            assert slide(batch, window, BS) > 0
        backend.write_kv(batch.kv_cache, batch.new_key, batch.new_value, batch.meta)
        out = torch.full_like(batch.query, float("nan"))
        backend.forward_into(batch.query, batch.kv_cache, batch.meta, scale, out)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), f"layer {layer}: a null or poisoned block was read"
        meta = batch.meta
        cpu_meta = replace(
            meta,
            query_start_loc=meta.query_start_loc.cpu(),
            seq_lens=meta.seq_lens.cpu(),
            block_tables=meta.block_tables.cpu(),
            slot_mapping=meta.slot_mapping.cpu(),
            query_start_loc_cpu=meta.query_start_loc.tolist(),
            seq_lens_cpu=meta.seq_lens.tolist(),
        )
        # The reference reads only what the window shows too; poisoned slots become zeros so that its
        # padded decode batch (masked, never weighted) cannot turn NaN.
        cache = batch.kv_cache.float().cpu().nan_to_num(0.0)
        expected = reference.forward(batch.query.float().cpu(), cache, cpu_meta, scale).double()
        got = out.double().cpu()
        start = 0
        for i, q_len in enumerate(q_lens):
            ref, mine = expected[start : start + q_len], got[start : start + q_len]
            start += q_len
            err = ((mine - ref).norm() / ref.norm()).item()
            assert err < TOLERANCE[dtype], f"layer {layer} (window {window}) request {i}: {err:.2e}"
        outputs.append(got)
    # The window matters: the first row (700 tokens, window 64) of a local layer is not its global value.
    gen = torch.Generator().manual_seed(200)
    unwindowed = make_batch(gen, q_lens, seq_lens, num_heads, num_kv_heads, head_dim, BS, dtype, backend)
    backend.write_kv(unwindowed.kv_cache, unwindowed.new_key, unwindowed.new_value, unwindowed.meta)
    full = backend.forward(unwindowed.query, unwindowed.kv_cache, unwindowed.meta, scale).double().cpu()
    assert ((full[0] - outputs[0][0]).norm() / full[0].norm()).item() > 0.05


# ---- 2 and 3. the runner ------------------------------------------------------------------------------


@dataclass
class Tables:
    """Block ids per KV group handed out like an engine would (distinct per group)."""

    num_groups: int
    next_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.next_ids = [1 + 40 * g for g in range(self.num_groups)]  # groups use different ids

    def take(self, n: int) -> list[list[int]]:
        out = []
        for g in range(self.num_groups):
            out.append(list(range(self.next_ids[g], self.next_ids[g] + n)))
            self.next_ids[g] += n
        return out


def hybrid_schedule(
    num_groups: int, prompt_a: list[int], prompt_b: list[int], tail_c: list[int]
) -> list[DecodeStep]:
    """A token-independent schedule (the worker feeds its own sampled tokens): ``a`` prefills whole, ``b``
    in chunks beside ``a``'s decodes, both decode far past the window, then ``c`` hits ``b``'s first 64
    prompt tokens (its sliding tables null before the window) and all three decode."""
    assert len(prompt_b) >= 64 and num_groups == 2
    tables = Tables(num_groups)
    lengths = {"a": len(prompt_a), "b": len(prompt_b)}
    held: dict[str, list[list[int]]] = {}

    def new(
        rid: str, prompt: list[int], computed: int, scheduled: int, seed: int, blocks: list[list[int]]
    ) -> NewRequestData:
        held[rid] = blocks
        return NewRequestData(
            rid, prompt, GREEDY, blocks[0], computed, scheduled, seed, group_kv_block_ids=blocks[1:]
        )

    def grow(rid: str, upto: int) -> list[list[int]]:
        need = -(-upto // BS) - len(held[rid][0])
        added = tables.take(max(0, need))
        for table, more in zip(held[rid], added, strict=True):
            table.extend(more)
        return added

    def running(rid: str, n: int, upto: int) -> RunningRequestData:
        added = grow(rid, upto)
        return RunningRequestData(rid, added[0], n, new_group_kv_block_ids=added[1:])

    steps = [
        DecodeStep(
            1,
            new_requests=[
                new("a", prompt_a, 0, len(prompt_a), 1, tables.take(-(-(len(prompt_a)) // BS))),
                new("b", prompt_b, 0, 30, 2, tables.take(2)),
            ],
        )
    ]
    # a: prompt + 1 sampled token; b: 30 of its prompt computed.
    lengths["a"] += 1
    steps.append(DecodeStep(2, running_requests=[running("a", 1, lengths["a"]), running("b", 30, 60)]))
    lengths["a"] += 1
    rest = len(prompt_b) - 60
    steps.append(
        DecodeStep(3, running_requests=[running("a", 1, lengths["a"]), running("b", rest, len(prompt_b))])
    )
    lengths["a"] += 1
    lengths["b"] += 1
    step_id = 4
    for _ in range(24):  # decode: a and b go well past several windows and blocks
        steps.append(DecodeStep(step_id, running_requests=[running(r, 1, lengths[r]) for r in ("a", "b")]))
        for r in ("a", "b"):
            lengths[r] += 1
        step_id += 1
    # c: b's first 64 prompt tokens are cached (4 full blocks). The full group shares them; the sliding group
    # keeps only the block of positions 48-63 (the window of position 64 starts at 53), the rest null.
    prompt_c = prompt_b[:64] + tail_c
    shared = [held["b"][0][:4], [NULL_BLOCK_ID] * 3 + [held["b"][1][3]]]
    own = tables.take(-(-(len(prompt_c) + 30) // BS) - 4)
    c_blocks = [s + o for s, o in zip(shared, own, strict=True)]
    steps.append(
        DecodeStep(
            step_id,
            new_requests=[new("c", prompt_c, 64, len(prompt_c) - 64, 3, c_blocks)],
            running_requests=[running(r, 1, lengths[r]) for r in ("a", "b")],
        )
    )
    for r in ("a", "b"):
        lengths[r] += 1
    lengths["c"] = len(prompt_c) + 1
    step_id += 1
    for _ in range(16):
        steps.append(
            DecodeStep(step_id, running_requests=[running(r, 1, lengths[r]) for r in ("a", "b", "c")])
        )
        for r in ("a", "b", "c"):
            lengths[r] += 1
        step_id += 1
    return steps


def drive(runner: ModelRunner, steps: list[DecodeStep]) -> tuple[list[StepResult], list[torch.Tensor]]:
    """Every step's result (in order, overlapped or not) and, for eager forwards, the sampled rows' logits."""
    recorded: list[torch.Tensor] = []
    compute_logits = runner.model.compute_logits

    def record(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        recorded.append(logits.float().cpu())
        return logits

    runner.model.compute_logits = record  # type: ignore[method-assign]  # records eager logits
    results: list[StepResult] = []
    try:
        for step in steps:
            result = runner.execute_step(step)
            if result is not None:
                results.append(result)
            results.extend(runner.take_results())
        runner.finish_pending()
        results.extend(runner.take_results())
    finally:
        runner.model.compute_logits = compute_logits  # type: ignore[method-assign]
    assert [r.step_id for r in results] == [s.step_id for s in steps]
    for r in results:
        for o in r.outputs:
            assert o.error_kind is None, o.error_message
    return results, recorded


def tokens(results: list[StepResult]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in results:
        for o in r.outputs:
            if o.sampled_token_id is not None:
                out.setdefault(o.request_id, []).append(o.sampled_token_id)
    return out


@pytest.fixture(scope="module", params=sorted(HYBRID_MODELS))
def hybrid_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ominix_worker.testing import write_tiny_hf_model

    return write_tiny_hf_model(tmp_path_factory.mktemp(request.param), **HYBRID_MODELS[request.param])  # type: ignore[arg-type]


def _runner(folder: Path, device: str) -> ModelRunner:
    from ominix_worker.runner import build_runner

    torch.backends.cuda.matmul.allow_tf32 = False
    attention = "triton" if device == "cuda" else "torch"
    return build_runner(
        str(folder), device=device, dtype=torch.float32, num_blocks=128, block_size=BS, attention=attention,
        max_model_len=512,
    )  # fmt: skip


def _schedule(runner: ModelRunner) -> list[DecodeStep]:
    g = torch.Generator().manual_seed(5)
    prompt_a, prompt_b, tail_c = (torch.randint(3, 320, (n,), generator=g).tolist() for n in (37, 70, 10))
    return hybrid_schedule(len(runner.attention_groups), prompt_a, prompt_b, tail_c)


def test_cuda_runner_matches_the_cpu_reference(hybrid_folder: Path) -> None:
    cuda = _runner(hybrid_folder, "cuda")
    assert cuda.backend.name == "triton-paged" and cuda.kv_windows == (0, WINDOW)
    cpu = _runner(hybrid_folder, "cpu")
    steps = _schedule(cuda)
    cuda_results, cuda_logits = drive(cuda, steps)
    cpu_results, cpu_logits = drive(cpu, _schedule(cpu))
    assert tokens(cuda_results) == tokens(cpu_results)
    assert len(cuda_logits) == len(cpu_logits) == len(steps)
    for i, (mine, ref) in enumerate(zip(cuda_logits, cpu_logits, strict=True)):
        err = ((mine - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-3, f"step {i + 1}: relative error {err:.2e}"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_graph_decode_gives_the_eager_tokens(hybrid_folder: Path, overlap: bool) -> None:
    from ominix_worker.runner import ScheduledRow

    eager = _runner(hybrid_folder, "cuda")
    eager_tokens = tokens(drive(eager, _schedule(eager))[0])
    graphed = _runner(hybrid_folder, "cuda")
    assert graphed.capture_decode_graphs([1, 2, 4])
    graphed.overlap_steps = overlap
    assert tokens(drive(graphed, _schedule(graphed))[0]) == eager_tokens
    # One more decode of the three live requests (their sliding tables hold nulls and stale ids): a graph
    # replay's logits equal the eager forward's.
    graphs = graphed._graphs
    assert graphs is not None
    rows = []
    spare = iter(range(127, 0, -1))  # ids the schedule never handed out
    for req in graphed.requests.values():
        while len(req.block_tables[0]) * BS < req.num_tokens:
            for table in req.block_tables:
                table.append(next(spare))
        rows.append(ScheduledRow(req, req.num_tokens - 1, req.num_tokens, samples=True))
    assert any(NULL_BLOCK_ID in r.request.block_tables[1] for r in rows)
    with torch.inference_mode():
        graph_logits = graphs.run(rows).clone()
        inputs = graphed._prepare_inputs(rows)
        eager_logits = graphed.model.compute_logits(graphed._forward(inputs))[: len(rows)]
    err = ((graph_logits - eager_logits).norm() / eager_logits.norm()).item()
    assert err < 1e-4, f"relative error {err:.2e}"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_piecewise_steps_give_the_eager_tokens(hybrid_folder: Path, overlap: bool) -> None:
    """Prompt and mixed steps replayed from piecewise graphs (each KV group's slots in the captured store, its
    window in the attention between the pieces, the last layer on the sampled rows) give the eager runner's
    tokens."""
    eager = _runner(hybrid_folder, "cuda")
    eager_tokens = tokens(drive(eager, _schedule(eager))[0])
    pieced = _runner(hybrid_folder, "cuda")
    assert pieced.capture_decode_graphs([1, 2, 4])
    # Three requests: every bucket keeps the sampled rows alone past the last attention (3, padded to 4).
    assert pieced.capture_piecewise_graphs(128, step=32, sampled_rows=3) == 4
    graphs = pieced._piecewise_graphs
    assert graphs is not None and graphs.tail_rows == 4
    replayed: list[int] = []
    run = graphs.run
    graphs.run = lambda *args, **kwargs: (replayed.append(1), run(*args, **kwargs))[1]  # type: ignore[method-assign]
    pieced.overlap_steps = overlap
    assert tokens(drive(pieced, _schedule(pieced))[0]) == eager_tokens
    assert replayed, "no step replayed the pieces"
