"""The last layer past its attention runs only on the rows the step samples (``models.llama.last_layer_rows``),
on the CPU, for each layer structure: the dense Llama decoder, an MoE one (Qwen3-MoE), Gemma 3 (its own layers
and forward), gpt-oss (sink attention, MoE) and the compressed-attention decoder (its own attention). Each model
gives the full forward's rows for any kept indices (repeats, any order), its last layer's MLP sees only the kept
rows while the layer before sees every token, and every layer still stores every token's K and V. A step that
samples nothing keeps one row."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ominix_runtime.contract import SamplingParams
from ominix_worker.runner import CachedRequest, ModelRunner, ScheduledRow, build_runner
from ominix_worker.testing import write_tiny_hf_model

from .test_gpt_oss_vs_hf import GPT_OSS

COMPRESSED = Path(__file__).resolve().parents[2] / "bench" / "configs" / "compressed-tiny-config.json"
BS = 4
NUM_BLOCKS = 64
PROMPTS = (13, 9, 6)  # tokens per request; each gets 8 blocks of its own in every KV group

MODELS = ("llama", "qwen3_moe", "gemma3", "gpt_oss", "compressed")


@pytest.fixture(scope="module", params=MODELS)
def runner(
    request: pytest.FixtureRequest,
    tiny_model_dir: Callable[[str], Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> ModelRunner:
    name = request.param
    if name == "compressed":
        source = f"dummy:{COMPRESSED}"
    elif name == "gemma3":
        folder = tmp_path_factory.mktemp("gemma3")
        source = str(write_tiny_hf_model(folder, arch="gemma3_text", num_layers=3, sliding_window=8, seed=4))
    elif name == "gpt_oss":
        source = str(write_tiny_hf_model(tmp_path_factory.mktemp("gpt_oss"), **GPT_OSS))  # type: ignore[arg-type]
    else:
        source = str(tiny_model_dir(name))
    return build_runner(source, num_blocks=NUM_BLOCKS, block_size=BS)


def _rows(runner: ModelRunner, samples: bool) -> list[ScheduledRow]:
    gen = torch.Generator().manual_seed(1)
    rows = []
    for i, length in enumerate(PROMPTS):
        prompt = torch.randint(3, runner.vocab_size, (length,), generator=gen).tolist()
        tables = [list(range(8 * i + 1, 8 * i + 9)) for _ in runner.attention_groups]
        request = CachedRequest(f"r{i}", prompt, [], SamplingParams(temperature=0.0), tables, 0, 0)
        rows.append(ScheduledRow(request, 0, length, samples=samples))
    return rows


@contextlib.contextmanager
def _mlp_rows(runner: ModelRunner) -> Iterator[tuple[list[int], list[int]]]:
    """Rows the MLPs of the layer before the last and of the last layer see, per call, while open."""
    before: list[int] = []
    last: list[int] = []
    layers = runner.model.layers
    handles = [
        layer.mlp.register_forward_hook(  # type: ignore[union-attr]  # every decoder layer holds its MLP there
            lambda _module, args, _out, seen=seen: seen.append(int(args[0].shape[0]))
        )
        for layer, seen in ((layers[-2], before), (layers[-1], last))
    ]
    try:
        yield before, last
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def test_kept_rows_are_the_full_forwards_rows(runner: ModelRunner) -> None:
    inputs = runner._prepare_inputs(_rows(runner, samples=True))
    model = runner.model
    for kv in runner.kv_caches:
        kv.zero_()
    full = model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.metas)
    kv_full = [kv.clone() for kv in runner.kv_caches]
    for kv in runner.kv_caches:  # the kept forward must store every K and V itself
        kv.zero_()
    keep = torch.tensor([20, 0, 12, 12, 27, 5])
    with _mlp_rows(runner) as (before, last):
        kept = model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.metas, keep)
    assert kept.shape == (len(keep), full.shape[1])
    torch.testing.assert_close(kept, full.index_select(0, keep), rtol=1e-5, atol=1e-5)
    assert before == [sum(PROMPTS)] and last == [len(keep)]
    for layer, (written, again) in enumerate(zip(kv_full, runner.kv_caches, strict=True)):
        assert torch.equal(written, again), f"KV tensor {layer} differs when rows are kept"


@torch.inference_mode()
def test_a_step_keeps_its_sampled_rows_or_one(runner: ModelRunner) -> None:
    rows = _rows(runner, samples=True)
    inputs = runner._prepare_inputs(rows)
    full = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.metas)
    ends = torch.tensor(PROMPTS).cumsum(0) - 1  # each prompt's last token: the sampled rows
    assert inputs.logits_indices[: len(PROMPTS)].tolist() == ends.tolist()
    hidden = runner._forward(inputs)
    torch.testing.assert_close(hidden[: len(PROMPTS)], full.index_select(0, ends), rtol=1e-5, atol=1e-5)
    sampled = runner._sample(hidden, inputs)
    assert sampled is not None
    expected = runner.model.compute_logits(full.index_select(0, ends)).argmax(-1)
    assert sampled.token_ids[: len(PROMPTS)].tolist() == expected.tolist()
    chunk = runner._prepare_inputs(_rows(runner, samples=False))
    assert chunk.sampling is None and chunk.logits_indices.shape[0] == 0
    assert runner._forward(chunk).shape == (1, full.shape[1])
