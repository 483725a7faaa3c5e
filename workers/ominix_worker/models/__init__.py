"""Model implementations: one Llama-family module covers Llama 2/3/3.1, Qwen2/2.5, Qwen3, Mistral, SmolLM;
its MoE subclass covers Qwen3-MoE, Qwen2-MoE and Mixtral, and gpt-oss extends that (sinks, biased experts);
Gemma 3 text extends it with its own layers."""

from ominix_worker.models.gemma3 import Gemma3ForCausalLM
from ominix_worker.models.gpt_oss import GptOssForCausalLM
from ominix_worker.models.llama import LlamaForCausalLM
from ominix_worker.models.moe import MoeForCausalLM
from ominix_worker.models.registry import model_class

__all__ = ["Gemma3ForCausalLM", "GptOssForCausalLM", "LlamaForCausalLM", "MoeForCausalLM", "model_class"]
