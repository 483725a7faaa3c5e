"""Model implementations: one Llama-family module covers Llama 2/3/3.1, Qwen2/2.5, Qwen3, Mistral, SmolLM;
its MoE subclass covers Qwen3-MoE, Qwen2-MoE and Mixtral."""

from ominix_worker.models.llama import LlamaForCausalLM
from ominix_worker.models.moe import MoeForCausalLM, model_class

__all__ = ["LlamaForCausalLM", "MoeForCausalLM", "model_class"]
