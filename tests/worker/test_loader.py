"""Config parsing (per-architecture defaults, sliding-window layers, rope scaling), GGUF loading (row order,
tied output, metadata), damaged or unsupported checkpoints, dummy weights, devices and sizes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from ominix_runtime.byte_sizes import parse_bytes
from ominix_runtime.contract import DecodeStep, NewRequestData, SamplingParams
from ominix_runtime.models import resolve_model
from ominix_worker.attention import TorchReferenceAttention, get_attention_backend
from ominix_worker.config import (
    SUPPORTED_ARCHES,
    ModelConfigError,
    config_from_gguf_fields,
    config_from_hf_dict,
    load_hf_config,
)
from ominix_worker.devices import DeviceError, cpu_has_native_bf16, parse_device, resolve_dtype, sm_count
from ominix_worker.kv_cache import kv_bytes_per_block
from ominix_worker.loader import ModelLoadError, load_model, unpermute_llama_cpp_rows
from ominix_worker.models.llama import rope_inv_freq
from ominix_worker.runner import ModelRunner, build_runner
from ominix_worker.testing import write_tiny_hf_model

from .conftest import LLAMA31_ROPE


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes for Q/K: per head, halves interleaved."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_unpermute_inverts_llama_cpp_row_order() -> None:
    weight = np.arange(8 * 2 * 3, dtype=np.float32).reshape(16, 3)  # 2 heads of dim 8
    restored = unpermute_llama_cpp_rows(torch.from_numpy(llama_cpp_permute(weight, 2)), 2)
    assert torch.equal(restored, torch.from_numpy(weight))


def write_gguf(folder: Path, out: Path) -> None:
    """A float32 GGUF of a tiny HF llama model, laid out as llama.cpp's converter does (tied: no output)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type", "default") == "llama3":
        # What llama.cpp's converter stores for Llama 3.1: one divisor per rotary frequency.
        base = config_from_hf_dict({**config, "rope_parameters": {"rope_theta": rope["rope_theta"]}})
        scaled = config_from_hf_dict(config)
        factors = rope_inv_freq(base)[0] / rope_inv_freq(scaled)[0]
        writer.add_tensor("rope_freqs.weight", factors.numpy().astype(np.float32))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for name, tensor in tensors.items():
        array = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", array)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", array)
        elif name == "lm_head.weight":
            writer.add_tensor("output.weight", array)
        elif name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, _, kind = rest.rpartition(".")
            if module == "self_attn.q_proj":
                array = llama_cpp_permute(array, heads)
            elif module == "self_attn.k_proj":
                array = llama_cpp_permute(array, kv_heads)
            writer.add_tensor(f"blk.{layer}.{names[module]}.{kind}", np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def last_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """The logits of the prompt's last position, one prefill step (each KV group its own blocks)."""
    captured: list[torch.Tensor] = []
    compute = runner.model.compute_logits
    runner.model.compute_logits = lambda h: captured.append(compute(h)) or captured[-1]  # type: ignore[method-assign]  # records the logits
    n = -(-len(tokens) // runner.block_size)
    tables = [list(range(g * n, (g + 1) * n)) for g in range(len(runner.attention_groups))]
    greedy = SamplingParams(temperature=0.0)
    runner.execute_step(
        DecodeStep(
            1,
            new_requests=[
                NewRequestData(
                    "g", tokens, greedy, tables[0], 0, len(tokens), 0, group_kv_block_ids=tables[1:]
                )
            ],
        )
    )
    runner.reset()
    return captured[0][0]


@pytest.mark.parametrize("variant", ["tied", "llama31-untied"])
def test_gguf_file_loads_like_its_hf_source(tmp_path: Path, variant: str) -> None:
    tied = variant == "tied"
    extra = {} if tied else {"rope_parameters": LLAMA31_ROPE}
    folder = write_tiny_hf_model(
        tmp_path / "hf",
        arch="llama",
        tie_word_embeddings=tied,
        with_tokenizer=False,
        vocab_size=96,
        seed=5,
        **extra,
    )
    write_gguf(folder, tmp_path / "tiny.gguf")
    runner = build_runner(str(tmp_path / "tiny.gguf"), num_blocks=4)
    assert runner.config.tie_word_embeddings == tied and runner.config.eos_token_ids == (2,)
    assert (runner.config.rope_scaling.get("rope_type") == "freq_factors") == (not tied)
    assert runner.config.bos_token_id == 1 and runner.config.num_kv_heads == 2
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = list(range(3, 31))
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0, -1]
    got = last_logits(runner, tokens)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


def test_hf_config_variants(tmp_path: Path) -> None:
    old_style = {
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "eos_token_id": [2, 7],
    }
    config = config_from_hf_dict(old_style)
    assert config.num_kv_heads == 4 and config.head_dim == 16 and config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0} and config.eos_token_ids == (2, 7)
    qwen2 = config_from_hf_dict({**old_style, "model_type": "qwen2", "rope_scaling": None})
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.rope_scaling == {}
    assert config_from_hf_dict({**old_style, "model_type": "qwen3"}).qk_norm
    mistral = config_from_hf_dict(
        {**old_style, "model_type": "mistral", "max_position_embeddings": 32768, "sliding_window": 4096}
    )
    assert mistral.max_position_embeddings == 32768 and mistral.sliding_window == 4096
    # Full attention equals the window only inside it: a backend without windows caps the context there.
    assert mistral.max_len_for(False) == 4096 and mistral.max_len_for(True) == 32768
    for bad, message in [({"hidden_act": "gelu"}, "hidden_act"), ({"mlp_bias": True}, "mlp_bias")]:
        with pytest.raises(ModelConfigError, match=message):
            config_from_hf_dict({**old_style, **bad})
    with pytest.raises(ModelConfigError, match="unsupported model_type 'gpt2'"):
        config_from_hf_dict({"model_type": "gpt2"})
    with pytest.raises(ModelConfigError, match="intermediate_size"):
        config_from_hf_dict({k: v for k, v in old_style.items() if k != "intermediate_size"})
    (tmp_path / "config.json").write_text(json.dumps(old_style))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert load_hf_config(tmp_path).eos_token_ids == (2, 7, 9)


# A config.json with only the fields transformers cannot default (and the MoE shape).
_MINIMAL_CONFIG = dict(
    vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
)  # fmt: skip


def hf_layer_windows(hf: transformers.PretrainedConfig) -> list[int]:
    """The window each layer of a transformers config attends within (0: full attention)."""
    window = getattr(hf, "sliding_window", None) or 0
    kinds = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
    return [window if kind == "sliding_attention" else 0 for kind in kinds]


@pytest.mark.parametrize(
    "model_type", [a for a in SUPPORTED_ARCHES if a not in ("gemma3", "gemma3_text", "llama_compressed")]
)
def test_omitted_fields_take_the_architectures_defaults(model_type: str) -> None:
    """Fields a config.json leaves out take the defaults of the architecture's own transformers class (Mixtral's
    rms_norm_eps and rope base, gpt-oss's YaRN rope, window and attention biases, the Qwen context and KV
    heads), not Llama's: shape, norm epsilon, rope, context, per-layer windows and q/o biases all agree."""
    hf = transformers.AutoConfig.for_model(model_type, **_MINIMAL_CONFIG)
    ours = config_from_hf_dict({"model_type": model_type, **_MINIMAL_CONFIG})
    with torch.device("meta"):
        attention = transformers.AutoModelForCausalLM.from_config(hf).model.layers[0].self_attn
    hf_rope = {k: v for k, v in hf.rope_parameters.items() if k != "rope_theta"}
    got = dict(
        kv_heads=ours.num_kv_heads,
        head_dim=ours.head_dim,
        rms_norm_eps=ours.rms_norm_eps,
        rope_theta=ours.rope_theta,
        rope=ours.rope_scaling or {"rope_type": "default"},
        max_positions=ours.max_position_embeddings,
        windows=[ours.layer_window(i) for i in range(ours.num_layers)],
        qkv_bias=ours.qkv_bias,
        o_bias=ours.o_proj_bias,
    )
    want = dict(
        kv_heads=hf.num_key_value_heads,
        head_dim=attention.head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        rope_theta=hf.rope_parameters["rope_theta"],
        rope=hf_rope,
        max_positions=hf.max_position_embeddings,
        windows=hf_layer_windows(hf),
        qkv_bias=attention.q_proj.bias is not None,
        o_bias=attention.o_proj.bias is not None,
    )
    assert got == want


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "qwen2_moe", "qwen3_moe"])
def test_windowed_layers_without_layer_types_follow_transformers(model_type: str) -> None:
    """A Qwen config.json with use_sliding_window and no layer_types (as written before transformers 4.53,
    e.g. Qwen2.5's) windows the layers its transformers class does (Qwen2/Qwen3: from max_window_layers on),
    not every layer."""
    raw = dict(
        _MINIMAL_CONFIG, model_type=model_type, num_hidden_layers=6, num_key_value_heads=2,
        use_sliding_window=True, sliding_window=8, max_window_layers=3,
    )  # fmt: skip
    hf = transformers.AutoConfig.for_model(**raw)
    ours = config_from_hf_dict(raw)
    assert [ours.layer_window(i) for i in range(6)] == hf_layer_windows(hf)
    if model_type in ("qwen2", "qwen3"):
        assert hf_layer_windows(hf) == [0, 0, 0, 8, 8, 8]  # the reference itself: not every layer


@pytest.mark.parametrize(
    ("rope", "arch"),
    [
        ({"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}, "qwen3"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}, "llama"),
    ],
    ids=["yarn", "llama3"],
)
def test_rope_without_original_max_positions_loads_like_transformers(
    tmp_path: Path, rope: dict[str, object], arch: str
) -> None:
    """YaRN and Llama 3 rope without original_max_position_embeddings (as a hand-written config states it) take
    max_position_embeddings there, as transformers does, and give its logits."""
    folder = write_tiny_hf_model(
        tmp_path, arch=arch, with_tokenizer=False, vocab_size=96, max_position_embeddings=64,
        rope_parameters=rope,
    )  # fmt: skip
    config = json.loads((folder / "config.json").read_text())
    del config["rope_parameters"]["original_max_position_embeddings"]  # transformers wrote it back
    (folder / "config.json").write_text(json.dumps(config))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = list(range(3, 33))
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0, -1]
    got = last_logits(build_runner(str(folder), num_blocks=4), tokens)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


def test_an_unsupported_rope_type_is_refused_before_weights_are_read(
    tmp_path: Path, safetensors_reads: dict[str, int]
) -> None:
    """A rope type the model does not compute (dynamic NTK) is a ModelLoadError naming it, raised before any
    weight is read rather than from the rope tables built after loading."""
    folder = write_tiny_hf_model(
        tmp_path, arch="llama", with_tokenizer=False, vocab_size=96,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )  # fmt: skip
    with pytest.raises(ModelLoadError, match="unsupported rope_type 'dynamic'"):
        load_model(resolve_model(str(folder)), torch.device("cpu"), torch.float32, TorchReferenceAttention())
    assert safetensors_reads == {}


def test_gguf_rope_scaling_is_read_or_refused() -> None:
    """GGUF rope.scaling metadata: YaRN (factor, original_context_length, betas) reads as the config.json
    stating it would, linear and none as before; a type or YaRN parameter with no counterpart here is refused
    by name instead of dropped (plain rope: wrong logits everywhere)."""
    fields: dict[str, object] = {
        "general.architecture": "qwen2",
        "qwen2.embedding_length": 64,
        "qwen2.attention.head_count": 4,
        "qwen2.attention.head_count_kv": 2,
        "qwen2.block_count": 2,
        "qwen2.feed_forward_length": 128,
        "qwen2.context_length": 131072,
        "qwen2.vocab_size": 96,
        "qwen2.rope.freq_base": 1000000.0,
        "qwen2.rope.scaling.type": "yarn",
        "qwen2.rope.scaling.factor": 4.0,
        "qwen2.rope.scaling.original_context_length": 32768,
    }
    hf_yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    hf = config_from_hf_dict(
        {**_MINIMAL_CONFIG, "model_type": "qwen2", "max_position_embeddings": 131072, "rope_scaling": hf_yarn}
    )
    assert config_from_gguf_fields(fields).rope_scaling == hf.rope_scaling == hf_yarn
    betas = {"qwen2.rope.scaling.yarn_beta_fast": 16.0, "qwen2.rope.scaling.yarn_beta_slow": 2.0}
    with_betas = {**hf_yarn, "beta_fast": 16.0, "beta_slow": 2.0}
    assert config_from_gguf_fields({**fields, **betas}).rope_scaling == with_betas
    no_original = {k: v for k, v in fields.items() if not k.endswith("original_context_length")}
    assert config_from_gguf_fields(no_original).rope_scaling["original_max_position_embeddings"] == 131072
    linear = {**fields, "qwen2.rope.scaling.type": "linear"}
    assert config_from_gguf_fields(linear).rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config_from_gguf_fields({**fields, "qwen2.rope.scaling.type": "none"}).rope_scaling == {}
    with pytest.raises(ModelConfigError, match="'longrope'"):
        config_from_gguf_fields({**fields, "qwen2.rope.scaling.type": "longrope"})
    with pytest.raises(ModelConfigError, match="yarn_log_multiplier"):
        config_from_gguf_fields({**fields, "qwen2.rope.scaling.yarn_log_multiplier": 0.1})


def test_a_truncated_safetensors_file_is_refused_naming_it(tmp_path: Path) -> None:
    """A safetensors file cut short (an interrupted download) is a ModelLoadError naming the file, not a raw
    safetensors exception."""
    folder = write_tiny_hf_model(tmp_path, arch="llama", with_tokenizer=False, vocab_size=96)
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(resolve_model(str(folder)), torch.device("cpu"), torch.float32, TorchReferenceAttention())


# One tiny model per decoder family (dense, tied, MoE, Gemma 3's hybrid layers, gpt-oss's sinks and biases).
_FAMILIES: dict[str, dict[str, object]] = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2", tie_word_embeddings=True),
    "qwen3_moe": dict(arch="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    "gemma3": dict(arch="gemma3_text", num_layers=4, sliding_window=8, sliding_window_pattern=2),
    "gpt_oss": dict(
        arch="gpt_oss", intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=8
    ),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("family", list(_FAMILIES))
def test_half_precision_on_cpu_stays_close_to_float32_transformers(
    tmp_path: Path, family: str, dtype: torch.dtype
) -> None:
    """--dtype float16 / bfloat16 on the CPU gives finite logits within 5% of transformers in float32, for every
    decoder family (the run dtype reaches norms, rope, experts, sinks and soft-capping alike)."""
    folder = write_tiny_hf_model(tmp_path, with_tokenizer=False, vocab_size=96, **_FAMILIES[family])  # type: ignore[arg-type]
    tokens = [3 + (11 * i) % 90 for i in range(30)]
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0, -1]
    runner = build_runner(str(folder), dtype=dtype, num_blocks=8)
    assert runner.model.embed_tokens.weight.dtype == dtype
    got = last_logits(runner, tokens)
    assert torch.isfinite(got).all()
    assert ((got - want).abs().max() / want.abs().max()).item() < 5e-2


def test_dummy_weights_give_finite_logits(tiny_model_dir: Callable[[str], Path]) -> None:
    runner = build_runner(f"dummy:{tiny_model_dir('qwen3') / 'config.json'}", num_blocks=4)
    logits = last_logits(runner, list(range(5, 25)))
    assert torch.isfinite(logits).all() and logits.abs().max() > 0


def test_missing_weights_are_refused(tmp_path: Path, tiny_model_dir: Callable[[str], Path]) -> None:
    from safetensors.torch import load_file, save_file

    src = tiny_model_dir("llama")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="lacks 1 weights"):
        load_model(
            resolve_model(str(tmp_path)), torch.device("cpu"), torch.float32, TorchReferenceAttention()
        )


def test_a_failing_post_load_is_a_load_error_chained_to_its_cause(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a model derives once its weights are in (rope tables, packed weights) fails as the loader's
    ModelLoadError naming the model, with the original error chained, not as a raw exception."""
    from ominix_worker.models.llama import LlamaForCausalLM

    cause = ValueError("no room for the rope tables")

    def failing_post_load(self: LlamaForCausalLM, device: torch.device) -> None:
        raise cause

    monkeypatch.setattr(LlamaForCausalLM, "post_load", failing_post_load)
    source = resolve_model(str(tiny_model_dir("llama")))
    with pytest.raises(ModelLoadError, match="cannot load model .*: no room for the rope tables") as raised:
        load_model(source, torch.device("cpu"), torch.float32, TorchReferenceAttention())
    assert raised.value.__cause__ is cause


def test_devices_dtypes_and_sizes(tiny_model_dir: Callable[[str], Path]) -> None:
    assert parse_device("cpu") == torch.device("cpu")
    for bad in ("gpu:0", "cpu:1", "cuda:x"):
        with pytest.raises(DeviceError):
            parse_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="not found"):
            parse_device("cuda:0")
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert parse_bytes("1GiB") == 2**30 and parse_bytes("512MiB") == 2**29 and parse_bytes("1000") == 1000
    with pytest.raises(ValueError):
        parse_bytes("lots")
    config = load_hf_config(tiny_model_dir("llama"))
    # K and V × 2 layers × 16 tokens × 2 kv heads × 16 dims × 4 bytes
    assert kv_bytes_per_block(config, 16, torch.float32) == 2 * 2 * 16 * 2 * 16 * 4
    assert get_attention_backend("cpu").name == "torch-sdpa"


def test_sharded_safetensors_load_like_one_file(
    tmp_path: Path, tiny_model_dir: Callable[[str], Path]
) -> None:
    source = tiny_model_dir("qwen2")
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    tokens = list(range(7, 27))
    sharded = last_logits(build_runner(str(tmp_path), num_blocks=4), tokens)
    single = last_logits(build_runner(str(source), num_blocks=4), tokens)
    assert torch.equal(sharded, single)


def test_llama_with_attention_bias_matches_transformers(tmp_path: Path) -> None:
    folder = write_tiny_hf_model(
        tmp_path, arch="llama", attention_bias=True, with_tokenizer=False, vocab_size=96
    )
    runner = build_runner(str(folder), num_blocks=4)
    assert runner.config.qkv_bias and runner.config.o_proj_bias
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = list(range(5, 25))
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0, -1]
    got = last_logits(runner, tokens)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


class FakeAccelerator:
    """Memory counters of a 80 GB card: 16 GB of weights, a 6 GB activation peak, 1 GB used elsewhere."""

    GB = 10**9

    def __init__(self) -> None:
        self.allocated = 16 * self.GB
        self.peak = self.allocated
        self.calls: list[str] = []

    def synchronize(self, device: object) -> None:
        self.calls.append("sync")

    def empty_cache(self) -> None:
        self.calls.append("empty")

    def reset_peak_memory_stats(self, device: object) -> None:
        self.peak = self.allocated

    def forward(self) -> None:
        self.calls.append("forward")
        self.peak = self.allocated + 6 * self.GB

    def graph_forward(self) -> None:
        self.calls.append("graph forward")
        self.peak = max(self.peak, self.allocated + 2 * self.GB)

    def release_profile_kv(self) -> None:
        self.calls.append("release")
        self.allocated -= 1 * self.GB

    def mem_get_info(self, device: object) -> tuple[int, int]:
        self.calls.append("free memory read")
        return 80 * self.GB - self.allocated - 1 * self.GB, 80 * self.GB

    def max_memory_allocated(self, device: object) -> int:
        return self.peak

    def memory_allocated(self, device: object) -> int:
        return self.allocated


CUDA0 = torch.device("cuda", 0)


def test_gpu_kv_budget_reserves_weights_activations_and_headroom() -> None:
    from ominix_worker.kv_cache import measure_device_room

    accel = FakeAccelerator()
    room = measure_device_room(CUDA0, accel.forward, accel=accel)
    # 0.9 × 80 − 16 (weights) − 1 (others) − 6 (activation peak) = 49 GB
    assert room.budget_at(0.9) == 49 * FakeAccelerator.GB
    assert accel.calls.index("forward") < len(accel.calls) - 2  # synchronised and emptied after it
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        room.budget_at(1.5)


def test_gpu_kv_budget_leaves_room_for_the_piecewise_graphs_pool() -> None:
    """The pool's forward is measured on its own (peak reset after the largest step), and taken off too."""
    from ominix_worker.kv_cache import measure_device_room

    accel = FakeAccelerator()
    room = measure_device_room(CUDA0, accel.forward, accel=accel, graph_forward=accel.graph_forward)
    assert room.budget_at(0.9) == (49 - 2) * FakeAccelerator.GB
    assert accel.calls.index("forward") < accel.calls.index("graph forward")


def test_gpu_kv_budget_does_not_count_the_profile_kv_it_replaces() -> None:
    """The forwards' own small KV (1 GB here) is dropped, and the cache emptied, before free memory is read:
    it is not in use once the sized KV replaces it, so the budget is 1 GB larger than with it counted."""
    from ominix_worker.kv_cache import measure_device_room

    accel = FakeAccelerator()
    room = measure_device_room(
        CUDA0, accel.forward, accel=accel, graph_forward=accel.graph_forward, release=accel.release_profile_kv
    )
    assert room.budget_at(0.9) == (49 - 2 + 1) * FakeAccelerator.GB
    calls = accel.calls
    assert calls.index("graph forward") < calls.index("release") < calls.index("free memory read")
    assert "empty" in calls[calls.index("release") : calls.index("free memory read")]


def test_a_given_gpu_kv_budget_must_fit_beside_the_activations() -> None:
    """--kv-cache-memory on a GPU: up to the free memory less the activations (80 − 15 − 1 − 8 = 56 GB
    here), refused past it with the figures."""
    from ominix_worker.kv_cache import measure_device_room

    accel = FakeAccelerator()
    room = measure_device_room(
        CUDA0, accel.forward, accel=accel, graph_forward=accel.graph_forward, release=accel.release_profile_kv
    )
    room.check_given(56 * FakeAccelerator.GB)
    with pytest.raises(ValueError, match="does not fit: 56000000000 bytes are free"):
        room.check_given(56 * FakeAccelerator.GB + 1)


def test_torch_dequantizers_equal_the_gguf_package() -> None:
    import gguf
    from gguf.quants import dequantize, quantize

    from ominix_worker.loader import dequantize_q4_1, dequantize_q8_0

    values = np.random.default_rng(0).standard_normal((6, 128)).astype(np.float32)
    for qtype, ours in [
        (gguf.GGMLQuantizationType.Q8_0, dequantize_q8_0),
        (gguf.GGMLQuantizationType.Q4_1, dequantize_q4_1),
    ]:
        raw = quantize(values, qtype)
        want = torch.from_numpy(dequantize(raw, qtype).copy())
        got = ours(raw, values.shape)
        assert torch.equal(got, want), qtype.name
        assert (got - torch.from_numpy(values)).abs().max() < 0.5  # and it is a dequantization at all


def test_sm_count_off_the_gpu_is_the_callers_stand_in() -> None:
    """Off a CUDA device (Triton's CPU interpreter) grids are sized for the count the caller names."""
    assert sm_count(torch.device("cpu")) == 1
    assert sm_count(torch.device("cpu"), off_gpu=132) == 132


def test_make_current_switches_only_to_an_indexed_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # A bare "cuda" is the current device already; torch refuses set_device without an index.
    from ominix_worker import devices

    switched: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", switched.append)
    devices.make_current(torch.device("cuda"))
    devices.make_current(torch.device("cpu"))
    devices.make_current(torch.device("cuda:1"))
    assert switched == [torch.device("cuda:1")]


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_on_cpu_follows_native_bfloat16(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """'auto' on a CPU is bfloat16 only where the CPU multiplies it in hardware; a GPU is bfloat16 either way."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert cpu_has_native_bf16() is (native and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == expected
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
