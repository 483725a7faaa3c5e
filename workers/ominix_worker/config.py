"""ModelConfig: the shape of a Llama-family model (dense or mixture-of-experts), read from a Hugging Face
config.json or GGUF metadata."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHES = (
    "llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe", "mixtral", "gemma3_text", "gemma3", "gpt_oss",
    "llama_compressed",
)  # fmt: skip
_ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "llama_compressed": "LlamaCompressedForCausalLM",
}
# Mixture-of-experts architectures (``models/moe.py``, ``models/gpt_oss.py``); the others are dense.
MOE_ARCHES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss")


log = logging.getLogger(__name__)

# Hugging Face's ``layer_types`` values.
SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"
# The keys of a Gemma 3 ``rope_parameters`` split per layer type.
_GEMMA3_ROPE_KINDS = (FULL_ATTENTION, SLIDING_ATTENTION)


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Layers that attend alike and so share one KV block table (a KV group of the worker's layout).

    A raw group keeps one KV row per token (full attention, or a window); a compressed group (``compress_ratio``
    > 0, DeepSeek-V4-style) keeps one row per complete chunk of that many tokens for layers whose raw KV lives
    in a raw group as well.
    """

    window: int  # 0: full attention (or a compressed group)
    layers: tuple[int, ...]
    compress_ratio: int = 0  # > 0: a compressed group


class ModelConfigError(ValueError):
    """The model's configuration is missing a field or describes an unsupported model."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str  # llama, qwen2, qwen3, mistral
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    # Scaling parameters as Hugging Face names them ({"rope_type": "llama3", "factor": 8.0, ...}); empty: none.
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, or Llama with attention_bias
    o_proj_bias: bool = False  # Llama with attention_bias (Qwen2 has none on o_proj)
    qk_norm: bool = False  # Qwen3
    max_position_embeddings: int = 2048
    # Sliding-window layers attend to the last sliding_window tokens (itself included); 0: none. Which layers
    # do: ``layer_types`` (Hugging Face's per-layer "sliding_attention" / "full_attention"), or every layer
    # when it is empty (the Mistral family).
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Explicit head_dim differing from hidden / heads (Qwen3) is supported; partial rotary is not.
    rotary_dim: int = 0
    # Mixture of experts (0 experts: dense). ``moe_layers`` lists the layers whose MLP is the sparse block
    # (Qwen's decoder_sparse_step and mlp_only_layers decide it); the others keep the dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    scoring_func: str = "softmax"  # router scores: softmax or sigmoid
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a sigmoid-gated shared expert beside the routed
    moe_layers: tuple[int, ...] = ()
    # gpt-oss: experts with biases and a clamped SwiGLU, (up + 1) · gate · sigmoid(alpha · gate) after clamping
    # the gate from above and the up projection both ways at ``swiglu_limit``; a router with a bias; a learned
    # attention sink per query head. ``models/gpt_oss.py`` reads these.
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Weight quantization: None (run dtype) or a parsed fp8 description (``ominix_worker.quant.fp8``).
    quantization: dict[str, Any] = field(default_factory=dict)
    # Gemma 3 (``models/gemma3.py``): the MLP's activation, the attention scale query_pre_attn_scalar ** -0.5
    # (0: head_dim), tanh soft-capping of the final logits (0: none) and the rope base of the sliding-window
    # layers (``rope_theta`` and ``rope_scaling`` are the global layers').
    hidden_act: str = "silu"
    query_pre_attn_scalar: float = 0.0
    final_logit_softcapping: float = 0.0
    rope_local_theta: float = 0.0
    # Compressed attention (``llama_compressed``, shaped like DeepSeek-V4's layers): per layer, the tokens
    # summarised by one compressed KV row (0: the layer attends within its sliding window only). Empty: none.
    compress_ratios: tuple[int, ...] = ()

    @property
    def architecture(self) -> str:
        return _ARCH_CLASS[self.arch]

    def max_len_for(self, attends_within_window: bool) -> int:
        """Longest sequence this model runs correctly on a backend that does (or does not) attend within a
        sliding window: full attention equals sliding-window attention only inside the window."""
        windowed = any(self.layer_window(i) for i in range(self.num_layers))
        if windowed and not attends_within_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def layer_window(self, layer: int) -> int:
        """The window layer ``layer`` attends within (0: full attention)."""
        if not self.sliding_window:
            return 0
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else 0

    def attention_groups(self, attends_within_window: bool) -> tuple[AttentionGroup, ...]:
        """The layers that share one KV block table: one group per distinct window, the full-attention group
        first (it bounds a request's context), then windows ascending. A backend that does not attend within
        windows gets one full-attention group (and ``max_len_for`` caps the context at the window)."""
        windows = [self.layer_window(i) if attends_within_window else 0 for i in range(self.num_layers)]
        raw = tuple(
            AttentionGroup(w, tuple(i for i, lw in enumerate(windows) if lw == w))
            for w in sorted(set(windows))
        )
        # Compressed groups come after every raw group, one per distinct ratio, ascending.
        return raw + tuple(
            AttentionGroup(0, tuple(i for i, r in enumerate(self.compress_ratios) if r == ratio), ratio)
            for ratio in self.compressed_group_ratios
        )

    @property
    def compressed_group_ratios(self) -> tuple[int, ...]:
        """The distinct compress ratios, ascending: one compressed KV group each, in this order."""
        return tuple(sorted({r for r in self.compress_ratios if r}))

    @property
    def num_kv_cache_layers(self) -> int:
        """KV tensors per block set: one raw per layer, plus one of compressed rows per compressed layer."""
        return self.num_layers + sum(1 for r in self.compress_ratios if r)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and bool(self.moe_layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self, tied_lm_head: bool | None = None) -> int:
        """The whole model's parameters (every rank's together). ``tied_lm_head``: whether the loaded LM head
        shares the embedding (the loader keeps a stored, different head of a tied config untied); None: as
        ``tie_word_embeddings`` says."""
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        if self.arch == "gpt_oss":  # attention sinks; expert and router biases
            attn += self.num_heads
            moe_bias = self.num_experts * (2 * self.moe_intermediate_size + self.hidden_size + 1)
        else:
            moe_bias = 0
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_proj_bias:
            attn += self.hidden_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        moe_mlp = self.num_experts * (3 * self.hidden_size * self.moe_intermediate_size + self.hidden_size)
        moe_mlp += moe_bias
        if self.shared_expert_intermediate_size:
            moe_mlp += 3 * self.hidden_size * self.shared_expert_intermediate_size + self.hidden_size
        num_moe = len(self.moe_layers)
        mlps = num_moe * moe_mlp + (self.num_layers - num_moe) * dense_mlp
        # Gemma 3 normalises before and after both the attention and the MLP; the rest before each.
        per_layer = attn + (4 if self.arch == "gemma3_text" else 2) * self.hidden_size
        # Compressed layers: a gate and a position bias per chunk offset (each per KV head and dimension), and
        # the row norm.
        compress = sum(
            (1 + r) * self.num_kv_heads * self.head_dim + self.head_dim for r in self.compress_ratios if r
        )
        embed = self.vocab_size * self.hidden_size
        tied = self.tie_word_embeddings if tied_lm_head is None else tied_lm_head
        head = 0 if tied else embed
        return self.num_layers * per_layer + compress + mlps + embed + head + self.hidden_size


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _rope_from_hf(raw: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """transformers 5 nests theta and scaling in ``rope_parameters``; older configs use two fields. ``raw``
    has its architecture's defaults filled in."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", raw["rope_theta"]))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw["rope_theta"])
        scaling = dict(raw["rope_scaling"] or {})
    scaling = _rope_scaling(scaling)
    if scaling.get("rope_type") in ("llama3", "yarn"):
        # Both rescale relative to the pretraining context. A config that leaves it out is read as transformers
        # reads it: a top-level original_max_position_embeddings (Phi-3 style) first, else the model's own
        # context, so the logits match the checkpoint's reference implementation.
        scaling["original_max_position_embeddings"] = int(
            raw.get("original_max_position_embeddings")
            or scaling.get("original_max_position_embeddings")
            or raw["max_position_embeddings"]
        )
    return theta, scaling


def _rope_scaling(scaling: dict[str, Any]) -> dict[str, Any]:
    """Scaling parameters under one spelling (``rope_type``); empty for plain rope."""
    scaling = _rope_type_named(scaling)
    if scaling.get("rope_type", "default") == "default":
        return {}
    return scaling


def _rope_type_named(scaling: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``scaling`` with the legacy ``type`` key spelled ``rope_type``."""
    scaling = dict(scaling)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    return scaling


# Hugging Face's defaults for the fields a config.json may leave out. Each transformers config class has its
# own (Mixtral's rope base is 1e6, gpt-oss's rope is YaRN and its attention has biases), so an omitted field
# takes the value its architecture's class gives it: one table, looked up by model_type, read by every
# config.json parser below (GGUF metadata states these fields itself). Shape fields without a default (vocab_size, hidden_size, ...) are required, except for
# Gemma 3, whose configs omit them.
_LLAMA_DEFAULTS: dict[str, Any] = dict(
    num_key_value_heads=None,  # as many as the query heads
    head_dim=None,  # hidden_size / num_attention_heads
    rope_theta=10_000.0,
    rope_scaling=None,
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    attention_bias=False,
    hidden_act="silu",
    sliding_window=None,
    use_sliding_window=False,
)
_QWEN_DEFAULTS: dict[str, Any] = dict(max_position_embeddings=32_768, sliding_window=4096)
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    arch: {**_LLAMA_DEFAULTS, **overrides}
    for arch, overrides in {
        "llama": {},
        "llama_compressed": {},
        "mistral": dict(num_key_value_heads=8, max_position_embeddings=131_072, sliding_window=4096),
        "qwen2": dict(_QWEN_DEFAULTS, num_key_value_heads=32, max_window_layers=28),
        "qwen3": dict(_QWEN_DEFAULTS, num_key_value_heads=32, head_dim=128, max_window_layers=28),
        "qwen2_moe": dict(
            _QWEN_DEFAULTS, num_key_value_heads=16, max_window_layers=28, qkv_bias=True, norm_topk_prob=False
        ),
        "qwen3_moe": dict(_QWEN_DEFAULTS, num_key_value_heads=4, norm_topk_prob=False),
        "mixtral": dict(
            num_key_value_heads=8, max_position_embeddings=131_072, rms_norm_eps=1e-5, rope_theta=1_000_000.0
        ),
        "gpt_oss": dict(
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=131_072,
            rms_norm_eps=1e-5,
            rope_theta=150_000.0,
            rope_scaling=dict(
                rope_type="yarn",
                factor=32.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=4096,
            ),
            sliding_window=128,
            attention_bias=True,
            swiglu_alpha=1.702,
            swiglu_limit=7.0,
        ),
        "gemma3_text": dict(
            vocab_size=262_208,
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            hidden_activation="gelu_pytorch_tanh",
            hidden_act="gelu_pytorch_tanh",
            max_position_embeddings=131_072,
            rms_norm_eps=1e-6,
            eos_token_id=1,
            bos_token_id=2,
            tie_word_embeddings=True,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            sliding_window_pattern=6,  # every sixth layer is global
            rope_theta=1_000_000.0,  # the global layers'
            rope_local_base_freq=10_000.0,  # the sliding-window layers'
        ),
    }.items()
}


def _gemma3_text(raw: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 text config with its defaults filled in and its per-layer-type rope flattened into
    ``rope_theta`` / ``rope_scaling`` (global layers) and ``rope_local_base_freq``. A
    Gemma3ForConditionalGeneration config gives its ``text_config`` (the vision tower is not served)."""
    if raw.get("model_type") == "gemma3":
        text = dict(raw.get("text_config") or {})
        # The outer config's ids win (the chat end-of-turn id is there), and an FP8 checkpoint states its
        # quantization_config there only.
        for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings", "quantization_config"):
            if raw.get(key) is not None:
                text[key] = raw[key]
        raw = text
    defaults = _ARCH_DEFAULTS["gemma3_text"]
    out = {**defaults, **{k: v for k, v in raw.items() if v is not None}}
    out["model_type"] = "gemma3_text"
    if out.get("use_bidirectional_attention"):
        raise ModelConfigError("use_bidirectional_attention=true is not supported (causal attention only)")
    out["hidden_act"] = out.pop("hidden_activation", None) or out.get("hidden_act") or "gelu_pytorch_tanh"
    _gemma3_rope(out)
    return out


def _gemma3_rope(out: dict[str, Any]) -> None:
    """Gemma 3's rope per layer type into ``rope_theta`` / ``rope_scaling`` (global layers) and
    ``rope_local_base_freq`` (sliding-window layers) of ``out`` (defaults filled in), read as transformers'
    Gemma3TextConfig reads it, so that the logits are the reference's:

    - ``rope_parameters`` holds one entry per layer type; a layer type without one rotates plainly;
    - a legacy top-level ``rope_scaling`` updates the global layers' entry;
    - an entry without ``rope_theta`` takes the top-level ``rope_theta`` / ``rope_local_base_freq``;
    - keys beside the per-type entries (a flat ``rope_parameters``) are ignored: transformers' Gemma 3 rotates
      with the per-type entries only. Ignored here too (other logits than the reference's would be worse),
      but said in the log.
    """
    given = out.pop("rope_parameters", None)
    if given is not None and not isinstance(given, dict):
        raise ModelConfigError(f"rope_parameters must be a mapping, not {type(given).__name__}")
    params: dict[str, Any] = dict(given) if given is not None else {kind: {} for kind in _GEMMA3_ROPE_KINDS}
    full = _gemma3_full_rope(params, out.get("rope_scaling"))
    full.setdefault("rope_theta", out["rope_theta"])
    local = dict(params.get(SLIDING_ATTENTION) or {})
    local.setdefault("rope_theta", out["rope_local_base_freq"])
    out["rope_theta"] = float(full.pop("rope_theta"))
    out["rope_scaling"] = _rope_scaling(full)
    out["rope_local_base_freq"] = float(local.pop("rope_theta"))
    if _rope_scaling(local):
        raise ModelConfigError("rope scaling on Gemma 3's sliding-window layers is not supported")
    ignored = sorted(key for key in params if key not in _GEMMA3_ROPE_KINDS)
    if ignored:
        log.warning(
            "Gemma 3 rope_parameters %s are not under %s or %s and are ignored, as transformers ignores them: "
            "the global layers rotate with rope_theta %g and scaling %s, the sliding-window layers with %g",
            ", ".join(ignored), FULL_ATTENTION, SLIDING_ATTENTION, out["rope_theta"],
            out["rope_scaling"] or "none", out["rope_local_base_freq"],
        )  # fmt: skip


def _gemma3_full_rope(params: dict[str, Any], legacy_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The global layers' rope entry, updated by a legacy top-level ``rope_scaling`` as transformers does; a
    ``rope_parameters`` without a global entry to update is refused, as transformers refuses it."""
    full = params.get(FULL_ATTENTION)
    if legacy_scaling is None:
        return dict(full or {})
    if full is None:
        raise ModelConfigError(
            f"rope_scaling beside a rope_parameters without a {FULL_ATTENTION} entry (not split per layer type): "
            f"Gemma 3 scales the {FULL_ATTENTION} entry (transformers refuses this config too)"
        )
    return {**full, **_rope_type_named(legacy_scaling)}


def _gemma3_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields only Gemma 3 sets (raw: ``_gemma3_text``'s output)."""
    return dict(
        hidden_act=str(raw["hidden_act"]),
        query_pre_attn_scalar=float(raw["query_pre_attn_scalar"]),
        final_logit_softcapping=float(raw.get("final_logit_softcapping") or 0.0),
        rope_local_theta=float(raw["rope_local_base_freq"]),
    )


def _sliding_window(raw: dict[str, Any], model_type: str) -> int:
    """The window of the sliding-window layers (0: full attention everywhere)."""
    window = raw["sliding_window"]
    uses_window = raw["use_sliding_window"] or model_type in (
        "mistral",
        "mixtral",
        "gemma3_text",
        "gpt_oss",
        "llama_compressed",
    )
    return int(window) if window and uses_window else 0


# Which layers attend within the window when a config.json states no ``layer_types``, as each transformers
# class lays them out: (layer index, config) → windowed. An architecture not listed windows every layer
# (Mistral, Mixtral, Qwen3-MoE, llama_compressed).
_WINDOWED_LAYER: dict[str, Callable[[int, dict[str, Any]], bool]] = {
    # Qwen2 and Qwen3 attend fully below max_window_layers and within the window from there on.
    "qwen2": lambda i, raw: i >= int(raw["max_window_layers"]),
    "qwen3": lambda i, raw: i >= int(raw["max_window_layers"]),
    # Qwen2-MoE windows every other layer below max_window_layers, the first one included.
    "qwen2_moe": lambda i, raw: i % 2 == 0 and i < int(raw["max_window_layers"]),
    "gpt_oss": lambda i, raw: i % 2 == 0,  # alternating, the first layer windowed
    # Gemma 3: every sliding_window_pattern-th layer is global.
    "gemma3_text": lambda i, raw: (i + 1) % int(raw["sliding_window_pattern"]) != 0,
}


def layer_types_from_hf(
    raw: dict[str, Any], model_type: str, num_layers: int, window: int
) -> tuple[str, ...]:
    """Per-layer attention kinds: as the config states them (``layer_types``), else as the architecture lays
    them out (``_WINDOWED_LAYER``); empty: every layer alike."""
    if not window:
        return ()
    types = raw.get("layer_types")
    if not types:
        windowed = _WINDOWED_LAYER.get(model_type)
        if windowed is None:
            return ()
        return tuple(SLIDING_ATTENTION if windowed(i, raw) else FULL_ATTENTION for i in range(num_layers))
    if len(types) != num_layers or any(t not in (SLIDING_ATTENTION, FULL_ATTENTION) for t in types):
        raise ModelConfigError(
            f"layer_types must list {num_layers} of {SLIDING_ATTENTION!r} / {FULL_ATTENTION!r}"
        )
    return tuple(str(t) for t in types)


def _moe_from_hf(raw: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """The MoE fields of a Qwen3-MoE, Qwen2-MoE or Mixtral config (empty for dense models)."""
    if model_type not in MOE_ARCHES:
        return {}
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    top_k = int(raw.get("num_experts_per_tok") or 0)
    if num_experts <= 0 or not 0 < top_k <= num_experts:
        raise ModelConfigError(f"bad MoE shape: {num_experts} experts, top-{top_k}")
    if model_type in ("gpt_oss", "mixtral"):
        # Every layer is sparse, experts as wide as intermediate_size, top-k always renormalised (gpt-oss: its
        # softmax over the top-k logits is the softmax over all experts renormalised over the top k).
        fields: dict[str, Any] = dict(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(raw["intermediate_size"]),
            norm_topk_prob=True,
            moe_layers=tuple(range(num_layers)),
        )
        if model_type == "gpt_oss":
            fields.update(
                swiglu_alpha=float(raw["swiglu_alpha"]),
                swiglu_limit=float(raw["swiglu_limit"]),
            )
        return fields
    step = int(raw.get("decoder_sparse_step") or 1)
    dense_only = {int(i) for i in raw.get("mlp_only_layers") or ()}
    layers = tuple(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw["norm_topk_prob"]),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0)
        if model_type == "qwen2_moe"
        else 0,
        moe_layers=layers,
    )


def _compress_ratios(raw: dict[str, Any], model_type: str, num_layers: int) -> tuple[int, ...]:
    """``compress_ratios`` of a ``llama_compressed`` config: one per layer, 0 for a window-only layer."""
    if model_type != "llama_compressed":
        return ()
    ratios = tuple(int(r) for r in raw.get("compress_ratios") or ())
    window = int(raw.get("sliding_window") or 0)
    if len(ratios) != num_layers or any(r < 0 for r in ratios):
        raise ModelConfigError(f"compress_ratios must list one ratio >= 0 per layer ({num_layers})")
    if window <= 0 or window < max(ratios):
        # The window holds the raw KV of the chunk being filled until its row is written.
        raise ModelConfigError(f"sliding_window {window} must be > 0 and at least every compress ratio")
    return ratios


def config_from_hf_dict(raw: dict[str, Any]) -> ModelConfig:
    model_type = str(raw.get("model_type", "")).lower()
    if model_type not in SUPPORTED_ARCHES:
        archs = raw.get("architectures") or []
        raise ModelConfigError(
            f"unsupported model_type {model_type!r} ({', '.join(archs) or 'no architectures'}); "
            f"supported: {', '.join(SUPPORTED_ARCHES)}"
        )
    extra: dict[str, Any] = {}
    if model_type in ("gemma3_text", "gemma3"):
        raw = _gemma3_text(raw)
        model_type = "gemma3_text"
        extra = _gemma3_fields(raw)
    raw = {**_ARCH_DEFAULTS[model_type], **raw}
    # Refuse what this implementation would silently get wrong.
    quant_method = str((raw.get("quantization_config") or {}).get("quant_method", "")).lower()
    if model_type == "gpt_oss" and quant_method == "mxfp4":
        raise ModelConfigError(
            "MXFP4 gpt-oss checkpoints (the released openai/gpt-oss weights) are not supported: "
            "use a bf16 checkpoint (experts dequantized) or dummy weights"
        )
    if model_type == "gpt_oss" and quant_method == "fp8":
        raise ModelConfigError(
            "FP8 gpt-oss checkpoints are not supported (its biased experts have no FP8 path): "
            "use a bf16 checkpoint or dummy weights"
        )
    if raw.get("mlp_bias"):
        raise ModelConfigError("mlp_bias=true is not supported")
    act = raw["hidden_act"]
    if act != ("gelu_pytorch_tanh" if model_type == "gemma3_text" else "silu"):
        raise ModelConfigError(f"hidden_act {act!r} is not supported for {model_type}")
    if float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelConfigError("partial rotary embeddings are not supported")
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        theta, scaling = _rope_from_hf(raw)
        num_layers = int(raw["num_hidden_layers"])
        window = _sliding_window(raw, model_type)
        if model_type == "qwen2_moe":  # Qwen2-MoE states its q/k/v bias
            qkv_bias = bool(raw["qkv_bias"])
        else:
            qkv_bias = model_type == "qwen2" or bool(raw["attention_bias"])
        return ModelConfig(
            arch=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(raw["num_key_value_heads"] or heads),
            head_dim=int(raw["head_dim"] or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(raw["rms_norm_eps"]),
            tie_word_embeddings=bool(raw["tie_word_embeddings"]),
            qkv_bias=qkv_bias,
            o_proj_bias=model_type not in ("qwen2", "qwen2_moe") and bool(raw["attention_bias"]),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            sliding_window=window,
            layer_types=layer_types_from_hf(raw, model_type, num_layers, window),
            bos_token_id=None if raw.get("bos_token_id") is None else int(raw["bos_token_id"]),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            quantization=dict(raw.get("quantization_config") or {}),
            compress_ratios=_compress_ratios(raw, model_type, num_layers),
            **_moe_from_hf(raw, model_type, num_layers),
            **extra,
        )
    except KeyError as exc:
        raise ModelConfigError(f"config.json lacks the field {exc.args[0]!r}") from None


def load_hf_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` (a folder or the file itself); generation_config.json may add eos ids."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"cannot read {file}: {exc}") from None
    config = config_from_hf_dict(raw)
    gen_file = file.parent / "generation_config.json"
    if gen_file.is_file():
        try:
            gen = json.loads(gen_file.read_text())
        except (OSError, json.JSONDecodeError):
            gen = {}
        extra = [t for t in _eos_ids(gen.get("eos_token_id")) if t not in config.eos_token_ids]
        if extra:
            from dataclasses import replace

            config = replace(config, eos_token_ids=config.eos_token_ids + tuple(extra))
    return config


_GGUF_ARCHES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mistral": "llama",
    "qwen3moe": "qwen3_moe",
    "qwen2moe": "qwen2_moe",
}
# GGUF expert_gating_func values (llama.cpp's enum): 1 softmax, 2 sigmoid.
_GGUF_GATING = {1: "softmax", 2: "sigmoid"}


def _moe_from_gguf(fields: dict[str, Any], gguf_arch: str, arch: str, num_layers: int) -> dict[str, Any]:
    """MoE fields from ``<arch>.expert_*`` metadata (empty for dense models). Every layer is sparse in GGUF
    MoE files; a ``llama`` file with experts is Mixtral."""
    num_experts = int(fields.get(f"{gguf_arch}.expert_count") or 0)
    if num_experts == 0:
        return {}
    top_k = int(fields.get(f"{gguf_arch}.expert_used_count") or 0)
    if not 0 < top_k <= num_experts:
        raise ModelConfigError(f"bad MoE shape in GGUF metadata: {num_experts} experts, top-{top_k}")
    ffn = fields.get(f"{gguf_arch}.expert_feed_forward_length") or fields.get(
        f"{gguf_arch}.feed_forward_length"
    )
    if ffn is None:
        raise ModelConfigError(f"GGUF metadata lacks {gguf_arch}.expert_feed_forward_length")
    gating = int(fields.get(f"{gguf_arch}.expert_gating_func") or 1)
    if gating not in _GGUF_GATING:
        raise ModelConfigError(f"unsupported GGUF expert_gating_func {gating}")
    norm = fields.get(f"{gguf_arch}.expert_weights_norm")
    return dict(
        arch="mixtral" if arch == "llama" else arch,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(ffn),
        norm_topk_prob=bool(norm) if norm is not None else arch != "qwen2_moe",
        scoring_func=_GGUF_GATING[gating],
        shared_expert_intermediate_size=int(
            fields.get(f"{gguf_arch}.expert_shared_feed_forward_length") or 0
        ),
        moe_layers=tuple(range(num_layers)),
    )


# llama.cpp's YaRN metadata with no counterpart here: refused rather than run as plain YaRN.
_GGUF_YARN_UNMAPPED = ("attn_factor", "yarn_attn_factor", "yarn_ext_factor", "yarn_log_multiplier")


def _rope_from_gguf(fields: dict[str, Any], gguf_arch: str, context_length: int) -> dict[str, Any]:
    """``<arch>.rope.scaling.*`` metadata as Hugging Face names it (empty: plain rope). A scaling type other
    than linear or YaRN is refused: dropping it would run plain rope, wrong at every position."""
    key = f"{gguf_arch}.rope.scaling"
    kind = fields.get(f"{key}.type")
    if kind in (None, "", "none"):
        return {}
    if kind not in ("linear", "yarn"):
        raise ModelConfigError(f"unsupported GGUF rope scaling type {kind!r} (none, linear or yarn)")
    factor = fields.get(f"{key}.factor")
    if factor is None:
        raise ModelConfigError(f"GGUF metadata lacks {key}.factor for {kind} rope scaling")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    unmapped = [f"{key}.{name}" for name in _GGUF_YARN_UNMAPPED if f"{key}.{name}" in fields]
    if unmapped:
        raise ModelConfigError(f"GGUF YaRN rope scaling with {', '.join(unmapped)} is not supported")
    # Without original_context_length the model is read as not extended, as for a config.json.
    original = fields.get(f"{key}.original_context_length") or context_length
    scaling = {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": int(original),
    }
    for gguf_name, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if fields.get(f"{key}.{gguf_name}") is not None:
            scaling[name] = float(fields[f"{key}.{gguf_name}"])
    return scaling


def config_from_gguf_fields(fields: dict[str, Any], token_embd_rows: int | None = None) -> ModelConfig:
    """Build from already-decoded GGUF metadata (``{key: value}``); config lives under ``<arch>.*`` keys."""
    gguf_arch = str(fields.get("general.architecture", ""))
    if gguf_arch not in _GGUF_ARCHES:
        raise ModelConfigError(
            f"unsupported GGUF architecture {gguf_arch!r}; supported: {', '.join(_GGUF_ARCHES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"{gguf_arch}.{key}", default)
        if value is None:
            raise ModelConfigError(f"GGUF metadata lacks {gguf_arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(fields.get(f"{gguf_arch}.attention.key_length") or hidden // heads)
    vocab = fields.get(f"{gguf_arch}.vocab_size")
    if vocab is None:
        tokens = fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else token_embd_rows
    if vocab is None:
        raise ModelConfigError("GGUF metadata states no vocabulary size")
    scaling = _rope_from_gguf(fields, gguf_arch, int(get("context_length", 2048)))
    eos = fields.get("tokenizer.ggml.eos_token_id")
    bos = fields.get("tokenizer.ggml.bos_token_id")
    num_layers = int(get("block_count"))
    moe = _moe_from_gguf(fields, gguf_arch, _GGUF_ARCHES[gguf_arch], num_layers)
    dense_ffn = fields.get(f"{gguf_arch}.feed_forward_length") or moe.get("moe_intermediate_size")
    if dense_ffn is None:
        raise ModelConfigError(f"GGUF metadata lacks {gguf_arch}.feed_forward_length")
    return ModelConfig(
        arch=moe.pop("arch", _GGUF_ARCHES[gguf_arch]),
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(fields.get(f"{gguf_arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        intermediate_size=int(dense_ffn),
        rope_theta=float(fields.get(f"{gguf_arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings=False,  # decided by the loader: no output.weight means tied
        qkv_bias=gguf_arch in ("qwen2", "qwen2moe"),
        qk_norm=gguf_arch in ("qwen3", "qwen3moe"),
        max_position_embeddings=int(get("context_length", 2048)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        **moe,
    )
