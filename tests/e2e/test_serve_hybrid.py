"""``serve`` over a real CPU worker process running Gemma 3 text (tiny random, five 12-token-window local
layers per global one): the worker states one KV group per layer kind and sizes their pools apart, and
concurrent greedy requests that decode well past the window produce exactly Hugging Face transformers'
greedy tokens through real gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from e2e_procs import Daemon, generate_greedy, run_server

from ominix_runtime.pb import common_pb2, engine_pb2

NEW_TOKENS = 20
WINDOW = 12
# 6 layers × 16 tokens × 2 KV heads × 16 dims × 2 (K and V) × 4 bytes.
BYTES_PER_BLOCK = 6 * 16 * 2 * 16 * 2 * 4
UNIFORM_BLOCKS = 24
MAX_RUNNING = 4
MAX_BATCH_TOKENS = 32


@pytest.fixture(scope="module")
def gemma_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Path]]:
    from ominix_worker.testing import write_tiny_hf_model

    folder = write_tiny_hf_model(
        tmp_path_factory.mktemp("gemma3") / "gemma3",
        arch="gemma3_text",
        num_layers=6,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        tie_word_embeddings=True,
        seed=21,
    )
    limits = ["--max-running-requests", str(MAX_RUNNING), "--max-batch-tokens", str(MAX_BATCH_TOKENS)]
    with run_server(
        str(folder),
        tmp_path_factory.mktemp("logs-gemma3"),
        num_workers=1,
        kv_cache_memory=str(UNIFORM_BLOCKS * BYTES_PER_BLOCK),
        extra_worker_args=limits,
        extra_serve_args=limits,
    ) as d:
        yield d, folder


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_the_worker_states_a_group_per_layer_kind(gemma_daemon: tuple[Daemon, Path]) -> None:
    daemon, _ = gemma_daemon
    (cap,) = daemon.stub.ListBackends(engine_pb2.ListBackendsRequest(), timeout=5).backends
    assert cap.model.architecture == "Gemma3ForCausalLM"
    full, sliding = cap.kv_groups
    assert full.kind == common_pb2.ATTENTION_KIND_FULL and list(full.layer_indices) == [5]
    assert sliding.kind == common_pb2.ATTENTION_KIND_SLIDING_WINDOW
    assert list(sliding.layer_indices) == [0, 1, 2, 3, 4] and sliding.sliding_window == WINDOW
    # The sliding pool holds what 4 running windows and one step need (4 × (1 + 2) + 2 blocks) plus room to
    # keep slid-out blocks cached (a tenth of the memory over five layers: 24 × 6 / 10 / 5 → 2); the memory
    # its five layers save goes to the global layer: 24 × 6 - 16 × 5 = 64 blocks.
    assert sliding.num_blocks == MAX_RUNNING * 3 + MAX_BATCH_TOKENS // 16 + 2 == 16
    assert full.num_blocks == UNIFORM_BLOCKS * 6 - 16 * 5 == cap.kv_num_blocks
    assert cap.model.max_model_len >= 64
    # The load report counts each group's blocks at its layers' bytes: the worker's whole KV memory.
    (load,) = daemon.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5).backends
    assert load.kv_bytes_capacity == UNIFORM_BLOCKS * BYTES_PER_BLOCK


def test_greedy_tokens_through_the_service_match_transformers(gemma_daemon: tuple[Daemon, Path]) -> None:
    daemon, folder = gemma_daemon
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (5, 13, 30, 41, 9, 22)]
    ours = asyncio.run(generate_greedy(daemon.address, prompts, NEW_TOKENS, "gemma"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert tokens == hf_greedy(reference, prompt, NEW_TOKENS)
