"""A stand-in for vLLM's offline API (``LLM``, ``SamplingParams``), just enough to run the bench scripts that drive
vLLM (bench/peer_vllm.py, peer_vllm_profile.py, moe_routing.py) on a CPU without it: a two-layer model with
RMSNorm weights and MoE routers, whose ``generate`` runs every router over a decode batch and hands the top-k ids
to ``triton_moe._prepare_expert_assignment``, as vLLM's Triton experts are handed them."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

EXPERTS, TOP_K, HIDDEN = 8, 2, 16


class SamplingParams:
    def __init__(self, max_tokens: int = 16, **_: Any) -> None:
        self.max_tokens = max_tokens


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.full((HIDDEN,), 1e-3))
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(2))


class LLM:
    def __init__(self, model: str, **options: Any) -> None:
        if not (Path(model) / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in {model}")
        if options.get("load_format") != "dummy":
            raise ValueError("the stand-in loads dummy weights only")
        print(f"stand-in LLM options: {sorted(options)}", flush=True)
        self.folder = Path(model)
        self.max_model_len = int(options.get("max_model_len", 2048))
        self.model = _Model()
        cache = types.SimpleNamespace(cache_dtype="auto", num_gpu_blocks=7, block_size=16)
        self.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(cache_config=cache))

    def apply_model(self, fn: Any) -> list[Any]:
        return [fn(self.model)]

    def generate(self, prompts: list[Any], params: SamplingParams, use_tqdm: bool = False) -> list[Any]:
        if not self.folder.is_dir():
            raise FileNotFoundError(f"the model folder {self.folder} was removed while the LLM is in use")
        from vllm.model_executor.layers.fused_moe.experts import triton_moe

        for prompt in prompts:  # as vLLM refuses a request its max_model_len cannot hold
            if len(prompt["prompt_token_ids"]) + params.max_tokens > self.max_model_len:
                raise ValueError(f"prompt + max_tokens exceeds max_model_len {self.max_model_len}")

        for _ in range(params.max_tokens):
            for layer in self.model.layers:
                hidden = torch.randn(len(prompts), HIDDEN) * layer.input_layernorm.weight
                ids = torch.topk(layer.mlp.gate(hidden), TOP_K).indices
                triton_moe._prepare_expert_assignment(ids)
        out = types.SimpleNamespace(token_ids=[0] * params.max_tokens)
        return [types.SimpleNamespace(outputs=[out]) for _ in prompts]
