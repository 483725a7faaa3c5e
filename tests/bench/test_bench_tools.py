"""Bench tools: metric math on synthetic timings, and bench/serve.py's client against a real gRPC server.

The server here is a small in-process ``Engine`` servicer on a loopback port that streams a known number of
tokens, so every count the client reports can be checked exactly. Performance is never asserted.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import free_port, percentile, summarize_seconds, to_jsonable, write_plot  # noqa: E402
from bench.serve import (  # noqa: E402
    BenchConfig,
    ModelFacts,
    RequestResult,
    arrival_delays,
    build_random_requests,
    compute_metrics,
    meets_slos,
    run_benchmark,
    throughput_timeline,
)
from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc  # noqa: E402


def _result(index: int, send: float, chunks: list[float], tokens_per_chunk: int = 1) -> RequestResult:
    result = RequestResult(index=index, request_id=f"r{index}", send_time=send)
    result.chunk_times = list(chunks)
    result.chunk_tokens = [tokens_per_chunk] * len(chunks)
    result.first_token_time = chunks[0] if chunks else None
    result.end_time = chunks[-1] if chunks else send
    result.output_tokens = tokens_per_chunk * len(chunks)
    result.prompt_tokens = 10
    result.success = bool(chunks)
    return result


def test_percentile_matches_numpy_linear_interpolation() -> None:
    rng = np.random.default_rng(3)
    for size in (1, 2, 7, 100):
        values = rng.exponential(size=size).tolist()
        for q in (0, 25, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summary_is_in_milliseconds() -> None:
    summary = summarize_seconds([0.010, 0.020, 0.030])
    assert summary.count == 3
    assert summary.mean_ms == pytest.approx(20.0)
    assert summary.median_ms == pytest.approx(20.0)
    assert summary.max_ms == pytest.approx(30.0)
    assert summarize_seconds([]).count == 0


def test_ttft_tpot_itl_e2el_of_one_request() -> None:
    result = _result(0, send=1.0, chunks=[1.1, 1.15, 1.25])
    assert result.ttft_s == pytest.approx(0.1)
    assert result.e2el_s == pytest.approx(0.25)
    # TPOT = (E2EL - TTFT) / (output - 1)
    assert result.tpot_s == pytest.approx((0.25 - 0.1) / 2)
    assert result.itls_s == pytest.approx([0.05, 0.1])
    # Chunks of several tokens: ITL is per chunk, TPOT per token.
    multi = _result(1, send=0.0, chunks=[0.2, 0.4], tokens_per_chunk=4)
    assert multi.itls_s == pytest.approx([0.2])
    assert multi.tpot_s == pytest.approx((0.4 - 0.2) / 7)
    assert _result(2, send=0.0, chunks=[0.3]).tpot_s is None


def test_aggregate_metrics_and_goodput() -> None:
    fast = _result(0, send=0.0, chunks=[0.1, 0.2, 0.3])  # TTFT 100 ms, TPOT 100 ms
    slow_start = _result(1, send=0.0, chunks=[0.5, 0.52, 0.54])  # TTFT 500 ms, TPOT 20 ms
    failed = RequestResult(index=2, request_id="r2", error="ERROR_CODE_INTERNAL: boom")
    results = [fast, slow_start, failed]
    metrics = compute_metrics(results, duration_s=2.0, slo_ttft_ms=200.0)
    assert metrics.completed == 2 and metrics.failed == 1
    assert metrics.total_output_tokens == 6 and metrics.total_input_tokens == 20
    assert metrics.output_throughput == pytest.approx(3.0)
    assert metrics.total_token_throughput == pytest.approx(13.0)
    assert metrics.request_throughput == pytest.approx(1.0)
    assert metrics.good_requests == 1 and metrics.goodput == pytest.approx(0.5)
    assert metrics.ttft.mean_ms == pytest.approx(300.0)
    assert metrics.itl.count == 4
    assert meets_slos(slow_start, None, 50.0, None) and not meets_slos(fast, None, 50.0, None)
    assert not meets_slos(failed, None, None, None)
    assert compute_metrics(results, duration_s=2.0).goodput is None


def test_timeline_bins_tokens_and_finished_requests() -> None:
    results = [_result(0, 0.0, [0.1, 0.6, 1.1]), _result(1, 0.0, [0.2, 1.9])]
    timeline = throughput_timeline(results, duration_s=2.0, bin_s=0.5)
    assert timeline.starts_s == [0.0, 0.5, 1.0, 1.5]
    assert timeline.output_tokens_per_s == [4.0, 2.0, 2.0, 2.0]
    assert timeline.finished_requests_per_s == [0.0, 0.0, 2.0, 2.0]


def test_random_prompts_distinct_with_shared_prefix_and_no_special_ids() -> None:
    facts = ModelFacts("m", vocab_size=64, special_ids=frozenset({0, 1, 2}), max_model_len=4096)
    config = BenchConfig(num_requests=20, input_len=30, output_len=8, range_ratio=0.5, shared_prefix_len=5)
    requests = build_random_requests(config, facts)
    prefixes = {tuple(r.prompt_ids[:5]) for r in requests}
    assert len(prefixes) == 1
    assert len({r.prompt_ids[5] for r in requests}) == 20  # distinct first token after the prefix
    assert all(not ({0, 1, 2} & set(r.prompt_ids)) for r in requests)
    assert all(15 <= len(r.prompt_ids) - 5 <= 45 and 4 <= r.max_tokens <= 12 for r in requests)
    assert [r.prompt_ids for r in build_random_requests(config, facts)] == [r.prompt_ids for r in requests]


def test_arrival_delays() -> None:
    assert arrival_delays(4, math.inf, 1.0, 0) == [0.0] * 4
    delays = arrival_delays(2000, rate=50.0, burstiness=0.5, seed=0)
    assert all(d >= 0 for d in delays)
    # The draws are scaled so the last request arrives at exactly N / rate (as `vllm bench serve` does).
    assert sum(delays) == pytest.approx(2000 / 50.0, rel=1e-9)
    assert sum(arrival_delays(60, rate=4.0, burstiness=1.0, seed=7)) == pytest.approx(15.0, rel=1e-9)
    assert len(set(delays)) > 1000  # still random gaps, not a fixed interval
    with pytest.raises(ValueError):
        arrival_delays(3, 0.0, 1.0, 0)


class _StreamingEngine(engine_pb2_grpc.EngineServicer):
    """Streams max_tokens tokens in chunks of two; records what it received."""

    def __init__(self) -> None:
        self.received: list[engine_pb2.GenerateRequest] = []

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateEvent]:
        self.received.append(request)
        rid = request.request_id
        prompt_tokens = len(request.input_ids.ids)
        yield engine_pb2.GenerateEvent(
            request_id=rid, prefill_done=engine_pb2.PrefillDone(prompt_tokens=prompt_tokens)
        )
        sent = 0
        while sent < request.sampling.max_tokens:
            await asyncio.sleep(0.001)
            ids = list(range(sent, min(sent + 2, request.sampling.max_tokens)))
            sent += len(ids)
            yield engine_pb2.GenerateEvent(request_id=rid, token=engine_pb2.TokenChunk(token_ids=ids))
        yield engine_pb2.GenerateEvent(
            request_id=rid, usage=common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=sent)
        )
        yield engine_pb2.GenerateEvent(
            request_id=rid, done=engine_pb2.Done(finish_reason=common_pb2.FINISH_REASON_LENGTH)
        )

    async def ListBackends(  # noqa: N802
        self, request: engine_pb2.ListBackendsRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.ListBackendsResponse:
        model = common_pb2.ModelInfo(name="tiny", vocab_size=500, max_model_len=2048, eos_token_ids=[2])
        return engine_pb2.ListBackendsResponse(backends=[common_pb2.BackendCapability(model=model)])


async def _serve_and_bench(config: BenchConfig) -> tuple[object, _StreamingEngine]:
    server = grpc.aio.server()
    engine = _StreamingEngine()
    engine_pb2_grpc.add_EngineServicer_to_server(engine, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        result = await asyncio.wait_for(run_benchmark(f"127.0.0.1:{port}", config), timeout=20)
    finally:
        await server.stop(grace=None)
    return result, engine


def test_run_benchmark_against_streaming_server(tmp_path: Path) -> None:
    config = BenchConfig(
        num_requests=12,
        input_len=16,
        output_len=7,
        request_rate=200.0,
        max_concurrency=4,
        num_channels=2,
        slo_ttft_ms=10_000.0,
        progress=False,
    )
    result, engine = asyncio.run(_serve_and_bench(config))
    metrics = result.metrics
    assert metrics.completed == 12 and metrics.failed == 0
    assert metrics.total_output_tokens == 12 * 7
    assert metrics.total_input_tokens == 12 * 16
    assert metrics.good_requests == 12
    assert metrics.itl.count == 12 * 3  # 7 tokens in chunks of 2, 2, 2, 1: three gaps each
    assert metrics.tpot.count == 12 and metrics.ttft.count == 12
    assert all(r.finish_reason == "FINISH_REASON_LENGTH" for r in result.requests)
    sent = engine.received
    assert len({r.request_id for r in sent}) == 12
    assert all(r.sampling.ignore_eos and r.sampling.max_tokens == 7 for r in sent)
    assert all(2 not in r.input_ids.ids and max(r.input_ids.ids) < 500 for r in sent)
    assert sum(result.timeline.output_tokens_per_s) * result.timeline.bin_s == pytest.approx(84)
    payload = json.loads(json.dumps(to_jsonable(result.to_json())))
    assert payload["metrics"]["completed"] == 12 and len(payload["requests"]) == 12
    png = write_plot(tmp_path / "bench.png", result.plot_data())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_benchmark_split_over_client_processes_merges_every_request() -> None:
    """Three client processes share the requests: one result, every request once, in the original order and
    on one clock (the run's duration covers every request)."""
    config = BenchConfig(num_requests=10, input_len=12, output_len=5, client_procs=3, progress=False)
    result, engine = asyncio.run(_serve_and_bench(config))
    metrics = result.metrics
    assert metrics.completed == 10 and metrics.failed == 0, result.errors()
    assert metrics.total_output_tokens == 10 * 5 and metrics.total_input_tokens == 10 * 12
    assert [r.index for r in result.requests] == list(range(10))
    assert len({r.request_id for r in result.requests}) == 10
    assert {r.request_id for r in engine.received} == {r.request_id for r in result.requests}
    assert all(0.0 <= r.send_time <= r.first_token_time <= r.end_time for r in result.requests)  # type: ignore[operator]
    assert max(r.end_time for r in result.requests) <= metrics.duration_s
    assert sum(result.timeline.output_tokens_per_s) * result.timeline.bin_s == pytest.approx(50)
    assert metrics.itl.count == 10 * 2  # 5 tokens in chunks of 2, 2, 1: two gaps each
    with pytest.raises(ValueError, match="infinite request rate"):
        asyncio.run(_serve_and_bench(BenchConfig(num_requests=4, request_rate=10.0, client_procs=2)))


def test_run_benchmark_against_launched_service(tmp_path: Path) -> None:
    """bench/serve.py against the real daemon (`ominix-runtime launch`, tiny random model, CPU worker)."""
    pytest.importorskip("torch")
    from bench.common import launch_service
    from bench.serve import fetch_backends, fetch_model_facts
    from ominix_worker.testing import write_tiny_hf_model

    model_dir = write_tiny_hf_model(tmp_path / "tiny-llama", vocab_size=320)
    launch_args = ["--model", str(model_dir), "--devices", "cpu", "--kv-cache-memory", "16MiB"]
    config = BenchConfig(num_requests=6, input_len=40, output_len=8, progress=False)

    async def bench_twice(address: str) -> tuple[object, object, int]:
        backends = await fetch_backends(address)
        requests = build_random_requests(config, await fetch_model_facts(address))
        first = await run_benchmark(address, config, requests)
        # The same prompts again, all in one GenerateBatch call.
        again = await run_benchmark(address, replace(config, batch_submit=True), requests)
        return first, again, backends.backends[0].kv_block_size

    with launch_service(launch_args, ready_timeout_s=60.0, show_progress=False) as service:
        first, again, block_size = asyncio.run(asyncio.wait_for(bench_twice(service.address), timeout=60))
    assert service.process.returncode is not None  # stopped on leaving the context
    for result in (first, again):
        assert result.metrics.completed == 6, result.errors()
        assert result.metrics.total_output_tokens == 6 * 8  # ignore_eos: exact lengths
        assert result.metrics.total_input_tokens == 6 * 40
        assert result.metrics.tpot.count == 6 and result.metrics.itl.count >= 6
    assert len({r.send_time for r in again.requests}) == 1  # one call carried them all
    assert first.metrics.total_cached_tokens == 0  # distinct prompts share no prefix
    if block_size and block_size < 40:
        assert again.metrics.total_cached_tokens >= 6 * block_size  # the same prompts again hit the cache


def test_roofline_counts_fp8_weights_as_one_byte() -> None:
    """FP8 weights: one byte per projection element (the LM head and norms stay in the run dtype), so the decode
    floors fall; with given ceilings the offline report says FP8 and takes them as they are."""
    from argparse import Namespace

    from bench.offline import OfflineReport, add_roofline
    from bench.roofline import ModelShape

    bf16, fp8 = ModelShape(), ModelShape(weight_bytes=1)
    unquantized = ((2 * bf16.layers + 1) * bf16.hidden + bf16.vocab * bf16.hidden) * 2  # norms, LM head
    assert fp8.weight_bytes_per_step - unquantized == (bf16.weight_bytes_per_step - unquantized) // 2
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token
    args = Namespace(
        bandwidth=3.0e12, flops=7.5e14, gpus=1, model_config=None, num_requests=256, input_len=512,
        output_len=256, batch1_input_len=512,
    )  # fmt: skip
    floors = {}
    for weight_dtype in ("", "float8_e4m3fn"):
        report = OfflineReport(device="cuda:0", dtype="bfloat16", weight_dtype=weight_dtype)
        report.figures = {"w1_cold_out_tok_s": 9000.0, "batch1_tpot_ms": 5.0}
        add_roofline(args, report)
        floors[weight_dtype] = report.figures["batch1_tpot_floor_ms"]
        source = next(row.note for row in report.rows if row.measurement == "W1 roofline")
        assert source.endswith("FP8") == bool(weight_dtype), source
    assert floors["float8_e4m3fn"] is not None and floors[""] is not None
    assert floors["float8_e4m3fn"] < 0.6 * floors[""]


def test_the_shell_benches_port_comes_from_outside_the_ephemeral_range() -> None:
    """``python3 bench/common.py free-port`` (what gpu_service.sh, online_service.sh and tp_service.sh call,
    with a count) prints one port that ``search_window`` holds and that can be bound."""
    import socket
    import subprocess

    from ominix_runtime.bind_probe import ephemeral_range, search_window

    out = subprocess.run(
        [sys.executable, "bench/common.py", "free-port"],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    port = int(out.stdout.strip())
    assert port in search_window(1)
    low, high = ephemeral_range()
    assert not low <= port <= high or search_window(1) == range(1024, 65536)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_the_shell_benches_take_all_the_ports_of_a_start_in_one_call() -> None:
    """``free-port N``: N distinct ports, each bindable (separate single picks may name one port twice); a count
    below 1 is a usage error."""
    import subprocess

    def free_port_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "bench/common.py", "free-port", *args],
            cwd=Path(__file__).resolve().parents[2],
            capture_output=True,
            text=True,
            timeout=60,
        )

    out = free_port_cli("5")
    assert out.returncode == 0, out.stderr
    ports = [int(word) for word in out.stdout.split()]
    assert len(ports) == 5 and len(set(ports)) == 5
    bad = free_port_cli("0")
    assert bad.returncode == 2 and "at least 1" in bad.stderr


def test_prefix_step_runs_every_step_kind_on_a_tiny_model(tmp_path: Path) -> None:
    """bench/prefix_step.py on the CPU (its --device cpu check mode): the prefix-hit suffix steps, batch-1
    decode, and running decodes beside a new prompt's prefill all run, also through the pipelined path of the
    host-launch figures, and each reports its trials."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    from ominix_worker.testing import tiny_config_kwargs

    config = tmp_path / "config.json"
    shape = tiny_config_kwargs("llama", 1000, 64, 2, 4, 2, False, 4096)
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape}))
    out = tmp_path / "figures.json"
    argv = [sys.executable, str(root / "bench" / "prefix_step.py"), "--device", "cpu", "--model"]
    argv += [f"dummy:{config}", "--prefix-len", "256", "--suffix-len", "16", "--trials", "3"]
    argv += ["--num-blocks", "2048", "--mixed-decodes", "3", "--mixed-prompt", "64", "--mixed-prompts", "2"]
    argv += ["--json", str(out)]
    argv += ["--trace", str(tmp_path / "trace.json"), "--launch-pstats", str(tmp_path / "launch.pstats")]
    argv += ["--triton-launch", "triton", "--warm-gemm-rows", "16", "--warm-gemm-max-tokens", "64"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    kinds = ("suffix_step", "batch1_decode_step", "mixed_step", "decodes_alone_step")
    launches = ("mixed_step_host_launch", "decodes_alone_host_launch", "mixed_step_host_launch_profiled")
    after = ("mixed_step_host_launch_after_gemm_warm_up", "mixed_step_after_gemm_warm_up")
    assert figures["gemm_warm_up"]["calls"] >= 0  # the CPU's packed layers are skipped
    for kind in (*kinds, *launches, *after):
        assert figures[kind]["steps"] == 3
        assert 0 < figures[kind]["min_ms"] <= figures[kind]["median_ms"]
    assert figures["mixed_step"]["decodes"] == 3 and figures["device"] == "cpu"
    assert figures["mixed_step"]["prompts"] == 2 and figures["mixed_step"]["prompt_tokens"] == 64
    assert figures["triton_launch"] == "triton"
    assert (
        figures["piecewise_graph_buckets"] == 0 and figures["piecewise_token_step"] == 0
    )  # no pieces on a CPU
    trace = json.loads((tmp_path / "trace.json").read_text())
    ops = [e for e in trace["traceEvents"] if str(e.get("name", "")).startswith("aten::")]
    assert len(ops) > 10  # the step's host ops are in the timeline
    import pstats

    profiled = pstats.Stats(str(tmp_path / "launch.pstats"))
    assert any(name == "execute_step" for (_, _, name) in profiled.stats)  # type: ignore[attr-defined]
    assert "cProfile of 3 launches" in done.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        (["--piecewise-token-step", "8"], "set N too"),
        (["--piecewise-graph-tokens", "64", "--piecewise-token-step", "0"], "at least 1"),
        (["--piecewise-fastest-bucket"], "set N too"),
        (["--mixed-prompts", "0"], "--mixed-prompts must be at least 1"),
    ],
)
def test_prefix_step_refuses_piecewise_options_without_their_pieces(args: list[str], says: str) -> None:
    import subprocess

    root = Path(__file__).resolve().parents[2]
    argv = [sys.executable, str(root / "bench" / "prefix_step.py"), "--device", "cpu", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 2 and says in done.stderr, done.stderr[-2000:]


def test_host_glue_counts_the_launches_of_an_eager_step(tmp_path: Path) -> None:
    """bench/host_glue.py: the CUDA path's host code on the CPU, kernels and GEMMs stood in for; it reports the
    step's host time and the Triton launches and GEMM calls a step of that many layers makes."""
    import subprocess

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "glue.json"
    argv = [sys.executable, str(root / "bench" / "host_glue.py"), "--layers", "3", "--prompt", "64"]
    argv += ["--decodes", "2", "--trials", "2", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["steps"] == 2 and 0 < figures["host_ms_min"] <= figures["host_ms_median"]
    # Four projections a layer (QKV, O, gate-up, down) and the LM head; several Triton kernels a layer.
    assert figures["gemms_per_step"] == 4 * 3 + 1
    assert figures["triton_launches_per_step"] >= 5 * 3


def test_grpc_intake_times_a_burst_against_a_bare_server() -> None:
    """Every call of the burst reaches the bare server's handler; the first and last entries are ordered."""
    from bench.grpc_intake import run_trial

    first, last = run_trial(calls=8, channels=2)
    assert 0.0 <= first <= last < 30_000.0


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def test_the_gemm_product_check_counts_another_product_as_off() -> None:
    """The check that keeps a wrong cuBLASLt candidate out of gemm_algos' timings and a wrong orientation out of
    gemm_rows' (the GPU tests show none is off)."""
    import torch

    from bench.gemm_rows import product_off

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 32, generator=gen)
    w = torch.randn(24, 32, generator=gen)
    expected = x @ w.t()
    assert not product_off(expected.clone(), expected, 0.02)
    assert not product_off(expected + 0.001 * expected.abs().max(), expected, 0.02)  # rounding-sized error
    assert product_off(x @ w.roll(1, dims=0).t(), expected, 0.02)  # another product (the weight's rows moved)
    assert product_off(torch.zeros_like(expected), expected, 0.02)  # nothing written


@pytest.mark.skipif(_has_cuda(), reason="checks the message of a machine without CUDA")
@pytest.mark.parametrize(
    "script", ["gemm_rows.py", "gemm_algos.py", "gemm_first_call.py", "pinned_first_alloc.py"]
)
def test_the_cuda_only_benches_exit_2_with_a_message_without_cuda(script: str) -> None:
    import subprocess

    bench = Path(__file__).resolve().parents[2] / "bench"
    out = subprocess.run([sys.executable, str(bench / script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "needs a CUDA device" in out.stderr


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("gemm_rows.py", ["--rows", "0,8"], "each at least 1"),
        ("gemm_rows.py", ["--rows", "8:x:1"], "neither START:STOP:STEP"),
        ("gemm_algos.py", ["--rows", "0,8"], "each at least 1"),
        ("gemm_algos.py", ["--candidates", "0"], "must each be at least 1"),
        ("gemm_first_call.py", ["--rows", "2,256"], "called to warm cuBLAS up"),
        ("gemm_first_call.py", ["--mode", "busy"], "invalid choice"),
        ("pinned_first_alloc.py", ["--sizes", "100,120"], "share a power-of-two class"),
        ("pinned_first_alloc.py", ["--sizes", "0,8"], "each at least 1"),
    ],
)
def test_the_gemm_benches_refuse_bad_arguments_before_touching_a_device(
    script: str, args: list[str], message: str
) -> None:
    import subprocess

    bench = Path(__file__).resolve().parents[2] / "bench"
    out = subprocess.run(
        [sys.executable, str(bench / script), *args], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert message in out.stderr


def test_parse_counts_reads_ranges_and_lists() -> None:
    from bench.common import parse_counts

    assert parse_counts("2:12:3") == [2, 5, 8, 11]
    assert parse_counts("1024,1032") == [1024, 1032]
    for bad in ("", "1:2", "a,b", "0,4", "5:1:1"):
        with pytest.raises(ValueError):
            parse_counts(bad)
