"""FP8 checkpoints in a tensor-parallel group on the CPU: e4m3 weights and their scales (block, per channel,
per tensor) are cut consistently for column- and row-parallel layers and for MoE experts (tensor-parallel
and expert-parallel), so TP=2 (two gloo rank processes) gives the logits of TP=1 on the same FP8 checkpoint;
each rank reads only its slices; a group size whose shards split a scale block is refused at startup with
the layer and sizes named.

The checkpoints are written here from tiny random bf16-style models with 16-wide blocks (the tiny models'
stand-in for 128: head_dim 16, so a KV head is one block)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ominix_worker.parallel import MoeParallel, TensorParallel
from ominix_worker.testing import write_fp8_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_tensor_parallel import run_group  # noqa: E402
from tp_logits import batch_logits, load_runner  # noqa: E402

BLOCK = 16


class _Group:  # stands in for a process group: shard arithmetic and loading never touch it
    pass


def tp(rank: int, size: int, moe: MoeParallel = MoeParallel.TENSOR) -> TensorParallel:
    return TensorParallel(rank, size, _Group(), moe)  # type: ignore[arg-type]  # a stand-in process group


CASES = [
    ("llama", "block", MoeParallel.TENSOR),
    ("llama", "channel", MoeParallel.TENSOR),
    ("llama", "tensor", MoeParallel.TENSOR),
    ("qwen3_moe", "block", MoeParallel.TENSOR),
    ("qwen3_moe", "block", MoeParallel.EXPERT),
    ("qwen3_moe", "channel", MoeParallel.TENSOR),
    ("qwen3_moe", "channel", MoeParallel.EXPERT),
    ("qwen3_moe", "tensor", MoeParallel.TENSOR),
]


@pytest.mark.parametrize(
    ("name", "granularity", "moe"), CASES, ids=[f"{n}-{g}-{m.value}" for n, g, m in CASES]
)
def test_tp2_fp8_logits_equal_tp1_fp8(
    name: str,
    granularity: str,
    moe: MoeParallel,
    tiny_model_dir: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    folder = write_fp8_checkpoint(tiny_model_dir(name), tmp_path / "fp8", granularity, block=BLOCK)
    single = load_runner(str(folder), "cpu", torch.float32)
    assert single.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    reference = batch_logits(single)
    sharded = run_group(folder, 2, tmp_path / "logits.pt", moe_parallel=moe.value)
    assert sharded.shape == reference.shape
    # Only the order of the sums differs (the all-reduces): float32 rounding.
    torch.testing.assert_close(sharded, reference, atol=5e-5, rtol=1e-5)
    assert torch.equal(sharded.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("moe", list(MoeParallel))
def test_each_rank_reads_only_its_fp8_slices_and_their_scales(
    moe: MoeParallel,
    tiny_model_dir: Callable[[str], Path],
    tmp_path: Path,
    safetensors_reads: dict[str, int],
) -> None:
    """Rank 1 of 2 on a block-scaled Qwen3-MoE checkpoint: half of every projection and of its scale, and
    of every expert's weights and scales (TENSOR) or experts 8..15 whole and 0..7 unread (EXPERT)."""
    from safetensors import safe_open

    folder = write_fp8_checkpoint(tiny_model_dir("qwen3_moe"), tmp_path / "fp8", "block", block=BLOCK)
    read_elements = safetensors_reads
    load_runner(str(folder), "cpu", torch.float32, tp(1, 2, moe))
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        full = {name: int(torch.tensor(f.get_slice(name).get_shape()).prod()) for name in f.keys()}  # noqa: SIM118
    projections = [n for n in full if n.endswith(("proj.weight", "proj.weight_scale_inv"))]
    assert any(n.endswith("weight_scale_inv") for n in projections)
    for name in projections:
        if ".mlp.experts." in name:
            expert = int(name.split(".mlp.experts.")[1].split(".")[0])
            if moe is MoeParallel.EXPERT:
                assert read_elements.get(name, 0) == (full[name] if expert >= 8 else 0), name
                continue
        assert read_elements[name] == full[name] // 2, name


def test_blocks_that_split_a_fused_part_on_one_worker_are_refused_without_blaming_a_group(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """24-wide blocks on one worker: k_proj starts inside a block of the fused qkv rows. The message names the
    layer and no tensor-parallel rank, which there is none of."""
    from ominix_runtime.models import resolve_model
    from ominix_worker.attention import get_attention_backend
    from ominix_worker.loader import ModelLoadError, load_model

    folder = write_fp8_checkpoint(tiny_model_dir("llama"), tmp_path / "fp8", "block", block=24)
    backend = get_attention_backend("cpu", 16)
    with pytest.raises(ModelLoadError) as refused:
        load_model(resolve_model(str(folder)), torch.device("cpu"), torch.float32, backend, tp=tp(0, 1))
    message = str(refused.value)
    assert "FP8 layer layers.0." in message and "the layer has" in message, message
    assert "rank" not in message and "per-channel checkpoint" in message, message


def test_a_group_size_that_splits_a_scale_block_is_refused_naming_the_layer(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """32-wide blocks over TP=2: each rank's KV head (16 rows) is half a block of k_proj."""
    from ominix_runtime.models import resolve_model
    from ominix_worker.attention import get_attention_backend
    from ominix_worker.loader import ModelLoadError, load_model

    folder = write_fp8_checkpoint(tiny_model_dir("llama"), tmp_path / "fp8", "block", block=32)
    backend = get_attention_backend("cpu", 16)
    with pytest.raises(ModelLoadError) as refused:
        load_model(resolve_model(str(folder)), torch.device("cpu"), torch.float32, backend, tp=tp(1, 2))
    message = str(refused.value)
    assert "FP8 layer layers.0.self_attn.qkv_proj" in message, message
    assert "rank 1 of 2 holds k_proj rows [16, 32) of 32" in message and "32-wide" in message, message
    # per-channel scales never split: the same model loads at TP=2
    channel = write_fp8_checkpoint(tiny_model_dir("llama"), tmp_path / "fp8c", "channel")
    load_model(resolve_model(str(channel)), torch.device("cpu"), torch.float32, backend, tp=tp(1, 2))


def test_expert_rows_that_split_a_scale_block_are_refused_naming_the_experts(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """Qwen3-MoE's experts (intermediate 32) with 32-wide blocks: tensor-parallel experts give each rank 16
    rows, half a block; expert parallelism keeps whole experts and loads."""
    from ominix_runtime.models import resolve_model
    from ominix_worker.attention import get_attention_backend
    from ominix_worker.loader import ModelLoadError, load_model
    from ominix_worker.testing import write_tiny_hf_model

    source = write_tiny_hf_model(
        tmp_path / "m", arch="qwen3_moe", num_layers=1, heads=2, kv_heads=2, hidden_size=64,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
        with_tokenizer=False,
    )  # fmt: skip
    folder = write_fp8_checkpoint(source, tmp_path / "fp8", "block", block=32)
    backend = get_attention_backend("cpu", 16)
    model = resolve_model(str(folder))
    with pytest.raises(
        ModelLoadError, match=r"FP8 experts layers\.0\.mlp\.experts: .*\[0, 16\) of 32.*--moe-parallel expert"
    ):
        load_model(model, torch.device("cpu"), torch.float32, backend, tp=tp(0, 2, MoeParallel.TENSOR))
    load_model(model, torch.device("cpu"), torch.float32, backend, tp=tp(0, 2, MoeParallel.EXPERT))
