"""Load a model's weights into a LlamaForCausalLM: Hugging Face folder, GGUF file, or dummy random weights.

GGUF tensors are dequantized to the run dtype. llama.cpp stores the Q and K projections of ``llama``
models with each head's rows interleaved (pairs (i, i + head_dim/2) adjacent); we undo that so the
Hugging Face rotate-half rope applies unchanged.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ominix_runtime.models import ModelFormat, ModelSource
from ominix_worker.attention.base import AttentionBackend
from ominix_worker.config import ModelConfig, ModelConfigError, config_from_gguf_fields, load_hf_config
from ominix_worker.models.llama import LlamaForCausalLM, rope_inv_freq
from ominix_worker.models.registry import model_class
from ominix_worker.parallel import SINGLE, SafetensorsWeight, TensorParallel, WeightSource
from ominix_worker.progress import track
from ominix_worker.quant.fp8 import (
    Fp8ConfigError,
    Fp8Scheme,
    fp8_checkpoint_names,
    prepare_fp8_model,
    quantize_model,
    scheme_from_config,
)

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """The model cannot be loaded (missing files, unsupported architecture, incomplete weights)."""


@dataclass(slots=True)
class LoadedModel:
    name: str
    config: ModelConfig
    model: LlamaForCausalLM


def _progress(iterable: Any, total: int, desc: str) -> Any:
    return track(iterable, total, desc, unit="tensor")


# ---- Hugging Face safetensors ------------------------------------------------------------------------


def _safetensors_files(folder: Path) -> list[Path]:
    """The shards the index names, else ``model*.safetensors``, else every ``*.safetensors``.

    Some folders also ship a differently named copy of the weights (e.g. ``consolidated.safetensors``).
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder} lacks the shards {', '.join(missing[:3])} named in its index")
    else:
        files = sorted(folder.glob("model*.safetensors")) or sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {folder}")
    return files


def _open_safetensors(file: Path) -> Any:
    """The file opened for reading; a damaged one (truncated, bad header) is refused naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except SafetensorError as exc:
        raise ModelLoadError(f"cannot read {file}: {exc}") from exc


def _hf_weights(folder: Path) -> Iterator[tuple[str, WeightSource]]:
    """Every tensor of the folder's safetensors files, unread: the model reads the slices it keeps."""
    files = _safetensors_files(folder)
    names: list[tuple[Path, str]] = []
    for file in files:
        with _open_safetensors(file) as f:
            names.extend((file, key) for key in f.keys())  # noqa: SIM118 (safe_open has no __iter__)
    handles: dict[Path, Any] = {}
    try:
        for file, key in _progress(names, len(names), "loading weights"):
            if file not in handles:
                handles[file] = _open_safetensors(file)
            yield key, SafetensorsWeight(handles[file].get_slice(key), key)
    finally:
        handles.clear()


# ---- GGUF ------------------------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # Mixture of experts: router, Qwen2-MoE's shared expert and its gate.
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# Experts stacked in one tensor (E, rows, columns) per projection; split into Hugging Face's per-expert names.
_GGUF_EXPERT_NAMES = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_SKIPPED_GGUF_FIELDS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
)


def gguf_to_hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; stacked experts get ``...experts.{expert}.<proj>.weight``."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    match = _BLOCK_RE.match(name)
    if match and match.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}"
    if match and match.group(2) in _GGUF_EXPERT_NAMES:
        return f"model.layers.{match.group(1)}.mlp.experts.{{expert}}.{_GGUF_EXPERT_NAMES[match.group(2)]}.weight"
    return None


def unpermute_llama_cpp_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert-time permutation of Q/K rows (per head: (2, d/2) → (d/2, 2))."""
    out_features = weight.shape[0]
    rest = weight.shape[1:]
    head_dim = out_features // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(out_features, *rest)


def read_gguf_config(reader: Any) -> tuple[ModelConfig, bool]:
    """The config and whether the output projection is tied to the embedding (no ``output.weight``)."""
    fields: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in _SKIPPED_GGUF_FIELDS:
            continue
        try:
            fields[key] = field.contents()
        except Exception:  # noqa: BLE001 - a field we cannot decode is one we do not need
            continue
    tensor_names = {t.name: t for t in reader.tensors}
    embd = tensor_names.get("token_embd.weight")
    rows = int(embd.shape[-1]) if embd is not None else None
    config = config_from_gguf_fields(fields, token_embd_rows=rows)
    tied = "output.weight" not in tensor_names
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1 GGUFs store their rope scaling as one divisor per rotary frequency.
        factors = [float(f) for f in tensor_names["rope_freqs.weight"].data.reshape(-1)]
        config = replace(config, rope_scaling={"rope_type": "freq_factors", "factors": factors})
    return replace(config, tie_word_embeddings=tied), tied


def dequantize_q8_0(raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Blocks of 32: float16 scale d, 32 int8 q; value = d * q."""
    blocks = torch.from_numpy(raw).reshape(-1, 34)
    scale = blocks[:, :2].contiguous().view(torch.float16).float()
    quants = blocks[:, 2:].contiguous().view(torch.int8).float()
    return (scale * quants).reshape(shape)


def dequantize_q4_1(raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Blocks of 32: float16 scale d and minimum m, 16 bytes of nibbles (low nibbles are values 0-15, high
    nibbles values 16-31); value = d * nibble + m."""
    blocks = torch.from_numpy(raw).reshape(-1, 20)
    scale = blocks[:, :2].contiguous().view(torch.float16).float()
    minimum = blocks[:, 2:4].contiguous().view(torch.float16).float()
    packed = blocks[:, 4:]
    nibbles = torch.cat((packed & 0x0F, packed >> 4), dim=1).float()
    return (scale * nibbles + minimum).reshape(shape)


def _torch_dequantizers() -> dict[Any, Any]:
    from gguf import GGMLQuantizationType

    return {GGMLQuantizationType.Q8_0: dequantize_q8_0, GGMLQuantizationType.Q4_1: dequantize_q4_1}


def _gguf_weights(reader: Any, config: ModelConfig, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    _TORCH_DEQUANTIZERS = _torch_dequantizers()  # noqa: N806 - a constant table, built lazily
    permute = config.arch in ("llama", "mistral", "mixtral")
    tensors = list(reader.tensors)
    for t in _progress(tensors, len(tensors), "dequantizing weights"):
        hf_name = gguf_to_hf_name(t.name)
        if hf_name is None:
            continue
        shape = tuple(reversed([int(d) for d in t.shape]))  # GGUF lists dimensions innermost first
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            tensor = torch.from_numpy(np.array(t.data).reshape(shape)).to(dtype)
        elif t.tensor_type in _TORCH_DEQUANTIZERS:
            tensor = _TORCH_DEQUANTIZERS[t.tensor_type](np.array(t.data), shape).to(dtype)
        else:
            tensor = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).to(dtype)
        if permute and hf_name.endswith("q_proj.weight"):
            tensor = unpermute_llama_cpp_rows(tensor, config.num_heads)
        elif permute and hf_name.endswith("k_proj.weight"):
            tensor = unpermute_llama_cpp_rows(tensor, config.num_kv_heads)
        elif hf_name.endswith("shared_expert_gate.weight"):
            tensor = tensor.reshape(1, -1)  # GGUF stores the one-row gate as a vector
        if "{expert}" in hf_name:
            for expert in range(tensor.shape[0]):
                yield hf_name.format(expert=expert), tensor[expert]
            continue
        yield hf_name, tensor


# ---- entry point -------------------------------------------------------------------------------------


def _build(
    config: ModelConfig,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    tp: TensorParallel,
    fp8: Fp8Scheme | None = None,
) -> LlamaForCausalLM:
    """The model with empty weights on ``device``; with ``fp8`` its projections and experts are FP8 modules
    (an FP8 checkpoint loads into them)."""
    # The rope tables are built only after loading; computing the frequencies now refuses an unsupported or
    # incomplete rope configuration before any weight is read.
    rope_inv_freq(config)
    with torch.device("meta"):
        model = model_class(config)(config, backend, max_positions, tp)
    model = model.to(dtype)
    if fp8 is not None:
        prepare_fp8_model(model, fp8)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty replaces parameters one module at a time: tie again
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def _load_checked(
    model: LlamaForCausalLM, weights: Iterator[tuple[str, torch.Tensor | WeightSource]], where: str
) -> None:
    loaded = model.load_weights(weights)
    missing = sorted(model.expected_weight_keys() - loaded)
    if missing:
        raise ModelLoadError(f"{where} lacks {len(missing)} weights, e.g. {', '.join(missing[:3])}")


def load_config(source: ModelSource) -> ModelConfig:
    if source.format == ModelFormat.GGUF:
        from gguf import GGUFReader

        return read_gguf_config(GGUFReader(str(source.path)))[0]
    return load_hf_config(source.path)


def load_model(
    source: ModelSource,
    device: torch.device,
    dtype: torch.dtype,
    backend: AttentionBackend,
    max_positions: int | None = None,
    seed: int = 0,
    tp: TensorParallel = SINGLE,
    quantization: str | None = None,
) -> LoadedModel:
    """Read the source's config and weights onto ``device`` in ``dtype``. Raises ModelLoadError.

    Under tensor parallelism (``tp``) the model holds this rank's shards: safetensors are read slice by slice
    (only what the rank keeps), GGUF tensors are dequantized whole and sliced, dummy weights drawn per shard.
    An FP8 checkpoint (``quantization_config`` quant_method fp8) loads as FP8; ``quantization="fp8"``
    quantizes a float checkpoint to FP8 (per channel) once its weights are loaded.
    """
    if quantization not in (None, "", "none", "fp8"):
        raise ModelLoadError(f"unknown quantization {quantization!r} (none or fp8)")
    try:
        if device.type != "cpu" and source.format != ModelFormat.GGUF and load_config(source).compress_ratios:
            raise ModelLoadError(f"{source.name}: the compressed-attention reference runs on the CPU only")
        if source.format == ModelFormat.GGUF:
            from gguf import GGUFReader

            reader = GGUFReader(str(source.path))
            config, _ = read_gguf_config(reader)
            model = _build(
                config, backend, dtype, device, max_positions or config.max_position_embeddings, tp
            )
            _load_checked(model, _gguf_weights(reader, config, dtype), str(source.path))
        elif source.format == ModelFormat.HF:
            config = load_hf_config(source.path)
            checkpoint_fp8 = scheme_from_config(config.quantization)
            model = _build(
                config,
                backend,
                dtype,
                device,
                max_positions or config.max_position_embeddings,
                tp,
                checkpoint_fp8,
            )
            weights: Iterator[tuple[str, torch.Tensor | WeightSource]] = _hf_weights(Path(source.path))
            if checkpoint_fp8 is not None:
                weights = fp8_checkpoint_names(weights)
            _load_checked(model, weights, str(source.path))
        elif source.format == ModelFormat.DUMMY:
            config = load_hf_config(source.path)
            model = _build(
                config, backend, dtype, device, max_positions or config.max_position_embeddings, tp
            )
            model.init_dummy_weights(seed)
            stated = scheme_from_config(config.quantization)
            if stated is not None:  # random weights, quantized as the config states
                quantize_model(model, stated)
        else:  # pragma: no cover - ModelFormat is closed
            raise ModelLoadError(f"unknown model format {source.format}")
        if quantization == "fp8" and not config.quantization:
            quantize_model(model, Fp8Scheme())  # per channel
            config = replace(config, quantization={"quant_method": "fp8", "activation_scheme": "dynamic"})
            model.config = config
        # Inside the wrapping: what the model derives from its loaded weights (rope tables, CPU-packed
        # weights, expert maps) fails as a load error too.
        model.post_load(device)
    except (ModelConfigError, Fp8ConfigError, KeyError, ValueError, OSError) as exc:
        # ValueError covers a model whose heads, FFN or KV heads do not divide among the ranks.
        raise ModelLoadError(f"cannot load model {source.name!r} from {source.path}: {exc}") from exc
    return LoadedModel(name=source.name, config=config, model=model)
