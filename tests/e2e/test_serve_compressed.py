"""``serve`` over a real CPU worker process running the compressed-attention reference model
(``dummy:bench/configs/compressed-tiny-config.json``: an 8-token window on every layer, compressed rows of 4
and 8 tokens): the worker states three KV groups, the engine serves them over real gRPC, and a prompt that
hits the prefix cache and concurrent greedy requests (whose prompts do not all fit the 32 blocks of the
window group at once, so some wait) produce exactly the tokens of a dense recomputation from the whole
history."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc.aio
import pytest
import torch
from e2e_procs import Daemon, run_server

from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc

CONFIG = Path(__file__).resolve().parents[2] / "bench" / "configs" / "compressed-tiny-config.json"
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    # Blocks of 4 tokens, 5 KV tensors (3 raw layers, 2 of rows) of 2 heads x 16 floats: 5,120 bytes a
    # block set, so 160 KiB is 32 blocks per group.
    with run_server(
        f"dummy:{CONFIG}",
        tmp_path_factory.mktemp("logs-compressed"),
        num_workers=1,
        kv_cache_memory="160KiB",
        extra_worker_args=["--block-size", "4"],
    ) as d:
        yield d


async def _generate(address: str, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], int]]:
    """Tokens and cached prompt tokens of each request, all sent at once."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)

        async def one(rid: str, prompt: list[int]) -> tuple[list[int], int]:
            request = engine_pb2.GenerateRequest(
                request_id=rid,
                input_ids=engine_pb2.TokenIds(ids=prompt),
                sampling=common_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
            )
            events = [e async for e in stub.Generate(request, timeout=300)]
            assert events[-1].WhichOneof("event") == "done", events[-1]
            (usage,) = [e.usage for e in events if e.HasField("usage")]
            return [t for e in events if e.HasField("token") for t in e.token.token_ids], usage.cached_tokens

        results = await asyncio.gather(*(one(rid, p) for rid, p in prompts.items()))
        return dict(zip(prompts, results, strict=True))


def test_the_worker_states_its_compressed_layout(daemon: Daemon) -> None:
    (backend,) = daemon.stub.ListBackends(engine_pb2.ListBackendsRequest(), timeout=5).backends
    assert backend.model.architecture == "LlamaCompressedForCausalLM"
    groups = [(g.kind, list(g.layer_indices), g.sliding_window, g.compress_ratio) for g in backend.kv_groups]
    assert groups == [
        (common_pb2.ATTENTION_KIND_SLIDING_WINDOW, [0, 1, 2], 8, 0),
        (common_pb2.ATTENTION_KIND_COMPRESSED, [1], 0, 4),
        (common_pb2.ATTENTION_KIND_COMPRESSED, [2], 0, 8),
    ]
    assert all(g.num_blocks == 32 and g.block_size == 4 for g in backend.kv_groups)


def test_greedy_tokens_through_the_service_equal_the_dense_recomputation(daemon: Daemon) -> None:
    from ominix_worker.models.compressed import LlamaCompressedForCausalLM
    from ominix_worker.models.compressed_dense import dense_greedy
    from ominix_worker.runner import build_runner

    generator = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 512, (40,), generator=generator).tolist()
    concurrent = {
        f"c{i}": torch.randint(3, 512, (n,), generator=generator).tolist()
        for i, n in enumerate((5, 19, 33, 47, 26, 61))
    }
    prompts = {"s0": shared + [7, 8, 9], "s1": shared + [11, 12, 13, 14, 15], **concurrent}
    ours = asyncio.run(_generate(daemon.address, {"s0": prompts["s0"]}))
    # Then alone: 32 of the 40 shared tokens are whole blocks of every group, cached by "s0".
    ours.update(asyncio.run(_generate(daemon.address, {"s1": prompts["s1"]})))
    assert ours["s1"][1] == 32
    ours.update(asyncio.run(_generate(daemon.address, concurrent)))

    # The same dummy weights in this process (drawn from the same seed), recomputed densely.
    model = build_runner(f"dummy:{CONFIG}", num_blocks=4, block_size=4).model
    assert isinstance(model, LlamaCompressedForCausalLM)
    for rid, prompt in prompts.items():
        assert ours[rid][0] == dense_greedy(model, prompt, NEW_TOKENS), rid
