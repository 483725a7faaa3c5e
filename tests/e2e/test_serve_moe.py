"""``serve`` over a real CPU worker process running a mixture-of-experts model (tiny random Qwen3-MoE and
Qwen2-MoE): concurrent greedy requests through the engine produce exactly Hugging Face transformers' greedy
tokens, and the worker states the MoE architecture in its capability. With ``--quantization fp8
--kv-cache-dtype fp8_e4m3`` the worker states FP8 weights and KV, sizes KV blocks at one byte per element, and
the service's greedy tokens equal the in-process FP8 runner's."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import transformers
from e2e_procs import Daemon, generate_greedy, run_server

from ominix_runtime.pb import engine_pb2

if TYPE_CHECKING:
    from ominix_worker.runner import ModelRunner

NEW_TOKENS = 12
MODELS = {
    "qwen3_moe": dict(
        arch="qwen3_moe", num_layers=3, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[1], seed=11,
    ),
    "qwen2_moe": dict(
        arch="qwen2_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, seed=12,
    ),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(MODELS))
def moe_daemon(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Daemon, Path]]:
    from ominix_worker.testing import write_tiny_hf_model

    folder = write_tiny_hf_model(
        tmp_path_factory.mktemp(request.param) / request.param, **MODELS[request.param]
    )
    # 8 (Qwen3-MoE) or 12 blocks of 16 tokens for 8 requests of up to 3 blocks each: the KV cache holds only
    # some of them at once, so the others wait (or are preempted and resume).
    with run_server(
        str(folder), tmp_path_factory.mktemp("logs"), num_workers=1, kv_cache_memory="96KiB"
    ) as d:
        yield d, folder


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_greedy_tokens_through_the_service_match_transformers(moe_daemon: tuple[Daemon, Path]) -> None:
    daemon, folder = moe_daemon
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 320, (n,), generator=generator).tolist() for n in (3, 9, 17, 33, 5, 21, 28, 12)
    ]
    ours = asyncio.run(generate_greedy(daemon.address, prompts, NEW_TOKENS, "moe"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert tokens == hf_greedy(reference, prompt, NEW_TOKENS)
    backends = daemon.stub.ListBackends(engine_pb2.ListBackendsRequest(), timeout=5)
    architectures = {b.model.architecture for b in backends.backends}
    assert architectures == {reference.config.architectures[0]}


def _runner_greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData, SamplingParams

    runner.reset()
    greedy = SamplingParams(temperature=0.0)
    blocks = list(range(-(-(len(prompt) + n) // 16)))
    result = runner.execute_step(
        DecodeStep(1, new_requests=[NewRequestData("r", prompt, greedy, blocks, 0, len(prompt), 0)])
    )
    tokens = [result.outputs[0].sampled_token_id]
    for step_id in range(2, n + 1):
        result = runner.execute_step(DecodeStep(step_id, running_requests=[RunningRequestData("r", [], 1)]))
        tokens.append(result.outputs[0].sampled_token_id)
    return tokens


def test_fp8_weights_and_kv_through_the_service(tmp_path_factory: pytest.TempPathFactory) -> None:
    from ominix_worker.runner import build_runner
    from ominix_worker.testing import write_tiny_hf_model

    folder = write_tiny_hf_model(tmp_path_factory.mktemp("fp8") / "qwen3_moe", **MODELS["qwen3_moe"])
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (4, 19, 30, 11)]
    fp8_args = ["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"]
    logs = tmp_path_factory.mktemp("logs-fp8")
    with run_server(
        str(folder), logs, num_workers=1, kv_cache_memory="96KiB", extra_worker_args=fp8_args
    ) as d:
        ours = asyncio.run(generate_greedy(d.address, prompts, NEW_TOKENS, "moe"))
        (cap,) = d.stub.ListBackends(engine_pb2.ListBackendsRequest(), timeout=5).backends
    assert (cap.weight_dtype, cap.kv_cache_dtype, cap.dtype) == ("float8_e4m3fn", "fp8_e4m3", "float32")
    assert cap.supports_fp8_kv and cap.model.num_experts == 16 and cap.model.num_experts_per_tok == 4
    model = cap.model
    assert cap.kv_bytes_per_block == 2 * model.num_layers * 16 * model.num_kv_heads * model.head_dim
    assert cap.kv_num_blocks == 96 * 1024 // cap.kv_bytes_per_block
    runner = build_runner(str(folder), num_blocks=16, quantization="fp8", kv_cache_dtype="fp8_e4m3")
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert tokens == _runner_greedy(runner, prompt, NEW_TOKENS)
