"""``serve`` over a real CPU worker process running a tiny random gpt-oss (alternating 12-token sliding-window
and full-attention layers, attention sinks, biased experts with the clamped SwiGLU, YaRN rope): concurrent
greedy requests through the engine, most of them longer than the window, produce exactly Hugging Face
transformers' greedy tokens; the worker states its two KV groups and the gpt-oss architecture."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc.aio
import pytest
import torch
import transformers
from e2e_procs import Daemon, generate_greedy, run_server

from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc

NEW_TOKENS = 12
WINDOW = 12
MODEL = dict(
    arch="gpt_oss", num_layers=4, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
    sliding_window=WINDOW, seed=13,
    rope_parameters={
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 32, "rope_theta": 150000.0,
    },
)  # fmt: skip


@pytest.fixture(scope="module")
def gpt_oss_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Path]]:
    from ominix_worker.testing import write_tiny_hf_model

    folder = write_tiny_hf_model(tmp_path_factory.mktemp("gpt_oss") / "gpt_oss", **MODEL)  # type: ignore[arg-type]
    # 16 blocks of 16 tokens per layer: the full-attention group holds only some of the 8 requests (up to
    # 3 blocks each) at once, so the others wait.
    with run_server(
        str(folder), tmp_path_factory.mktemp("logs"), num_workers=1, kv_cache_memory="256KiB"
    ) as d:
        yield d, folder


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_greedy_tokens_through_the_service_match_transformers(gpt_oss_daemon: tuple[Daemon, Path]) -> None:
    daemon, folder = gpt_oss_daemon
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 320, (n,), generator=generator).tolist() for n in (3, 9, 17, 33, 5, 21, 28, 12)
    ]
    ours = asyncio.run(generate_greedy(daemon.address, prompts, NEW_TOKENS, "gpt-oss"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert tokens == hf_greedy(reference, prompt, NEW_TOKENS)
    (backend,) = daemon.stub.ListBackends(engine_pb2.ListBackendsRequest(), timeout=5).backends
    assert backend.model.architecture == "GptOssForCausalLM"
    groups = [(g.kind, tuple(g.layer_indices), g.sliding_window) for g in backend.kv_groups]
    assert groups == [
        (common_pb2.ATTENTION_KIND_FULL, (1, 3), 0),
        (common_pb2.ATTENTION_KIND_SLIDING_WINDOW, (0, 2), WINDOW),
    ]


async def _generate_with_usage(address: str, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        request = engine_pb2.GenerateRequest(
            request_id=request_id,
            input_ids=engine_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
        )
        events = [e async for e in stub.Generate(request, timeout=300)]
    assert events[-1].WhichOneof("event") == "done", events[-1]
    (usage,) = [e.usage for e in events if e.HasField("usage")]
    return [t for e in events if e.HasField("token") for t in e.token.token_ids], usage.cached_tokens


def test_a_prefix_hit_past_the_window_gives_transformers_tokens(gpt_oss_daemon: tuple[Daemon, Path]) -> None:
    """A request sharing a 48-token prefix (four times the window) with a finished one reuses its cached
    blocks (the sliding group's only within the window) and still produces transformers' greedy tokens."""
    daemon, folder = gpt_oss_daemon
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 320, (48,), generator=generator).tolist()
    first = shared + torch.randint(3, 320, (5,), generator=generator).tolist()
    second = shared + torch.randint(3, 320, (9,), generator=generator).tolist()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens, _ = asyncio.run(_generate_with_usage(daemon.address, "prefix-a", first))
    assert tokens == hf_greedy(reference, first, NEW_TOKENS)
    tokens, cached = asyncio.run(_generate_with_usage(daemon.address, "prefix-b", second))
    assert cached >= 32, cached  # whole 16-token blocks of the shared prefix
    assert tokens == hf_greedy(reference, second, NEW_TOKENS)
