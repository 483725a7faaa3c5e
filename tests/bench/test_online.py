"""Online serving bench: bench/online.py against the real daemon, bench/plot_online.py on synthetic results, and
bench/online_service.sh stopping at once when the service or `vllm serve` dies at start.

Performance is never asserted: only that every request ended, the counts are exact and the files are whole.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import online, plot_online, serve  # noqa: E402
from bench.common import launch_service  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "vocab_size": 320,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _tiny_config(tmp_path: Path) -> Path:
    path = tmp_path / "tiny-config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return path


def test_rates_and_prompt_counts() -> None:
    assert online.parse_rates("4, 8,inf") == [4.0, 8.0, math.inf]
    with pytest.raises(ValueError):
        online.parse_rates("4,0")
    assert online.num_prompts(16.0, 15.0, inf_prompts=256, min_prompts=16) == 240
    assert online.num_prompts(0.5, 10.0, inf_prompts=256, min_prompts=16) == 16  # at least min_prompts
    assert online.num_prompts(math.inf, 15.0, inf_prompts=256, min_prompts=16) == 256


def test_model_dir_tokenizer_round_trips_token_ids(tmp_path: Path) -> None:
    """Any id sequence decodes to text that encodes back to exactly those ids, in our tokenizer and HF's."""
    from ominix_runtime.text.tokenizer import Tokenizer

    folder = online.write_model_dir(_tiny_config(tmp_path), tmp_path / "model")
    assert json.loads((folder / "config.json").read_text()) == TINY_CONFIG
    ids = [int(i) for i in __import__("numpy").random.default_rng(0).integers(3, 320, size=200)]
    ours = Tokenizer.from_hf_folder(folder)
    assert ours.vocab_size == 320 and ours.bos_token_id == 1 and ours.eos_token_ids == (2,)
    assert ours.special_token_ids == frozenset({1, 2})
    text = ours.backend.decode(ids)
    assert ours.backend.encode(text).ids == ids
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert hf.num_special_tokens_to_add() == 0 and sorted(hf.all_special_ids) == [1, 2]
    assert hf.encode(hf.decode(ids), add_special_tokens=False) == ids


def test_online_run_against_launched_service(tmp_path: Path) -> None:
    """Two rates (Poisson and all at once) against `ominix-runtime launch` on CPU: every request ends, with the
    exact lengths, and the JSON carries vllm bench serve's field names."""
    pytest.importorskip("torch")
    model = online.write_model_dir(_tiny_config(tmp_path), tmp_path / "model")
    launch_args = ["--model", f"dummy:{model}", "--devices", "cpu", "--kv-cache-memory", "16MiB"]
    out = tmp_path / "ours.json"
    argv = [
        "run",
        "--rates", "20,inf",
        "--seconds", "0.3",
        "--min-prompts", "5",
        "--inf-prompts", "4",
        "--input-len", "24",
        "--output-len", "6",
        "--warmup-requests", "2",
        "--slo-ttft-ms", "60000",
        "--slo-tpot-ms", "60000",
        "--save-detailed",
        "--no-progress",
        "--out-json", str(out),
    ]  # fmt: skip
    with launch_service(launch_args, ready_timeout_s=120.0, show_progress=False) as service:
        assert online.main([*argv, "--address", service.address]) == 0
    results = json.loads(out.read_text())
    assert [r["request_rate"] for r in results] == [20.0, "inf"]
    assert [r["num_prompts"] for r in results] == [6, 4]
    for result in results:
        n = result["num_prompts"]
        assert result["completed"] == n and result["failed"] == 0, result["errors"]
        assert result["errors"] == [""] * n
        assert result["input_lens"] == [24] * n and result["output_lens"] == [6] * n
        assert result["total_output_tokens"] == 6 * n and result["total_input_tokens"] == 24 * n
        assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # generous SLOs
        assert result["output_throughput"] == pytest.approx(6 * n / result["duration"])
        for metric in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "median", "std", "p50", "p99"):
                assert isinstance(result[f"{stat}_{metric}_ms"], float), (stat, metric)
            assert result[f"p50_{metric}_ms"] == pytest.approx(result[f"median_{metric}_ms"])
            assert result[f"p99_{metric}_ms"] >= result[f"p50_{metric}_ms"] > 0
        # 6 tokens: 5 gaps when each comes as its own chunk; fewer when the engine, behind its worker, sends
        # the tokens of steps it applied together as one chunk.
        assert all(len(gaps) <= 5 for gaps in result["itls"])
        chunks = sum(len(gaps) + 1 for gaps in result["itls"])
        assert result["token_chunks"] == chunks
        merged = result["multi_token_chunks"]
        assert (merged > 0) == (chunks < 6 * n) and merged <= chunks
        assert result["median_e2el_ms"] >= result["median_ttft_ms"]
    poisson = results[0]
    assert max(poisson["start_times"]) > 0  # spread out, not all at once
    assert results[1]["start_times"] == pytest.approx([0.0] * 4, abs=0.5)


def test_merged_chunks_are_counted_over_successful_grpc_requests_only() -> None:
    def request(i: int, chunks: list[int], success: bool = True) -> serve.RequestResult:
        times = [0.1 * (k + 1) for k in range(len(chunks))]
        return serve.RequestResult(
            i, f"r{i}", send_time=0.0, end_time=times[-1], first_token_time=times[0], chunk_times=times,
            chunk_tokens=chunks, output_tokens=sum(chunks), prompt_tokens=8, success=success,
        )  # fmt: skip

    requests = [request(0, [1, 3, 2, 1]), request(1, [1, 1]), request(2, [2, 2], success=False)]
    config = serve.BenchConfig(num_requests=3, input_len=8, output_len=7)

    def result(address: str) -> dict[str, object]:
        metrics = serve.compute_metrics(requests, 1.0)
        timeline = serve.throughput_timeline(requests, 1.0, 0.5)
        bench = serve.BenchResult(config, address, metrics, timeline, requests, 0.0)
        return online.to_vllm_result(bench, label="x", model_id="m")

    grpc_result = result("127.0.0.1:50061")
    assert (grpc_result["token_chunks"], grpc_result["multi_token_chunks"]) == (6, 2)
    assert online.format_rate_line(grpc_result).endswith(", 33.3% of chunks >1 token")
    http_result = result("http://127.0.0.1:8000")
    assert http_result["token_chunks"] is None and http_result["multi_token_chunks"] is None
    assert online.format_rate_line(http_result).endswith("req/s")


def _streamed(i: int, gaps_ms: list[float], success: bool = True) -> serve.RequestResult:
    """A streamed request whose first token came at 50 ms, one token a chunk, then one chunk after each gap."""
    times = [0.05]
    for gap in gaps_ms:
        times.append(times[-1] + gap / 1000.0)
    return serve.RequestResult(
        i, f"r{i}", send_time=0.0, end_time=times[-1], first_token_time=times[0], chunk_times=times,
        chunk_tokens=[1] * len(times), output_tokens=len(times), prompt_tokens=8, success=success,
    )  # fmt: skip


def test_the_itl_tail_counts_the_share_of_gaps_at_or_above_each_length() -> None:
    # Six gaps over the successful requests: 5, 5, 12, 22 and 120 ms, and 30 ms (exactly at a threshold).
    requests = [
        _streamed(0, [5.0, 12.0, 120.0]),
        _streamed(1, [5.0, 22.0, 30.0]),
        _streamed(2, [500.0], False),
    ]
    config = serve.BenchConfig(num_requests=3, input_len=8, output_len=4)
    metrics = serve.compute_metrics(requests, 1.0)
    bench = serve.BenchResult(config, "127.0.0.1:50061", metrics, [], requests, 0.0)
    tail = online.to_vllm_result(bench, label="x", model_id="m")["itl_tail"]
    assert tail["gaps"] == 6
    expected = {10: 4, 15: 3, 20: 3, 25: 2, 30: 2, 50: 1, 100: 1, 200: 0}  # gaps at or above each length
    assert list(expected) == list(online.ITL_TAIL_MS)
    for ms, count in expected.items():
        assert tail[f"share_at_least_{ms}ms"] == pytest.approx(count / 6), ms
    assert online.itl_tail([]) == {"gaps": 0, **{f"share_at_least_{ms}ms": 0.0 for ms in expected}}


def test_a_stall_is_a_run_of_long_gaps_counted_once_net_of_the_short_gaps_after_it() -> None:
    ms = 0.001
    streams = [
        [5 * ms, 5 * ms, 5 * ms, 20 * ms, 5 * ms, 5 * ms],  # median 5: one stall of one gap, excess 15
        [
            4 * ms,
            4 * ms,
            14 * ms,
            12 * ms,
            4 * ms,
            4 * ms,
            4 * ms,
        ],  # median 4: one stall over two gaps, excess 18
        [10 * ms, 10 * ms],  # too few gaps for a median: left out
        [5 * ms, 5 * ms, 5 * ms, 5 * ms, 9 * ms],  # a stall that runs to the end (excess 4)
        [6 * ms, 6 * ms, 8.9 * ms],  # just under 1.5x its median: no stall
        [
            5 * ms,
            5 * ms,
            5 * ms,
            20 * ms,
            2 * ms,
            3 * ms,
            5 * ms,
            5 * ms,
        ],  # 15, less the 3 + 2 made up after it
    ]
    stalls = online.itl_stalls(streams)
    assert (stalls["gaps"], stalls["stalls"]) == (29, 4)
    assert stalls["stalls_per_1k_gaps"] == pytest.approx(4000 / 29)
    assert stalls["multi_gap_share"] == pytest.approx(1 / 4)
    assert stalls["p50_excess_ms"] == pytest.approx(12.5)  # net excesses 4, 10, 15, 18
    assert stalls["p90_excess_ms"] == pytest.approx(15.0 + 0.7 * 3.0)
    assert stalls["p50_longest_ms"] == pytest.approx(17.0)  # longest gaps 9, 14, 20, 20
    assert stalls["p99_longest_ms"] == pytest.approx(20.0)
    # Exactly 1.5x the median is long (binary-exact seconds); a fraction of a millisecond over it is not.
    assert online.itl_stalls([[2.0, 2.0, 3.0]])["stalls"] == 1
    assert online.itl_stalls([[0.2 * ms] * 5 + [0.5 * ms]])["stalls"] == 0
    # Tokens sent in bursts (a median gap of 0): only the gaps between bursts are stalls.
    bursts = online.itl_stalls([[0.0, 0.0, 30 * ms, 0.0, 0.0, 20 * ms, 0.0, 0.0]])
    assert (bursts["stalls"], bursts["multi_gap_share"], bursts["p50_excess_ms"]) == (
        2,
        0.0,
        pytest.approx(25.0),
    )
    none = online.itl_stalls([[5 * ms] * 4])
    assert (none["gaps"], none["stalls"], none["stalls_per_1k_gaps"]) == (4, 0, 0.0)
    assert (
        none["multi_gap_share"] is None and none["p50_excess_ms"] is None and none["p90_longest_ms"] is None
    )
    assert online.itl_stalls([])["stalls_per_1k_gaps"] is None


def test_every_run_records_the_stalls_of_its_successful_streams() -> None:
    # The failed request's long gaps would be a stall of their own: only the first request's one stall counts.
    requests = [_streamed(0, [5.0, 5.0, 30.0, 5.0]), _streamed(1, [5.0, 5.0, 90.0, 90.0], False)]
    config = serve.BenchConfig(num_requests=2, input_len=8, output_len=5)
    bench = serve.BenchResult(
        config, "127.0.0.1:50061", serve.compute_metrics(requests, 1.0), [], requests, 0.0
    )
    result = online.to_vllm_result(bench, label="x", model_id="m")
    stalls = result["itl_stalls"]
    assert (stalls["gaps"], stalls["stalls"]) == (4, 1)
    assert stalls["p50_excess_ms"] == pytest.approx(25.0)
    assert stalls["multi_gap_share"] == 0.0
    assert "ms, stalls 250.0/1k gaps (net p50 25.0 ms, 0% over 2+ gaps), goodput" in online.format_rate_line(
        result
    )


def _synthetic(rate: float | str, scale: float, completed: int = 10) -> dict[str, object]:
    return {
        "request_rate": rate,
        "num_prompts": completed,
        "completed": completed,
        "failed": 0,
        "duration": 5.0,
        "total_input_tokens": 1024 * completed,
        "total_output_tokens": 256 * completed,
        "output_throughput": 1000.0 / scale,
        "request_goodput": 3.0 / scale,
        "median_ttft_ms": 40.0 * scale,
        "p99_ttft_ms": 90.0 * scale,
        "median_tpot_ms": 7.0 * scale,
        "p99_tpot_ms": 9.0 * scale,
        "median_itl_ms": 6.5 * scale,
        "p99_itl_ms": 20.0 * scale,
    }


def test_plot_online_writes_one_png_and_a_ratio_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    ours = tmp_path / "ours.json"  # online.py's form: one list
    ours.write_text(json.dumps([_synthetic(r, 1.0) for r in (4.0, 8.0, 16.0, 32.0, "inf")]))
    peer = tmp_path / "vllm"  # vllm bench serve's form: one object per file, in a folder
    peer.mkdir()
    for i, rate in enumerate((4.0, 8.0, 16.0, 32.0, "inf")):
        (peer / f"rate_{i}.json").write_text(json.dumps(_synthetic(rate, 2.0)))
    png, table = tmp_path / "online.png", tmp_path / "online.md"
    argv = [
        "--series",
        f"ominix={ours}",
        "--series",
        f"vllm={peer}",
        "--png",
        str(png),
        "--table",
        str(table),
    ]
    assert plot_online.main(argv) == 0
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    text = table.read_text()
    assert text == capsys.readouterr().out.split("png: ")[0]
    ratio_rows = [line for line in text.splitlines() if line.startswith("| ominix/vllm")]
    assert len(ratio_rows) == 5  # one per rate, inf included
    assert "0.50x" in ratio_rows[0] and "2.00x" in ratio_rows[0]  # latencies halved, throughput doubled
    not_a_result = tmp_path / "other.json"
    not_a_result.write_text("{}")
    with pytest.raises(ValueError, match="no request_rate"):
        plot_online.load_results(not_a_result)


def _script_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "RESULTS": str(tmp_path / "results"),
        "WORK": str(tmp_path / "work"),
        "CONFIG_JSON": str(_tiny_config(tmp_path)),
        "NO_WHEELS": "1",
        **extra,
    }


def _stand_in_vllm(tmp_path: Path, cli_main: str) -> Path:
    """A folder for VLLM_SITE holding a stand-in `vllm` package whose `vllm.entrypoints.cli.main` is
    ``cli_main`` (what `vllm serve` and `vllm bench serve` run)."""
    site = tmp_path / "site"
    for package in ("vllm", "vllm/benchmarks", "vllm/entrypoints", "vllm/entrypoints/cli"):
        (site / package).mkdir(parents=True)
        (site / package / "__init__.py").write_text("")
    (site / "vllm/__init__.py").write_text("__version__ = '0.0-stand-in'\n")
    (site / "vllm/benchmarks/serve.py").write_text("")
    (site / "vllm/entrypoints/cli/main.py").write_text(cli_main)
    return site


def test_online_service_script_stops_when_our_service_dies_at_start(tmp_path: Path) -> None:
    env = _script_env(tmp_path, STAGES="ours", DEVICE="bogus:0", READY_S="600")
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "bench/online_service.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    output = done.stdout + done.stderr
    assert time.monotonic() - started < 120, output  # not the 600 s readiness timeout
    assert "ours: service never SERVING" in output
    assert "exited; last lines of" in output and "bogus:0" in output


def test_online_service_script_stops_when_vllm_serve_dies_at_start(tmp_path: Path) -> None:
    """A stand-in `vllm` package on VLLM_SITE whose server exits at once: the /health wait ends at once."""
    site = _stand_in_vllm(
        tmp_path, "import sys\nprint('RuntimeError: no CUDA device (stand-in server)')\nsys.exit(3)\n"
    )
    env = _script_env(tmp_path, STAGES="vllm", VLLM_SITE=str(site), VLLM_READY_S="600")
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "bench/online_service.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    output = done.stdout + done.stderr
    assert time.monotonic() - started < 120, output
    assert "vllm 0.0-stand-in" in output
    assert "vllm serve exited" in output and "no CUDA device (stand-in server)" in output
    assert "vllm: server never healthy" in output


STAND_IN_VLLM_SERVER = """
import json
import os
import sys

from aiohttp import web

args = sys.argv[1:]
if args[0] != "serve":  # `bench serve`: the stand-in measures nothing, it only notes its arguments
    with open(os.environ["STAND_IN_BENCH_ARGV"], "a") as log:
        log.write(" ".join(args) + "\\n")
    sys.exit(0)
port, model = int(args[args.index("--port") + 1]), args[1]
# vLLM's step-token histogram, as if every generated token were a step of its own (the first one with the prompt)
steps = {"count": 0, "tokens": 0}


async def health(request):
    return web.Response(text="ok")


async def models(request):
    return web.json_response({"data": [{"id": model, "max_model_len": 2048}]})


async def completions(request):
    body = await request.json()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    n = body["max_tokens"]
    steps["count"] += n
    steps["tokens"] += n + len(body["prompt"])
    for i in range(n):
        choice = {"index": 0, "text": " t5", "finish_reason": "length" if i == n - 1 else None}
        await response.write(("data: " + json.dumps({"choices": [choice]}) + "\\n\\n").encode())
    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
    await response.write(("data: " + json.dumps({"choices": [], "usage": usage}) + "\\n\\n").encode())
    await response.write(b"data: [DONE]\\n\\n")
    return response


async def metrics(request):
    name = "vllm:iteration_tokens_total"
    series = f'engine="0",model_name="{model}"'
    lines = [
        f"# TYPE {name} histogram",
        f'{name}_bucket{{{series},le="+Inf"}} {steps["count"]}.0',
        f"{name}_count{{{series}}} {steps['count']}.0",
        f"{name}_sum{{{series}}} {steps['tokens']}.0",
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{{{series}}} 0.0",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="512"}} 1.0',
    ]
    return web.Response(text="\\n".join(lines) + "\\n")


app = web.Application()
app.router.add_get("/health", health)
app.router.add_get("/metrics", metrics)
app.router.add_get("/v1/models", models)
app.router.add_post("/v1/completions", completions)
web.run_app(app, host="127.0.0.1", port=port, print=None)
"""


@pytest.mark.parametrize("vllm_bench", ["1", "0"])
def test_online_service_script_drives_vllm_serve_with_our_schedule(tmp_path: Path, vllm_bench: str) -> None:
    """SAME_SCHEDULE=1: once `vllm bench serve` is done (or at once with VLLM_BENCH=0), bench/online.py drives
    the same `vllm serve` over /v1/completions with its own schedule and prompts (a stand-in server speaking the
    OpenAI stream)."""
    site = _stand_in_vllm(tmp_path, STAND_IN_VLLM_SERVER)
    env = _script_env(
        tmp_path,
        STAGES="vllm",
        VLLM_SITE=str(site),
        SAME_SCHEDULE="1",
        VLLM_BENCH=vllm_bench,
        DETAILED="1",
        STAND_IN_BENCH_ARGV=str(tmp_path / "bench_argv.txt"),
        RATES="10 inf",
        SECONDS_PER_RATE="0.4",
        INF_PROMPTS="4",
        MIN_PROMPTS="3",
        INPUT_LEN="16",
        OUTPUT_LEN="4",
        WARMUP="2",
        VLLM_READY_S="60",
    )
    stale = tmp_path / "results" / "online_vllm.json"  # an earlier call's, which VLLM_BENCH=0 must not show
    stale.parent.mkdir(parents=True)
    stale.write_text("[]")
    done = subprocess.run(
        ["bash", "bench/online_service.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    output = done.stdout + done.stderr
    assert "vllm: our schedule and prompts" in output, output
    ran_vllm_bench = vllm_bench == "1"
    assert ("vllm: warm-up" in output) == ran_vllm_bench and ("vllm: rate 10" in output) == ran_vllm_bench
    results = json.loads((tmp_path / "results" / "online_vllm_our_schedule.json").read_text())
    assert [r["request_rate"] for r in results] == [10.0, "inf"], output
    assert [r["completed"] for r in results] == [4, 4] and all(r["failed"] == 0 for r in results)
    assert all(r["backend"] == "openai" and r["total_output_tokens"] == 4 * 4 for r in results)
    assert all([len(itls) for itls in r["itls"]] == [3] * 4 for r in results)  # DETAILED=1: every request's
    bench_runs = (tmp_path / "bench_argv.txt").read_text().splitlines() if vllm_bench == "1" else []
    assert len(bench_runs) == (3 if vllm_bench == "1" else 0)  # warm-up, then each rate
    assert all("--save-detailed" in run for run in bench_runs if "--save-result" in run)
    assert stale.exists() == (vllm_bench == "1")


def test_online_service_script_runs_our_rates_and_tabulates(tmp_path: Path) -> None:
    """The script's own path on CPU: model folder, launch, two rates, stop, table and PNG."""
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    env = _script_env(
        tmp_path,
        STAGES="ours table",
        DEVICE="cpu",
        RATES="10 inf",
        SECONDS_PER_RATE="0.4",
        MIN_PROMPTS="4",
        INF_PROMPTS="4",
        INPUT_LEN="24",
        OUTPUT_LEN="6",
        WARMUP="2",
        MAX_MODEL_LEN="256",
        MAX_NUM_SEQS="16",
        MAX_BATCH_TOKENS="512",
        OURS_ARGS="--kv-cache-memory 16MiB",
    )
    done = subprocess.run(
        ["bash", "bench/online_service.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    output = done.stdout + done.stderr
    results = tmp_path / "results"
    saved = json.loads((results / "online_ominix.json").read_text())
    assert [(r["request_rate"], r["completed"], r["failed"]) for r in saved] == [
        (10.0, 4, 0),
        ("inf", 4, 0),
    ], output
    assert all(r["total_output_tokens"] == 4 * 6 for r in saved)
    table = (results / "online_table.md").read_text()
    assert "| ominix | 10 " in table and "| ominix | inf " in table
    assert (results / "online.png").read_bytes()[:8] == PNG_MAGIC
    assert "=== ours: stop" in output and "=== done" in output


def test_ab_start_without_vllm_runs_ours_only(tmp_path: Path) -> None:
    """AB_VLLM=0: ab-start leaves `vllm serve` out though a `vllm` package imports, ab-run drives ours, ab-stop
    stops it; with AB_BASELINE left at vllm it is refused before anything starts."""
    pytest.importorskip("torch")
    site = _stand_in_vllm(tmp_path, "raise SystemExit('the stand-in vllm must not start')\n")
    servers_file = tmp_path / "work" / "ab_servers"
    common = dict(
        VLLM_SITE=str(site), AB_VLLM="0", DEVICE="cpu", RATES="10", SECONDS_PER_RATE="0.4", MIN_PROMPTS="4",
        INPUT_LEN="24", OUTPUT_LEN="6", WARMUP="2", MAX_MODEL_LEN="256", MAX_NUM_SEQS="16",
        MAX_BATCH_TOKENS="512", OURS_ARGS="--kv-cache-memory 16MiB", AB_ROUNDS="1", READY_S="120",
        SERVER_LIFETIME_S="600",
    )  # fmt: skip

    def stage(stages: str, **extra: str) -> str:
        env = _script_env(tmp_path, STAGES=stages, **common, **extra)
        done = subprocess.run(
            ["bash", "bench/online_service.sh"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        return done.stdout + done.stderr

    refused = stage("ab-start")
    assert "AB_VLLM=0 leaves vllm serve out" in refused, refused
    assert "vllm: import check" not in refused and ": launch" not in refused and not servers_file.exists()
    try:
        started = stage("ab-start", AB_BASELINE="a", AB_OURS="a=")
        assert servers_file.exists(), started
        servers = [line.split() for line in servers_file.read_text().splitlines() if line]
        assert [s[0] for s in servers] == ["a"] and "vllm: import check" not in started, started
        pid = int(servers[0][1])
        ran = stage("ab-run", AB_BASELINE="a")
        runs = json.loads((tmp_path / "results" / "ab_r0.json").read_text())
        assert [(r["label"], r["result"]["completed"], r["result"]["failed"]) for r in runs] == [
            ("a", 4, 0)
        ], ran
    finally:
        stage("ab-stop")
    assert not servers_file.exists()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
