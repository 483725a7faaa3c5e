"""A TP=2 worker group (two gloo rank processes) behind a real `serve` engine: the same greedy tokens as TP=1
through the whole service (prefix hits, preemption), and what happens when rank 1 is killed mid-stream."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fault_procs import metric_value, stream_one
from tp_procs import DIST_TIMEOUT_S, STEP_TIMEOUT_S, kill_a_rank_mid_stream, request, seeded, start_tp_engine

from ominix_runtime.contract import (
    DecodeStep,
    NewRequestData,
    RunningRequestData,
    RuntimeErrorKind,
    SamplingParams,
)
from ominix_runtime.pb import engine_pb2

GREEDY_TOKENS = 24
# 24 blocks of 16 tokens per rank. Eight prompts of 36-40 tokens take 3 blocks each; with 64 outputs each request
# grows to 7 blocks, so any four of them running together outgrow the cache and one is preempted, however the
# arrivals spread (with 24 outputs, 4 blocks each, six admitted at once fit and none had to be).
SMALL_KV = ("--kv-cache-memory", "96KiB")
PREEMPTING_TOKENS = 64


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ominix_worker.testing import write_tiny_hf_model

    return write_tiny_hf_model(tmp_path_factory.mktemp("tp-model") / "tiny", arch="llama", vocab_size=320)


def prompt(i: int, length: int) -> list[int]:
    return [3 + (i * 13 + k * 7) % 250 for k in range(length)]


def greedy_reference(
    model: Path, prompts: list[list[int]], num_tokens: int, device: str = "cpu", dtype: str = "float32"
) -> list[list[int]]:
    """Greedy tokens of each prompt from an in-process TP=1 runner, one request at a time."""
    import torch

    from ominix_worker.runner import build_runner

    runner = build_runner(
        str(model), device=device, dtype=getattr(torch, dtype), num_blocks=64, block_size=16
    )
    out = []
    for ids in prompts:
        runner.reset()
        blocks = list(range(-(-(len(ids) + num_tokens) // 16)))
        greedy = SamplingParams(temperature=0.0, max_tokens=num_tokens)
        step = DecodeStep(1, new_requests=[NewRequestData("r", list(ids), greedy, blocks, 0, len(ids), 0)])
        tokens: list[int] = []
        for step_id in range(1, num_tokens + 1):
            if step_id > 1:
                step = DecodeStep(step_id, running_requests=[RunningRequestData("r", [], 1)])
            result = runner.execute_step(step)
            assert result is not None
            tokens.append(result.outputs[0].sampled_token_id)  # type: ignore[arg-type]  # every step samples here
        out.append(tokens)
    return out


def test_tp2_service_states_its_ranks_and_gives_tp1_greedy_tokens_with_prefix_hits_and_preemption(
    tiny_model: Path, tmp_path: Path
) -> None:
    prompts = [prompt(i, 36 + i % 5) for i in range(8)]
    reference = greedy_reference(tiny_model, prompts, PREEMPTING_TOKENS)
    with start_tp_engine(str(tiny_model), tmp_path, worker_args=SMALL_KV) as (engine, _):
        (backend,) = engine.stub.ListBackends(engine_pb2.ListBackendsRequest(), timeout=5).backends
        assert backend.tensor_parallel_size == 2 and backend.collective_backend == "gloo"
        assert [r.rank for r in backend.ranks] == [0, 1]
        # two KV heads, one per rank; the block count holds on both and each rank's KV fits its budget
        assert [(r.kv_head_start, r.kv_num_heads) for r in backend.ranks] == [(0, 1), (1, 1)]
        for r in backend.ranks:
            assert r.kv_cache_bytes == backend.kv_num_blocks * backend.kv_bytes_per_block // 2
            assert 0 < r.kv_cache_bytes <= 96 * 1024 and r.weight_bytes > 0
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(
                pool.map(
                    lambda i: stream_one(engine.stub, request(f"p{i}", prompts[i], PREEMPTING_TOKENS), 120),
                    range(len(prompts)),
                )
            )
        for i, out in enumerate(outs):
            assert out.status is None and out.done is not None, f"{out}\n{engine.logs()}"
            assert out.tokens == reference[i], f"request {i}"
        preemptions = metric_value(engine.metrics_url, "ominix_preemptions_total")
        assert preemptions > 0, "the small KV cache should have forced a preemption"
        # A prompt run twice in a row: the second run's full blocks come from the prefix cache (the small
        # cache may have evicted the first batch's), and its tokens stay the same.
        for attempt in ("warm", "again"):
            tokens: list[int] = []
            usage = None
            for ev in engine.stub.Generate(request(attempt, prompts[0], PREEMPTING_TOKENS), timeout=120):
                if ev.WhichOneof("event") == "usage":
                    usage = ev.usage
                elif ev.WhichOneof("event") == "token":
                    tokens.extend(ev.token.token_ids)
            assert tokens == reference[0], attempt
        assert usage is not None and usage.cached_tokens >= 32


def test_killing_rank_1_fails_its_requests_over_to_another_group(tiny_model: Path, tmp_path: Path) -> None:
    num_streams = 6
    with start_tp_engine(str(tiny_model), tmp_path, single_device="cpu") as (engine, ranks):
        with ThreadPoolExecutor(num_streams) as pool:
            reference = list(pool.map(lambda i: stream_one(engine.stub, seeded(i), 120), range(num_streams)))
        assert all(r.done is not None for r in reference), engine.logs()
        results, _ = kill_a_rank_mid_stream(engine, ranks, 1, [seeded(i) for i in range(num_streams)])
        for ref, out in zip(reference, results, strict=True):
            assert out.status is None and out.num_terminal == 1, f"{out}\n{engine.logs()}"
            assert out.done is not None, f"{out.request_id}: {out.error}\n{engine.logs()}"
            # seeded sampling resumes identically on the other group
            assert out.tokens == ref.tokens, out.request_id


def test_killing_rank_1_of_the_only_group_ends_requests_unavailable(tiny_model: Path, tmp_path: Path) -> None:
    num_streams = 4
    with start_tp_engine(str(tiny_model), tmp_path) as (engine, ranks):
        results, seconds = kill_a_rank_mid_stream(engine, ranks, 1, [seeded(i) for i in range(num_streams)])
        for out in results:
            assert out.status is None and out.num_terminal == 1, f"{out}\n{engine.logs()}"
            assert out.error is not None and out.error.code == int(RuntimeErrorKind.BACKEND_UNAVAILABLE), out
        assert seconds < STEP_TIMEOUT_S + DIST_TIMEOUT_S + 10


def test_a_hung_rank_takes_its_group_down_within_the_timeouts(tiny_model: Path, tmp_path: Path) -> None:
    num_streams = 4
    with start_tp_engine(str(tiny_model), tmp_path) as (engine, ranks):
        try:
            results, seconds = kill_a_rank_mid_stream(
                engine, ranks, 1, [seeded(i) for i in range(num_streams)], signal.SIGSTOP
            )
        finally:
            ranks[1].popen.kill()
        for out in results:
            assert out.status is None and out.num_terminal == 1, f"{out}\n{engine.logs()}"
            assert out.error is not None and out.error.code == int(RuntimeErrorKind.BACKEND_UNAVAILABLE), out
        # the engine's step timeout ends the requests; the leader's collective timeout ends the group
        assert seconds < STEP_TIMEOUT_S + 10
