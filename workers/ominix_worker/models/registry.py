"""Which module class runs a model: architectures with their own layer structure by name, the rest by shape
(the MoE decoder for sparse Llama-family models, else the dense one)."""

from __future__ import annotations

from ominix_worker.config import ModelConfig
from ominix_worker.models.compressed import LlamaCompressedForCausalLM
from ominix_worker.models.gemma3 import Gemma3ForCausalLM
from ominix_worker.models.gpt_oss import GptOssForCausalLM
from ominix_worker.models.llama import LlamaForCausalLM
from ominix_worker.models.moe import model_class as llama_family_class

_BY_ARCH: dict[str, type[LlamaForCausalLM]] = {
    "gemma3_text": Gemma3ForCausalLM,
    "llama_compressed": LlamaCompressedForCausalLM,
    "gpt_oss": GptOssForCausalLM,
}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The module class that runs ``config``."""
    return _BY_ARCH.get(config.arch) or llama_family_class(config)


__all__ = ["model_class"]
