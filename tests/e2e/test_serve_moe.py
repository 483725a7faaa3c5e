"""``serve`` over a real CPU worker process running a mixture-of-experts model (tiny random Qwen3-MoE and
Qwen2-MoE): concurrent greedy requests through the engine produce exactly Hugging Face transformers' greedy
tokens, and the worker states the MoE architecture in its capability."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc.aio
import pytest
import torch
import transformers
from e2e_procs import Daemon, run_server

from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc

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


async def _generate_all(address: str, prompts: list[list[int]]) -> list[list[int]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)

        async def one(i: int, prompt: list[int]) -> list[int]:
            request = engine_pb2.GenerateRequest(
                request_id=f"moe-{i}",
                input_ids=engine_pb2.TokenIds(ids=prompt),
                sampling=common_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
            )
            events = [e async for e in stub.Generate(request, timeout=300)]
            assert events[-1].WhichOneof("event") == "done", events[-1]
            return [t for e in events if e.HasField("token") for t in e.token.token_ids]

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def test_greedy_tokens_through_the_service_match_transformers(moe_daemon: tuple[Daemon, Path]) -> None:
    daemon, folder = moe_daemon
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 320, (n,), generator=generator).tolist() for n in (3, 9, 17, 33, 5, 21, 28, 12)
    ]
    ours = asyncio.run(_generate_all(daemon.address, prompts))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert tokens == hf_greedy(reference, prompt, NEW_TOKENS)
    backends = daemon.stub.ListBackends(engine_pb2.ListBackendsRequest(), timeout=5)
    architectures = {b.model.architecture for b in backends.backends}
    assert architectures == {reference.config.architectures[0]}
