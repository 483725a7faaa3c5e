"""A TP=2 worker group (two gloo rank processes) behind a real `serve` engine: the same greedy tokens as TP=1
through the whole service (prefix hits, preemption), and what happens when rank 1 is killed mid-stream."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fault_procs import (
    CLI,
    Engine,
    Proc,
    free_ports,
    metric_value,
    start_proc_env,
    stop_procs,
    stream_one,
    wait_health,
    worker_argv,
)

from ominix_runtime.contract import (
    DecodeStep,
    NewRequestData,
    RunningRequestData,
    RuntimeErrorKind,
    SamplingParams,
)
from ominix_runtime.pb import common_pb2, engine_pb2

STEP_TIMEOUT_S = 3.0
DIST_TIMEOUT_S = 5.0
GREEDY_TOKENS = 24
# 24 blocks of 16 tokens per rank: eight requests of ~60 tokens need ~32, so some are preempted.
SMALL_KV = "96KiB"
GROUP_FAILURE_EXIT_CODE = 3


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ominix_worker.testing import write_tiny_hf_model

    return write_tiny_hf_model(tmp_path_factory.mktemp("tp-model") / "tiny", arch="llama", vocab_size=320)


def prompt(i: int, length: int) -> list[int]:
    return [3 + (i * 13 + k * 7) % 250 for k in range(length)]


def greedy_reference(model: Path, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Greedy tokens of each prompt from an in-process TP=1 runner, one request at a time."""
    from ominix_worker.runner import build_runner

    runner = build_runner(str(model), num_blocks=64, block_size=16)
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
            tokens.append(result.outputs[0].sampled_token_id)  # type: ignore[arg-type]
        out.append(tokens)
    return out


def request(rid: str, ids: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0):  # noqa: ANN201
    return engine_pb2.GenerateRequest(
        request_id=rid,
        input_ids=engine_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True
        ),
        deadline_ms=120_000,
    )


@contextlib.contextmanager
def start_tp_engine(
    model: Path, log_dir: Path, *, kv_cache_memory: str = "8MiB", with_single_worker: bool = False
) -> Iterator[tuple[Engine, list[Proc]]]:
    """Ranks 0 and 1 of one group (rank 0 at worker_addresses[0]), optionally a TP=1 worker, and the engine.

    Yields the engine and the group's rank processes [rank 0, rank 1].
    """
    leader_port, dist_port, single_port, port, metrics_port = free_ports(5)
    group = [
        "--tp-size",
        "2",
        "--dist-init-addr",
        f"127.0.0.1:{dist_port}",
        "--dist-timeout",
        str(DIST_TIMEOUT_S),
    ]
    group += ["--kv-cache-memory", kv_cache_memory]
    procs: list[Proc] = []
    try:
        for rank in (1, 0):  # either order forms the group; rank 1 first shows it waits for its leader
            argv = worker_argv(str(model), leader_port, extra=[*group, "--tp-rank", str(rank)])
            procs.append(start_proc_env(f"rank{rank}", argv, log_dir, {}))
        procs.reverse()
        addresses = [f"127.0.0.1:{leader_port}"]
        if with_single_worker:
            procs.append(start_proc_env("single", worker_argv(str(model), single_port), log_dir, {}))
            addresses.append(f"127.0.0.1:{single_port}")
        serve = [
            *CLI,
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
        ]
        for a in addresses:
            serve += ["--worker", a]
        procs.append(start_proc_env("engine", serve, log_dir, {"OMINIX_STEP_TIMEOUT_S": str(STEP_TIMEOUT_S)}))
        address = f"127.0.0.1:{port}"
        wait_health(address, procs)
        import grpc

        with grpc.insecure_channel(address) as channel:
            engine = Engine(address, procs, addresses, channel, f"http://127.0.0.1:{metrics_port}/metrics")
            yield engine, procs[:2]
    finally:
        stop_procs(procs[::-1])


def test_group_states_both_ranks(tiny_model: Path, tmp_path: Path) -> None:
    with start_tp_engine(tiny_model, tmp_path, kv_cache_memory="4MiB") as (engine, _):
        (backend,) = engine.stub.ListBackends(engine_pb2.ListBackendsRequest(), timeout=5).backends
        assert backend.tensor_parallel_size == 2 and backend.collective_backend == "gloo"
        assert [r.rank for r in backend.ranks] == [0, 1]
        # two KV heads: one per rank; the block count holds on both, each rank's KV is its budget
        assert [(r.kv_head_start, r.kv_num_heads) for r in backend.ranks] == [(0, 1), (1, 1)]
        assert all(
            r.kv_cache_bytes == backend.kv_num_blocks * backend.kv_bytes_per_block // 2 for r in backend.ranks
        )
        assert all(0 < r.kv_cache_bytes <= 4 * 2**20 and r.weight_bytes > 0 for r in backend.ranks)


def test_tp2_service_gives_tp1_greedy_tokens_with_prefix_hits_and_preemption(
    tiny_model: Path, tmp_path: Path
) -> None:
    prompts = [prompt(i, 36 + i % 5) for i in range(8)]
    reference = greedy_reference(tiny_model, prompts, GREEDY_TOKENS)
    with start_tp_engine(tiny_model, tmp_path, kv_cache_memory=SMALL_KV) as (engine, _):
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(
                pool.map(
                    lambda i: stream_one(engine.stub, request(f"p{i}", prompts[i], GREEDY_TOKENS), 120),
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
            for ev in engine.stub.Generate(request(attempt, prompts[0], GREEDY_TOKENS), timeout=120):
                if ev.WhichOneof("event") == "usage":
                    usage = ev.usage
                elif ev.WhichOneof("event") == "token":
                    tokens.extend(ev.token.token_ids)
            assert tokens == reference[0], attempt
        assert usage is not None and usage.cached_tokens >= 32


def _seeded(i: int) -> engine_pb2.GenerateRequest:
    return request(f"s{i}", prompt(i, 12 + i % 5), 150, temperature=0.8, seed=500 + i)


def _kill_rank_1_mid_stream(engine: Engine, ranks: list[Proc], num_streams: int):  # noqa: ANN202
    from fault_procs import Outcome

    outcomes = [Outcome(f"s{i}") for i in range(num_streams)]
    with ThreadPoolExecutor(num_streams) as pool:
        futures = [
            pool.submit(stream_one, engine.stub, _seeded(i), 120, outcomes[i]) for i in range(num_streams)
        ]
        for out in outcomes:
            assert out.first_token.wait(60), engine.logs()
        killed_at = time.monotonic()
        os.kill(ranks[1].popen.pid, signal.SIGKILL)
        results = [f.result() for f in futures]
    # The leader notices its peer is gone and leaves too: no half-alive group.
    code = ranks[0].popen.wait(timeout=DIST_TIMEOUT_S + 10)
    assert code == GROUP_FAILURE_EXIT_CODE, ranks[0].log_tail()
    return results, time.monotonic() - killed_at


def test_killing_rank_1_fails_its_requests_over_to_another_group(tiny_model: Path, tmp_path: Path) -> None:
    num_streams = 6
    with start_tp_engine(tiny_model, tmp_path, with_single_worker=True) as (engine, ranks):
        with ThreadPoolExecutor(num_streams) as pool:
            reference = list(pool.map(lambda i: stream_one(engine.stub, _seeded(i), 120), range(num_streams)))
        assert all(r.done is not None for r in reference), engine.logs()
        results, _ = _kill_rank_1_mid_stream(engine, ranks, num_streams)
        for ref, out in zip(reference, results, strict=True):
            assert out.status is None and out.num_terminal == 1, f"{out}\n{engine.logs()}"
            assert out.done is not None, f"{out.request_id}: {out.error}\n{engine.logs()}"
            # seeded sampling resumes identically on the other group
            assert out.tokens == ref.tokens, out.request_id


def test_killing_rank_1_of_the_only_group_ends_requests_unavailable(tiny_model: Path, tmp_path: Path) -> None:
    num_streams = 4
    with start_tp_engine(tiny_model, tmp_path) as (engine, ranks):
        results, seconds = _kill_rank_1_mid_stream(engine, ranks, num_streams)
        for out in results:
            assert out.status is None and out.num_terminal == 1, f"{out}\n{engine.logs()}"
            assert out.error is not None and out.error.code == int(RuntimeErrorKind.BACKEND_UNAVAILABLE), out
        assert seconds < STEP_TIMEOUT_S + DIST_TIMEOUT_S + 10
