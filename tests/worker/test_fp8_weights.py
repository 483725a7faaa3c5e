"""FP8 weights on the CPU reference path (dequantized per call): checkpoints written here from tiny random
models in the three scale layouts FP8 checkpoints ship (128-style blocks, per channel, per tensor), for dense
and MoE models, and ``--quantization fp8`` of a float checkpoint at load.

An FP8 checkpoint must give the logits of the same weights dequantized (transformers on the dequantized copy,
1e-4); against the original float weights the logits differ by the FP8 rounding: 8-14% relative (Frobenius
norm over four positions) measured on these random models (e4m3 keeps 3 mantissa bits), bounded at 20% here; a
misplaced or missing scale gives errors of order 100%."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData, SamplingParams
from ominix_worker.loader import ModelLoadError
from ominix_worker.models.moe import FusedExperts, SparseMoeBlock
from ominix_worker.parallel import RowParallelLinear
from ominix_worker.quant.fp8 import Fp8Linear, Fp8RowParallelLinear
from ominix_worker.runner import build_runner
from ominix_worker.testing import write_fp8_checkpoint

EXACT_TOL = 1e-4
FP8_TOL = 0.2
PROMPT = [(7 * i + 3) % 317 + 3 for i in range(21)]


def _runner_logits(
    folder: Path, quantization: str | None = None, dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor], list[int]]:
    """Logits of a 21-token prefill and three decode steps, and the sequence they were computed on."""
    runner = build_runner(str(folder), num_blocks=16, quantization=quantization, dtype=dtype)
    rows: list[torch.Tensor] = []
    compute = runner.model.compute_logits
    runner.model.compute_logits = lambda h: rows.append(compute(h)) or rows[-1]  # type: ignore[method-assign]  # records the logits
    greedy = SamplingParams(temperature=0.0)
    tokens = list(PROMPT)
    result = runner.execute_step(
        DecodeStep(1, new_requests=[NewRequestData("a", tokens, greedy, [5, 2], 0, len(tokens), 1)])
    )
    for step_id in range(2, 5):
        tokens.append(result.outputs[0].sampled_token_id)
        result = runner.execute_step(DecodeStep(step_id, running_requests=[RunningRequestData("a", [], 1)]))
    assert all(isinstance(m, Fp8Linear) for m in (runner.model.layers[0].self_attn.qkv_proj,))
    experts = [m for m in runner.model.modules() if isinstance(m, FusedExperts)]
    assert all(e.w13_weight.dtype == torch.float8_e4m3fn for e in experts)
    routers = [m.gate for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert all(not isinstance(r, Fp8Linear) for r in routers)  # routing stays in the run dtype
    return [r[0] for r in rows], tokens


def _reference(folder: Path, tokens: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, len(PROMPT) - 1 :]


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _fro_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    ("model", "granularity"),
    [
        ("qwen3", "block"),
        ("qwen3_moe", "block"),
        ("qwen3_moe", "channel"),
        ("qwen3_moe", "tensor"),
        ("mixtral", "block"),
        ("qwen2_moe", "channel"),
    ],
)
def test_fp8_checkpoint_matches_its_dequantized_weights(
    model: str, granularity: str, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    source = tiny_model_dir(model)
    folder = write_fp8_checkpoint(source, tmp_path / "fp8", granularity, block=16)
    ours, tokens = _runner_logits(folder)
    exact = _reference(folder / "dequantized", tokens)
    for i, row in enumerate(ours):
        assert _max_rel(row, exact[i]) < EXACT_TOL, f"position {i}"
    original = _reference(source, tokens)
    assert _fro_rel(torch.stack(ours), original) < FP8_TOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("granularity", ["block", "channel", "tensor"])
def test_fp8_checkpoint_in_half_precision_on_cpu(
    granularity: str, dtype: torch.dtype, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """An FP8 checkpoint run in float16 / bfloat16 (dequantized to the run dtype per call) stays within 5% of
    its dequantized weights in float32, in every scale layout."""
    folder = write_fp8_checkpoint(tiny_model_dir("llama"), tmp_path / "fp8", granularity, block=16)
    ours, tokens = _runner_logits(folder, dtype=dtype)
    exact = _reference(folder / "dequantized", tokens)
    for i, row in enumerate(ours):
        assert _max_rel(row, exact[i]) < 5e-2, f"position {i}"


@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe"])
def test_quantization_fp8_at_load_stays_close_to_the_float_model(
    model: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    source = tiny_model_dir(model)
    ours, tokens = _runner_logits(source, quantization="fp8")
    assert _fro_rel(torch.stack(ours), _reference(source, tokens)) < FP8_TOL


def test_a_checkpoint_missing_scales_or_with_unknown_quantization_is_refused(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    import json

    from safetensors.torch import load_file, save_file

    folder = write_fp8_checkpoint(tiny_model_dir("qwen3_moe"), tmp_path / "fp8", "block", block=16)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"]
    del tensors["model.layers.1.self_attn.k_proj.weight_scale_inv"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="lacks 2 weights") as missing:
        build_runner(str(folder), num_blocks=4)
    assert "layers.0.mlp.experts.w2_scale#3" in str(missing.value)
    assert "layers.1.self_attn.qkv_proj.weight_scale_inv#1" in str(missing.value)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="not supported"):
        build_runner(str(folder), num_blocks=4)
    with pytest.raises(ModelLoadError, match="unknown quantization"):
        build_runner(str(tiny_model_dir("qwen3")), num_blocks=4, quantization="int4")


@pytest.mark.parametrize("reduce", [True, False])
@pytest.mark.parametrize("block", [None, (32, 32)], ids=["per-channel", "block"])
def test_gated_down_projection_is_forward_of_the_product(reduce: bool, block: tuple[int, int] | None) -> None:
    """``forward_gated`` on [gate | up] is ``forward`` on the product the given ``silu_and_mul`` computes, for the
    float layer and its FP8 form (on the CPU the FP8 layer dequantizes; CUDA folds the product into the
    activation quantization, tests/gpu/test_fp8_gemm.py)."""
    gen = torch.Generator().manual_seed(3)
    linear = RowParallelLinear(64, 48, bias=False, reduce=reduce)
    with torch.no_grad():
        linear.weight.copy_(torch.randn((48, 64), generator=gen) / 8)
    gate_up = torch.randn((5, 128), generator=gen)

    def product(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    for layer in (linear, Fp8RowParallelLinear.from_linear(linear, block)):
        with torch.no_grad():
            got = layer.forward_gated(gate_up, product)
            torch.testing.assert_close(got, layer(product(gate_up)), rtol=0, atol=0)
        assert got.shape == (5, 48)
