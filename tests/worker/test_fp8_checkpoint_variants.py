"""FP8 checkpoints laid out as transformers 5 reads them, beyond every projection in e4m3:

- ``quantization_config.modules_to_not_convert`` (or its older key ``ignored_layers``) leaves modules in
  float. Entries are transformers' module names or patterns (``model.layers.0.self_attn``,
  ``model.layers.*.self_attn``, ``lm_head``, ``mlp.experts``), matched as ``should_convert_module`` matches
  them: a regular expression from the start of the name ending on a module boundary, or a plain suffix. Our
  fused layers (q/k/v, gate/up, every expert of a layer) stay float when all their parts are listed; a list
  that splits one is refused, naming the parts.
- MoE routers (``mlp.gate``) and Qwen2-MoE's ``shared_expert_gate`` stored in e4m3 with a scale, as
  transformers' FP8 quantizer writes them unless the list names them: dequantized to the model dtype on load.

Each checkpoint must give the logits transformers gives for its weights dequantized (``dequantized/``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.quantizers.quantizers_utils import should_convert_module

from ominix_worker.loader import ModelLoadError
from ominix_worker.models.moe import FusedExperts, SparseMoeBlock
from ominix_worker.quant.fp8 import Fp8Linear, dequantize_fp8, quantize_fp8_blocks
from ominix_worker.runner import ModelRunner, build_runner
from ominix_worker.testing import write_fp8_checkpoint

from .hf_match import assert_matches_transformers

BLOCK = 16


def _rewrite(folder: Path, edit: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], None]) -> None:
    """Apply ``edit`` to the checkpoint's tensors and to its dequantized copy's."""
    quantized = load_file(str(folder / "model.safetensors"))
    dequantized = load_file(str(folder / "dequantized" / "model.safetensors"))
    edit(quantized, dequantized)
    save_file(quantized, str(folder / "model.safetensors"))
    save_file(dequantized, str(folder / "dequantized" / "model.safetensors"))


def _set_quantization(folder: Path, **fields: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(fields)
    (folder / "config.json").write_text(json.dumps(config, indent=1))


def fp8_with_float_modules(
    source: Path, target: Path, is_float: Callable[[str], bool], listed: list[str], key: str
) -> Path:
    """A block-scaled FP8 checkpoint of ``source`` whose tensors named ``is_float`` keep their float weights
    (no scales), listed under ``quantization_config[key]`` as ``listed``."""
    folder = write_fp8_checkpoint(source, target, "block", block=BLOCK)
    original = load_file(str(source / "model.safetensors"))

    def keep_float(quantized: dict[str, torch.Tensor], dequantized: dict[str, torch.Tensor]) -> None:
        for name in list(quantized):
            if not is_float(name):
                continue
            if name.endswith(".weight_scale_inv"):
                del quantized[name]
            else:
                quantized[name] = dequantized[name] = original[name]

    _rewrite(folder, keep_float)
    _set_quantization(folder, **{key: listed})
    return folder


def fp8_layers(runner: ModelRunner) -> set[str]:
    """Names of the model's FP8 projections and experts."""
    return {
        name
        for name, module in runner.model.named_modules()
        if isinstance(module, Fp8Linear) or (isinstance(module, FusedExperts) and module.is_fp8)
    }


def quantizable_layers(runner: ModelRunner) -> set[str]:
    return {
        name
        for name, module in runner.model.named_modules()
        if isinstance(module, FusedExperts)
        or name.rsplit(".", 1)[-1] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    }


EXPERTS_OF_LAYER_2 = [
    f"model.layers.2.mlp.experts.{e}.{p}" for e in range(16) for p in ("gate_proj", "up_proj", "down_proj")
]

# (tiny model, tensors kept float, what the list says, our layers that must stay float)
SKIP_CASES = {
    "attention-by-module-prefix": (
        "llama",
        lambda n: n.startswith("model.layers.0.self_attn."),
        ["model.layers.0.self_attn"],
        {"layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj"},
    ),
    "attention-by-projection-names": (
        "llama",
        lambda n: n.startswith("model.layers.0.self_attn."),
        [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")],
        {"layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj"},
    ),
    "mlp-and-lm-head": (
        "llama",
        lambda n: n.startswith("model.layers.1.mlp."),
        ["lm_head", "model.layers.1.mlp"],
        {"layers.1.mlp.gate_up_proj", "layers.1.mlp.down_proj"},
    ),
    "every-layer-by-pattern": (
        "llama",
        lambda n: ".self_attn." in n,
        ["model.layers.*.self_attn"],
        {f"layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("qkv_proj", "o_proj")},
    ),
    "suffix": (
        "llama",
        lambda n: ".down_proj." in n,
        ["down_proj"],
        {"layers.0.mlp.down_proj", "layers.1.mlp.down_proj"},
    ),
    "moe-layer-by-prefix": (
        "qwen3_moe",
        lambda n: n.startswith("model.layers.0.mlp."),
        ["model.layers.0.mlp"],
        {"layers.0.mlp.experts"},
    ),
    "experts-by-suffix": (  # layers 0 and 2 are sparse, layer 1 dense (its MLP stays FP8)
        "qwen3_moe",
        lambda n: ".mlp.experts." in n,
        ["mlp.experts"],
        {"layers.0.mlp.experts", "layers.2.mlp.experts"},
    ),
    "every-expert-by-name": (
        "qwen3_moe",
        lambda n: n.startswith("model.layers.2.mlp.experts."),
        EXPERTS_OF_LAYER_2,
        {"layers.2.mlp.experts"},
    ),
    "mixtral-checkpoint-name": (  # renamed to model.layers.0.mlp first, as transformers renames it
        "mixtral",
        lambda n: n.startswith("model.layers.0.block_sparse_moe."),
        ["model.layers.0.block_sparse_moe"],
        {"layers.0.mlp.experts"},
    ),
    "shared-expert": (  # not shared_expert_gate: the entry ends on a module boundary
        "qwen2_moe",
        lambda n: n.startswith("model.layers.1.mlp.shared_expert."),
        ["model.layers.1.mlp.shared_expert"],
        {"layers.1.mlp.shared_expert.gate_up_proj", "layers.1.mlp.shared_expert.down_proj"},
    ),
}


@pytest.mark.parametrize("case", list(SKIP_CASES))
def test_modules_to_not_convert_as_transformers_matches_them(
    case: str, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    model, is_float, listed, float_layers = SKIP_CASES[case]
    key = "ignored_layers" if case == "attention-by-projection-names" else "modules_to_not_convert"
    folder = fp8_with_float_modules(tiny_model_dir(model), tmp_path / "fp8", is_float, listed, key)
    runner = assert_matches_transformers(folder, folder / "dequantized")
    assert fp8_layers(runner) == quantizable_layers(runner) - float_layers


@pytest.mark.parametrize(
    "entries",
    [
        ["model.layers.1"],
        ["model.layers.1."],
        ["layers.1"],
        ["layers.1.mlp"],
        ["model.layers.*.self_attn"],
        ["model.layers.1[01]"],
        ["mlp.gate"],
        ["gate"],
        ["proj"],
        ["experts"],
        ["q_proj|k_proj"],
        ["self_attn.q"],
        ["model"],
        [".*"],
        [""],
        ["lm_head", "model.layers.1.mlp", "model.layers.(10|11).self_attn"],
        ["(?P<g>model).layers.1[0-9]", "(?P<g>lm)_head"],  # tried one by one: the group name is repeated
        [r"(model)\.layers\.\d+\.mlp\.gate", r"(\w+)\.\1"],  # a back-reference: tried one by one
    ],
)
def test_entries_list_the_modules_transformers_leaves_unconverted(entries: list[str]) -> None:
    from ominix_worker.quant.fp8 import NotConverted

    names = [
        "lm_head",
        "model.embed_tokens",
        "model.layers.1.mlp.down_proj",
        "model.layers.11.mlp.down_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.10.self_attn.o_proj",
        "model.layers.1.mlp.experts",
        "model.layers.1.mlp.gate",
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.shared_expert_gate",
    ]
    skip = NotConverted(entries)
    assert [skip.lists(n) for n in names] == [not should_convert_module(n, entries) for n in names]


@pytest.mark.parametrize(
    ("model", "listed", "named"),
    [
        (
            "llama",
            ["model.layers.0.self_attn.q_proj"],
            [
                "model.layers.0.self_attn.q_proj",
                "model.layers.0.self_attn.k_proj",
                "layers.0.self_attn.qkv_proj",
            ],
        ),
        (
            "llama",
            ["up_proj"],
            ["model.layers.0.mlp.up_proj", "model.layers.0.mlp.gate_proj", "layers.0.mlp.gate_up_proj"],
        ),
        (
            "qwen3_moe",
            EXPERTS_OF_LAYER_2[:-1],
            [
                "model.layers.2.mlp.experts.0.gate_proj",
                "model.layers.2.mlp.experts.15.down_proj",
                "layers.2.mlp.experts",
            ],
        ),
    ],
    ids=["q-without-k-v", "up-without-gate", "all-experts-but-one-projection"],
)
def test_a_list_that_splits_a_fused_layer_is_refused_naming_the_parts(
    model: str, listed: list[str], named: list[str], tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = write_fp8_checkpoint(tiny_model_dir(model), tmp_path / "fp8", "block", block=BLOCK)
    _set_quantization(folder, modules_to_not_convert=listed)
    with pytest.raises(ModelLoadError, match="modules_to_not_convert") as refused:
        build_runner(str(folder), num_blocks=4)
    for name in named:
        assert name in str(refused.value)


@pytest.mark.parametrize(
    ("model", "float_prefix", "entry"),
    [
        ("llama", "model.layers.0.self_attn.", "layers.0.self_attn"),
        ("qwen3_moe", "model.layers.0.mlp.", "layers.0.mlp"),
    ],
    ids=["attention", "experts"],
)
def test_float_layers_the_list_does_not_name_are_refused(
    model: str, float_prefix: str, entry: str, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """An entry without the ``model.`` prefix names no layer for transformers (only the container module, by
    suffix), which would build those layers in FP8: their float weights are refused, not loaded unscaled."""
    layer = float_prefix + ("q_proj" if model == "llama" else "experts")
    assert should_convert_module(layer, [entry])  # transformers would build it in FP8
    folder = fp8_with_float_modules(
        tiny_model_dir(model),
        tmp_path / "fp8",
        lambda n: n.startswith(float_prefix),
        [entry],
        "modules_to_not_convert",
    )
    with pytest.raises(
        ModelLoadError, match="expected an FP8 weight, found torch.float32.*modules_to_not_convert"
    ):
        build_runner(str(folder), num_blocks=4)


def test_a_listed_layer_that_the_checkpoint_quantized_is_refused(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = write_fp8_checkpoint(tiny_model_dir("llama"), tmp_path / "fp8", "block", block=BLOCK)
    _set_quantization(folder, modules_to_not_convert=["model.layers.0.self_attn"])
    with pytest.raises(ModelLoadError, match=r"a scale for layers\.0\.self_attn\.\w+_proj, which is not FP8"):
        build_runner(str(folder), num_blocks=4)


def test_an_entry_that_is_no_pattern_is_refused(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = write_fp8_checkpoint(tiny_model_dir("llama"), tmp_path / "fp8", "block", block=BLOCK)
    _set_quantization(folder, modules_to_not_convert=["model.layers.(0"])
    with pytest.raises(ModelLoadError, match=r"'model.layers.\(0' is not a pattern"):
        build_runner(str(folder), num_blocks=4)


# ---- FP8 routers ---------------------------------------------------------------------------------------


def _quantize_routers(folder: Path, granularity: str) -> list[str]:
    """Store the checkpoint's routers and shared-expert gates in e4m3 with a scale in ``granularity``'s
    layout (the dequantized copy gets the values they stand for); returns their names."""
    routers: list[str] = []

    def quantize(quantized: dict[str, torch.Tensor], dequantized: dict[str, torch.Tensor]) -> None:
        for name in list(quantized):
            if not name.endswith(
                ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")
            ):
                continue
            rows, cols = quantized[name].shape
            tile = {"block": (BLOCK, BLOCK), "channel": (1, cols), "tensor": (rows, cols)}[granularity]
            q, scale = quantize_fp8_blocks(quantized[name], tile)
            base = name.removesuffix(".weight")
            quantized[name] = q
            if granularity == "block":
                quantized[f"{base}.weight_scale_inv"] = scale
            else:
                quantized[f"{base}.weight_scale"] = scale.reshape(()) if granularity == "tensor" else scale
            dequantized[name] = dequantize_fp8(q, scale, tile, torch.float32)
            routers.append(name)

    _rewrite(folder, quantize)
    return routers


@pytest.mark.parametrize(
    ("model", "granularity"),
    [("qwen3_moe", "block"), ("mixtral", "block"), ("qwen2_moe", "channel"), ("qwen2_moe", "tensor")],
)
def test_fp8_routers_are_dequantized_to_the_model_dtype(
    model: str, granularity: str, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = write_fp8_checkpoint(tiny_model_dir(model), tmp_path / "fp8", granularity, block=BLOCK)
    routers = _quantize_routers(folder, granularity)
    assert routers
    runner = assert_matches_transformers(folder, folder / "dequantized")
    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]
    gates = [b.gate for b in blocks] + [
        b.shared_expert_gate for b in blocks if b.shared_expert_gate is not None
    ]
    assert len(gates) == len(routers)
    for gate in gates:  # in the run dtype; their values are checked through the logits
        assert not isinstance(gate, Fp8Linear)
        assert gate.weight.dtype == torch.float32


def test_an_fp8_router_without_its_scale_is_refused(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = write_fp8_checkpoint(tiny_model_dir("qwen3_moe"), tmp_path / "fp8", "block", block=BLOCK)
    _quantize_routers(folder, "block")
    _rewrite(folder, lambda q, _: q.pop("model.layers.2.mlp.gate.weight_scale_inv"))
    with pytest.raises(
        ModelLoadError, match=r"model\.layers\.2\.mlp\.gate\.weight: an FP8 router weight without"
    ):
        build_runner(str(folder), num_blocks=4)
