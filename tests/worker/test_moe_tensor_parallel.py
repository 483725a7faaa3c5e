"""Mixture-of-experts layers in a tensor-parallel group on the CPU: tensor-parallel experts (a slice of every
expert per rank) and expert parallelism (whole experts per rank) give TP=1's logits at TP=2 (two gloo rank
processes), each rank reads only its share of the checkpoint, and dummy experts are the same model at any
split."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ominix_worker.parallel import MoeParallel, ShardRange, TensorParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from refused_ranks import refusal_lines  # noqa: E402
from test_tensor_parallel import run_group  # noqa: E402
from tp_logits import batch_logits, load_runner  # noqa: E402


class _Group:  # stands in for a process group: shard arithmetic and loading never touch it
    pass


def tp(rank: int, size: int, moe: MoeParallel) -> TensorParallel:
    return TensorParallel(rank, size, _Group(), moe)  # type: ignore[arg-type]  # a stand-in process group


# ---- shard arithmetic --------------------------------------------------------------------------------


def test_experts_and_their_rows_split_by_mode() -> None:
    assert [tp(r, 4, MoeParallel.EXPERT).experts(16) for r in range(4)] == [
        ShardRange(4 * r, 4) for r in range(4)
    ]
    assert tp(1, 4, MoeParallel.EXPERT).expert_intermediate(32) == ShardRange(0, 32)
    assert tp(1, 4, MoeParallel.TENSOR).experts(16) == ShardRange(0, 16)
    assert tp(1, 4, MoeParallel.TENSOR).expert_intermediate(32) == ShardRange(8, 8)
    with pytest.raises(ValueError, match="6 experts do not divide into 4 ranks for expert parallelism"):
        tp(0, 4, MoeParallel.EXPERT).experts(6)


def test_experts_that_do_not_divide_refuse_to_load_with_the_reason(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    from ominix_runtime.models import resolve_model
    from ominix_worker.attention import get_attention_backend
    from ominix_worker.loader import ModelLoadError, load_model

    backend = get_attention_backend("cpu", 16)
    source = resolve_model(str(tiny_model_dir("mixtral")))  # 4 experts, 4 heads, 2 KV heads
    with pytest.raises(ModelLoadError, match="4 experts do not divide into 8 ranks"):
        load_model(source, torch.device("cpu"), torch.float32, backend, tp=tp(0, 8, MoeParallel.EXPERT))


# ---- TP=2 against TP=1 --------------------------------------------------------------------------------

CASES = [
    ("qwen3_moe", MoeParallel.TENSOR),
    ("qwen3_moe", MoeParallel.EXPERT),
    ("qwen2_moe", MoeParallel.TENSOR),  # the shared expert split like the dense MLP, one reduction
    ("qwen2_moe", MoeParallel.EXPERT),
]


@pytest.mark.parametrize(("name", "moe"), CASES, ids=[f"{n}-{m.value}" for n, m in CASES])
def test_tp2_moe_logits_equal_tp1(
    name: str, moe: MoeParallel, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = tiny_model_dir(name)
    reference = batch_logits(load_runner(str(folder), "cpu", torch.float32))
    sharded = run_group(folder, 2, tmp_path / "logits.pt", moe_parallel=moe.value)
    assert sharded.shape == reference.shape
    torch.testing.assert_close(sharded, reference, atol=2e-5, rtol=1e-5)
    assert torch.equal(sharded.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("moe", list(MoeParallel))
def test_tp2_dummy_weights_are_the_tp1_model(
    moe: MoeParallel, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """dummy:CONFIG draws every sharded weight whole and keeps the rank's cut (experts per global id)."""
    model = f"dummy:{tiny_model_dir('qwen2_moe') / 'config.json'}"
    reference = batch_logits(load_runner(model, "cpu", torch.float32))
    sharded = run_group(Path(model), 2, tmp_path / "logits.pt", moe_parallel=moe.value)
    torch.testing.assert_close(sharded, reference, atol=2e-5, rtol=1e-5)


# ---- what each rank reads ----------------------------------------------------------------------------


@pytest.mark.parametrize("moe", list(MoeParallel))
def test_each_rank_reads_only_its_experts_or_their_slices(
    moe: MoeParallel, tiny_model_dir: Callable[[str], Path], safetensors_reads: dict[str, int]
) -> None:
    """Rank 1 of 2: under TENSOR half of every expert tensor; under EXPERT experts 4..7 whole, 0..3 unread."""
    from safetensors import safe_open

    read_elements = safetensors_reads
    folder = tiny_model_dir("qwen2_moe")  # 8 experts
    runner = load_runner(str(folder), "cpu", torch.float32, tp(1, 2, moe))
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        full = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118
    experts = [name for name in full if ".mlp.experts." in name]
    assert experts
    for name in experts:
        numel = int(torch.tensor(full[name]).prod())
        expert = int(name.split(".mlp.experts.")[1].split(".")[0])
        if moe is MoeParallel.TENSOR:
            assert read_elements[name] == numel // 2, name
        elif expert >= 4:
            assert read_elements[name] == numel, name
        else:
            assert name not in read_elements, name
    for name in full:  # router and shared-expert gate replicated, shared expert split like the dense MLP
        if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            assert read_elements[name] == int(torch.tensor(full[name]).prod()), name
        elif ".shared_expert." in name:
            assert read_elements[name] == int(torch.tensor(full[name]).prod()) // 2, name
    block = runner.model.layers[0].mlp
    assert block.experts.num_experts == (8 if moe is MoeParallel.TENSOR else 4)


# ---- dummy weights -------------------------------------------------------------------------------------


@pytest.mark.parametrize("moe", list(MoeParallel))
def test_dummy_experts_are_slices_of_the_single_rank_model(moe: MoeParallel) -> None:
    from ominix_worker.models.moe import FusedExperts

    whole = FusedExperts(8, 16, 12)
    whole.init_dummy_weights(seed=3)
    gate, up = whole.w13_weight.detach().split(12, dim=1)
    for rank in range(2):
        part = FusedExperts(8, 16, 12, tp(rank, 2, moe))
        part.init_dummy_weights(seed=3)
        experts = part.expert_range
        rows = part.intermediate_range
        e = slice(experts.start, experts.end)
        expected_w13 = torch.cat((gate[e, rows.start : rows.end], up[e, rows.start : rows.end]), dim=1)
        torch.testing.assert_close(part.w13_weight.detach(), expected_w13, atol=0, rtol=0)
        torch.testing.assert_close(
            part.w2_weight.detach(), whole.w2_weight.detach()[e, :, rows.start : rows.end], atol=0, rtol=0
        )


def test_a_group_whose_experts_do_not_divide_exits_at_startup_with_the_reason(tmp_path: Path) -> None:
    """Two real worker ranks (--moe-parallel expert, 3 experts over 2 ranks): both exit with one clear line."""
    from ominix_worker.testing import write_tiny_hf_model

    folder = write_tiny_hf_model(
        tmp_path / "m", arch="qwen3_moe", num_experts=3, num_experts_per_tok=2, moe_intermediate_size=32,
        with_tokenizer=False,
    )  # fmt: skip
    expert = ["--moe-parallel", "expert"]
    for line in refusal_lines(folder, {0: expert, 1: expert}):
        assert "3 experts do not divide into 2 ranks" in line
