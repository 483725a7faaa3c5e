"""Model implementations: one Llama-family module covers Llama 2/3/3.1, Qwen2/2.5, Qwen3, Mistral, SmolLM."""

from ominix_worker.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
