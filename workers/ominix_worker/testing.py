"""Test helpers: tiny random Hugging Face model folders written with transformers' own classes.

The folders hold ``config.json``, ``model.safetensors`` and a byte-level tokenizer (``tokenizer.json`` and
``tokenizer_config.json`` with a small chat template), so both the worker (weights) and the engine
(tokenizer) can load them. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_ARCHES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "mistral",
    "gemma3_text",
    "gpt_oss",
)
PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
_FIRST_BYTE_TOKEN_ID = 3
MIN_VOCAB_SIZE = _FIRST_BYTE_TOKEN_ID + 256

CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (what the ByteLevel pre-tokenizer uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def write_tiny_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE without merges: ids 0-2 are pad/bos/eos, 3-258 the bytes, the rest unused fillers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"the tiny tokenizer needs vocab_size >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    vocab: dict[str, int] = {"<pad>": PAD_TOKEN_ID, "<s>": BOS_TOKEN_ID, "</s>": EOS_TOKEN_ID}
    for b, ch in sorted(_bytes_to_unicode().items()):
        vocab[ch] = _FIRST_BYTE_TOKEN_ID + b
    for i in range(MIN_VOCAB_SIZE, vocab_size):
        vocab[f"<extra_{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=4096
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def tiny_config_kwargs(
    arch: str,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    heads: int,
    kv_heads: int,
    tie_word_embeddings: bool,
    max_position_embeddings: int,
) -> dict[str, Any]:
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        tie_word_embeddings=tie_word_embeddings,
    )


def write_tiny_hf_model(
    path: str | Path,
    arch: str = "llama",
    vocab_size: int = 320,
    hidden_size: int = 64,
    num_layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 1024,
    initializer_range: float = 0.08,
    with_tokenizer: bool = True,
    **config_overrides: Any,
) -> Path:
    """Write a random ``arch`` model (see ``_ARCHES``) to ``path`` and return the folder.

    ``initializer_range`` is larger than the usual 0.02 so that logits are far from uniform and greedy
    decoding is stable under float rounding. ``config_overrides`` go to the transformers config (e.g.
    ``rope_parameters`` for Llama 3.1 scaling, ``num_experts`` for MoE models).
    """
    import torch
    import transformers

    if arch not in _ARCHES:
        raise ValueError(f"arch must be one of {_ARCHES}, got {arch!r}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = tiny_config_kwargs(
        arch,
        vocab_size,
        hidden_size,
        num_layers,
        heads,
        kv_heads,
        tie_word_embeddings,
        max_position_embeddings,
    )
    kwargs["initializer_range"] = initializer_range
    kwargs.update(config_overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }[arch]
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        # Random norm weights and biases, so that a missing norm or bias shows up in the logits.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                # Gemma's norms scale by 1 + weight: the same spread around a unit scale.
                centre = 0.0 if arch == "gemma3_text" else 1.0
                param.copy_(centre + 0.1 * torch.randn_like(param))
            elif name.endswith((".bias", "_proj_bias")):  # gpt-oss's experts name theirs *_proj_bias
                param.copy_(0.1 * torch.randn_like(param))
            elif name.endswith("self_attn.sinks"):  # gpt-oss: sinks on the scale of the attention scores
                param.copy_(torch.randn_like(param))
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight", "shared_expert_gate.weight")):
                # Routers start at zero in some classes: random ones make every expert matter.
                param.copy_(0.5 * torch.randn_like(param))
    model.save_pretrained(str(folder), safe_serialization=True)
    if with_tokenizer and vocab_size >= MIN_VOCAB_SIZE:
        write_tiny_tokenizer(folder, vocab_size)
    return folder


# Checkpoint tensors an FP8 checkpoint stores in e4m3: attention and MLP projections, experts included.
_FP8_WEIGHT_SUFFIXES = (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight",
    "down_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight",
)  # fmt: skip


def write_fp8_checkpoint(
    source: str | Path, target: str | Path, granularity: str = "block", block: int = 16
) -> Path:
    """Quantize the Hugging Face folder ``source`` into an FP8 checkpoint at ``target`` as FP8 checkpoints
    ship them: e4m3 projections with ``weight_scale_inv`` per (block × block) tile and ``weight_block_size``
    (granularity "block"), or ``weight_scale`` per output row ("channel") or per tensor ("tensor"); the rest
    is copied. Returns ``target``; ``target/dequantized`` holds the same weights dequantized (the checkpoint's
    exact values in float32, loadable by transformers)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from ominix_worker.quant.fp8 import dequantize_fp8, quantize_fp8_blocks

    src, dst = Path(source), Path(target)
    dequantized_dir = dst / "dequantized"
    dequantized_dir.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors"):
            shutil.copy(file, dst / file.name)
            shutil.copy(file, dequantized_dir / file.name)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not name.endswith(_FP8_WEIGHT_SUFFIXES):
            quantized[name] = dequantized[name] = tensor
            continue
        rows, cols = tensor.shape
        tile = {"block": (block, block), "channel": (1, cols), "tensor": (rows, cols)}[granularity]
        q, scale = quantize_fp8_blocks(tensor, tile)
        quantized[name] = q
        base = name.removesuffix(".weight")
        if granularity == "block":
            quantized[f"{base}.weight_scale_inv"] = scale
        else:
            quantized[f"{base}.weight_scale"] = scale.reshape(()) if granularity == "tensor" else scale
        dequantized[name] = dequantize_fp8(q, scale, tile, torch.float32)
    save_file(quantized, str(dst / "model.safetensors"))
    save_file(dequantized, str(dequantized_dir / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if granularity == "block":
        config["quantization_config"]["weight_block_size"] = [block, block]
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst


def check_fast_launches() -> None:
    """Tests: every fast Triton launch (ominix_worker.ops.launch) also asks Triton which kernel it would launch
    for the same arguments, and fails if another. Nothing without Triton."""
    try:
        from ominix_worker.ops import launch
    except ImportError:
        return
    launch.CHECK_AGAINST_TRITON = True


__all__ = [
    "check_fast_launches",
    "write_fp8_checkpoint",
    "write_tiny_hf_model",
    "write_tiny_tokenizer",
    "BOS_TOKEN_ID",
    "EOS_TOKEN_ID",
    "PAD_TOKEN_ID",
    "MIN_VOCAB_SIZE",
    "CHAT_TEMPLATE",
]
