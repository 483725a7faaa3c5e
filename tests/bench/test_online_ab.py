"""Paired online A/B (bench/online_ab.py and the ab-* stages of bench/online_service.sh): the run order and
seeds, the paired table on synthetic records, and the stages on CPU against two services of ours and a stand-in
`vllm serve`, all resident at once. Performance is never asserted."""

from __future__ import annotations

import gzip
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_online import STAND_IN_VLLM_SERVER, _script_env, _stand_in_vllm  # noqa: E402

from bench import online, online_ab  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_run_order_turns_every_server_through_every_place() -> None:
    servers = [online_ab.Server(label, f"127.0.0.1:{port}") for label, port in (("a", 1), ("b", 2), ("c", 3))]
    orders = [[s.label for s in online_ab.run_order(servers, r, 0)] for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert [s.label for s in online_ab.run_order(servers, 0, 1)] == ["b", "c", "a"]  # next rate turns too
    seeds = {online_ab.round_seed(7, r, i) for r in range(3) for i in range(5)}
    assert len(seeds) == 15  # no two runs share prompts
    assert online_ab.parse_server("ours=http://h:1") == online_ab.Server("ours", "http://h:1")
    with pytest.raises(Exception, match="LABEL=ADDRESS"):
        online_ab.parse_server("127.0.0.1:1")
    with pytest.raises(Exception, match="--steps is LABEL=URL"):
        online_ab.parse_steps_endpoint("http://127.0.0.1:1/metrics")


def _record(label: str, round_index: int, rate: float, ttft: float, tokens: float) -> dict[str, object]:
    return {
        "label": label,
        "round": round_index,
        "rate_index": 0,
        "position": 0,
        "seed": round_index,
        "result": {
            "request_rate": rate,
            "num_prompts": 10,
            "completed": 10,
            "failed": 0,
            "median_ttft_ms": ttft,
            "output_throughput": tokens,
        },
    }


def test_table_compares_round_by_round() -> None:
    records = [
        _record("ours", 0, 4.0, 30.0, 1000.0),
        _record("vllm", 0, 4.0, 40.0, 1000.0),  # round 0: ours 0.75x TTFT, level throughput
        _record("ours", 1, 4.0, 50.0, 900.0),
        _record("vllm", 1, 4.0, 40.0, 1000.0),  # round 1: ours 1.25x TTFT, 0.9x throughput
        _record("ours", 0, 8.0, 10.0, 2000.0),  # a rate vllm never ran: nothing to pair
    ]
    text = online_ab.format_ab_table(records, "vllm")
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in text.splitlines()[2:]}
    pair = [c.strip() for c in rows[("ours/vllm", "4")].split("|")]
    columns = [c.strip() for c in text.splitlines()[0].split("|")]
    ttft = pair[columns.index("TTFT p50")]
    tokens = pair[columns.index("out tok/s")]
    assert ttft == "1.00× (0.75–1.25) 1/2"  # at least as good (lower) in round 0 only
    assert tokens == "0.95× (0.90–1.00) 1/2"  # level in round 0 counts, lower throughput in round 1 does not
    ours = [c.strip() for c in rows[("ours", "4")].split("|")]
    assert ours[columns.index("TTFT p50")] == "40.0 (30.0–50.0)" and ours[columns.index("rounds")] == "2"
    assert rows[("ours/vllm", "8")].count("-") >= 8  # no pair at 8 req/s
    with pytest.raises(SystemExit, match="baseline"):
        online_ab.format_ab_table(records, "sglang")


def _servers(tmp_path: Path) -> list[list[str]]:
    return [line.split() for line in (tmp_path / "work" / "ab_servers").read_text().splitlines()]


def test_ab_stages_drive_resident_servers_in_turn(tmp_path: Path) -> None:
    """ab-start leaves a stand-in vllm serve and two services of ours running (two calls of the script, as on a
    warm GPU machine; one with a variable in its environment); ab-run drives them in turn with one schedule per round; ab-table pairs them; a server
    that died stops the next ab-run at once; ab-stop stops the rest."""
    pytest.importorskip("torch")
    site = _stand_in_vllm(tmp_path, STAND_IN_VLLM_SERVER)
    env = _script_env(
        tmp_path,
        VLLM_SITE=str(site),
        DEVICE="cpu",
        AB_OURS="fast=OMINIX_LOG_STEPS=1;slow=--light-load-below-running 0",
        AB_KV_BYTES=str(16 * 2**20),  # every server's KV, vllm serve's included
        RATES="10",
        SECONDS_PER_RATE="0.4",
        MIN_PROMPTS="4",
        INPUT_LEN="24",
        OUTPUT_LEN="5",
        WARMUP="2",
        MAX_MODEL_LEN="256",
        MAX_NUM_SEQS="16",
        MAX_BATCH_TOKENS="512",
        AB_ROUNDS="2",
        AB_STEPS="1",
        VLLM_READY_S="60",
    )

    def script(stages: str, **extra: str) -> str:
        done = subprocess.run(
            ["bash", "bench/online_service.sh"],
            cwd=REPO,
            env={**env, "STAGES": stages, **extra},
            capture_output=True,
            text=True,
            timeout=300,
        )
        return done.stdout + done.stderr

    servers: list[list[str]] = []
    try:
        output = script("ab-start")
        servers = _servers(tmp_path)
        assert [s[0] for s in servers] == ["vllm", "fast", "slow"], output
        # A leading NAME=VALUE word is that service's environment, not a launch argument.
        environ = {s[0]: Path(f"/proc/{s[1]}/environ").read_bytes().split(b"\0") for s in servers[1:]}
        assert b"OMINIX_LOG_STEPS=1" in environ["fast"] and b"OMINIX_LOG_STEPS=1" not in environ["slow"]
        for label, pid, *_ in servers:  # AB_KV_BYTES reaches every server's command line, in its own flag
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            flag = b"--kv-cache-memory-bytes" if label == "vllm" else b"--kv-cache-memory"
            assert argv[argv.index(flag) + 1] == str(16 * 2**20).encode(), (label, argv)
        output = script("ab-run ab-table")
        records = json.loads((tmp_path / "results" / "ab_r0.json").read_text())
        assert len(records) == 6, output  # 3 servers x 1 rate x 2 rounds
        assert all(r["result"]["completed"] == 4 and r["result"]["failed"] == 0 for r in records)
        assert all(r["result"]["total_output_tokens"] == 4 * 5 for r in records)
        for round_index in (0, 1):
            runs = [r for r in records if r["round"] == round_index]
            assert len({r["seed"] for r in runs}) == 1  # one schedule and one prompt set per round
            assert sorted(r["position"] for r in runs) == [0, 1, 2]
        assert {r["label"]: r["position"] for r in records if r["round"] == 0} != {
            r["label"]: r["position"] for r in records if r["round"] == 1
        }
        for record in records:  # every run's steps, from each server's metrics endpoint
            steps, result = record["steps"], record["result"]
            assert steps["steps"] > 0 and steps["tokens_per_step"] == steps["tokens"] / steps["steps"], record
            assert steps["preemptions"] == 0, record  # KV enough for every request: nothing preempted
            assert steps["kv_tokens"] > 0, record  # each server states its KV capacity
            if record["label"] == "vllm":  # the stand-in counts a step per generated token
                assert steps["histogram"] == "vllm:iteration_tokens_total"
                assert steps["kv_tokens"] == 512 * 16  # its cache config's blocks x block size
                assert steps["steps"] == result["total_output_tokens"]
                assert steps["tokens"] == result["total_output_tokens"] + result["total_input_tokens"]
            else:  # the engine's own histogram: each request's 5 tokens take at least 4 decode steps after its prefill
                assert steps["histogram"] == "ominix_scheduler_step_tokens" and steps["steps"] >= 5, record
                assert steps["tokens"] <= result["total_input_tokens"] + result["total_output_tokens"], record
        assert len({r["steps"]["kv_tokens"] for r in records if r["label"] != "vllm"}) == 1  # the same KV
        table = (tmp_path / "results" / "ab_table.md").read_text().splitlines()
        for label in ("fast", "slow"):
            pair = next(line for line in table if line.startswith(f"| {label}/vllm "))
            assert pair.count("/2") == 8, pair  # every figure paired in both rounds
            ran = next(line for line in table if line.startswith(f"| {label} "))
            assert "| 2 " in ran and "| 0 " in ran, ran  # two rounds, nothing failed
        for title in ("Steps each server ran", "Share of ITL gaps at or above"):
            at = next(i for i, line in enumerate(table) if line.startswith(title))
            rows = table[at + 4 :]
            rows = rows[: rows.index("")] if "" in rows else rows
            assert {line.split("|")[1].strip() for line in rows} == {"vllm", "fast", "slow"}, title
        # DETAILED=1: every request's gaps and outcome kept, the run file gzipped, and the table reads it too.
        output = script("ab-run ab-table", DETAILED="1", AB_FIRST_ROUND="4", AB_ROUNDS="1")
        detailed = json.loads(gzip.decompress((tmp_path / "results" / "ab_r4.json.gz").read_bytes()))
        assert sorted(r["label"] for r in detailed) == ["fast", "slow", "vllm"], output
        for record in detailed:
            result = record["result"]
            assert result["successes"] == [True] * 4 and len(result["itls"]) == 4, record
            # The stall count takes streams of 3 gaps or more (a loaded machine may merge tokens into fewer).
            counted = sum(len(gaps) for gaps in result["itls"] if len(gaps) >= 3)
            assert result["itl_stalls"]["gaps"] == counted, record
        table = (tmp_path / "results" / "ab_table.md").read_text()
        assert "| fast/vllm " in table and "Stalls: runs of gaps" in table, output
        # Servers still up: a second ab-start refuses (it would lose track of them); a run over the same rounds
        # refuses (same seeds: it could be served from the prefix caches the first one filled).
        output = script("ab-start")
        assert "still listed" in output and _servers(tmp_path) == servers, output
        output = script("ab-run")
        assert "ab_r0.json exists" in output, output
        # A server that died: the next run stops at once and names it.
        os.killpg(int(servers[2][1]), signal.SIGKILL)
        started = time.monotonic()
        output = script("ab-run", AB_FIRST_ROUND="2", SECONDS_PER_RATE="60", RATE_S="200")
        assert time.monotonic() - started < 60, output
        assert "slow exited" in output and "last lines of" in output, output
    finally:
        output = script("ab-stop")
    for _, pid, *_ in servers:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert not (tmp_path / "work" / "ab_servers").exists(), output


def test_table_command_plots_the_medians(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    records = [
        _record(label, r, 4.0, ttft, 1000.0) for label, r, ttft in (("ours", 0, 30.0), ("vllm", 0, 40.0))
    ]
    records += [
        _record(label, r, 4.0, ttft, 900.0) for label, r, ttft in (("ours", 1, 50.0), ("vllm", 1, 44.0))
    ]
    runs = tmp_path / "ab.json"
    runs.write_text(json.dumps(records))
    png, table = tmp_path / "ab.png", tmp_path / "ab.md"
    argv = ["table", str(runs), "--baseline", "vllm", "--out-md", str(table), "--png", str(png)]
    assert online_ab.main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ours, vllm = online_ab.median_series(records)
    assert (ours.name, vllm.name) == ("ours", "vllm")
    assert ours.results[0]["median_ttft_ms"] == 40.0 and vllm.results[0]["median_ttft_ms"] == 42.0
    assert "| ours/vllm " in table.read_text()


def test_the_itl_tail_table_shows_each_servers_shares_over_its_rounds(tmp_path: Path) -> None:
    def with_tail(record: dict[str, object], share_20: float) -> dict[str, object]:
        shares = {f"share_at_least_{ms}ms": share_20 if ms <= 20 else 0.0 for ms in online.ITL_TAIL_MS}
        record["result"]["itl_tail"] = {"gaps": 1000, **shares}  # type: ignore[index]
        return record

    records = [
        with_tail(_record("ours", 0, 4.0, 30.0, 1000.0), 0.02),
        with_tail(_record("ours", 1, 4.0, 30.0, 1000.0), 0.04),
        with_tail(_record("vllm", 0, 4.0, 40.0, 1000.0), 0.01),
        _record("vllm", 1, 4.0, 40.0, 1000.0),  # recorded before the tail was: left out of it
    ]
    table = online_ab.format_itl_tail_table(records)
    assert table is not None
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    ours = [cell.strip() for cell in rows["ours"].split("|")[1:-1]]
    assert ours[:4] == ["ours", "4", "1,000 (1,000–1,000)", "3.00 (2.00–4.00)"]  # median, range of rounds, %
    assert ours[-1] == "0.00 (0.00–0.00)"
    vllm = [cell.strip() for cell in rows["vllm"].split("|")[1:-1]]
    assert vllm[2:4] == ["1,000", "1.00"]  # its one round with a tail
    assert online_ab.format_itl_tail_table([_record("ours", 0, 4.0, 30.0, 1000.0)]) is None
    runs = tmp_path / "ab.json"
    runs.write_text(json.dumps(records))
    out = tmp_path / "ab.md"
    assert online_ab.main(["table", str(runs), "--baseline", "vllm", "--out-md", str(out)]) == 0
    assert "Share of ITL gaps at or above each length" in out.read_text()


def test_records_of_one_round_twice_are_refused_and_a_zero_baseline_compares(tmp_path: Path) -> None:
    first, again = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(
        json.dumps([_record("ours", 0, 4.0, 30.0, 1000.0), _record("vllm", 0, 4.0, 40.0, 1000.0)])
    )
    again.write_text(json.dumps([_record("ours", 0, 4.0, 31.0, 1000.0)]))
    with pytest.raises(SystemExit, match="ran round 0 at 4 req/s already"):
        online_ab.load_records([first, again])
    records = [_record("ours", 0, 4.0, 30.0, 1000.0), _record("vllm", 0, 4.0, 40.0, 1000.0)]
    records[0]["result"]["request_goodput"] = 1.5  # type: ignore[index]
    records[1]["result"]["request_goodput"] = 0.0  # type: ignore[index]
    assert online_ab.paired_ratios(records, "ours", "vllm", 4.0, "request_goodput") == [(math.inf, True)]


def test_step_totals_are_read_from_either_engines_histogram() -> None:
    """bench/step_mix.py: ours (one series per worker, summed) and vLLM's histogram; an endpoint without one;
    the difference of two readings; an endpoint that cannot be read leaves the run a reason, not a crash."""
    import asyncio

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from bench import step_mix

    registry = CollectorRegistry()
    tokens = Histogram(
        "ominix_scheduler_step_tokens", "t", ["worker_id"], buckets=[8, 512], registry=registry
    )
    preempted = Counter("ominix_preemptions", "p", ["worker_id"], registry=registry)
    preempted.labels(worker_id="0").inc(2)
    for worker, values in (("0", [4, 600]), ("1", [10])):
        for value in values:
            tokens.labels(worker_id=worker).observe(value)
    before = step_mix.parse_step_totals(generate_latest(registry).decode())
    assert before == step_mix.StepTotals("ominix_scheduler_step_tokens", 3, 614, 2)
    tokens.labels(worker_id="1").observe(100)
    preempted.labels(worker_id="1").inc()
    after = step_mix.parse_step_totals(generate_latest(registry).decode())
    assert step_mix.step_mix(before, after) == {  # type: ignore[arg-type]
        "histogram": "ominix_scheduler_step_tokens",
        "steps": 1,
        "tokens": 100,
        "tokens_per_step": 100,
        "preemptions": 1,
        "kv_tokens": None,  # this endpoint states no capacity
    }
    capacity = Gauge("ominix_kv_capacity_tokens", "c", ["worker_id"], registry=registry)
    capacity.labels(worker_id="0").set(4096)
    capacity.labels(worker_id="1").set(1024)
    assert step_mix.parse_step_totals(generate_latest(registry).decode()).kv_tokens == 5120  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="went back"):  # a server that started again between the readings
        step_mix.step_mix(after, before)  # type: ignore[arg-type]
    # declared, no series yet (no step run): zero steps, not "no histogram"
    empty = CollectorRegistry()
    Histogram("ominix_scheduler_step_tokens", "t", ["worker_id"], buckets=[8], registry=empty)
    assert step_mix.parse_step_totals(generate_latest(empty).decode()) == step_mix.StepTotals(
        "ominix_scheduler_step_tokens", 0, 0
    )
    vllm = (
        "# TYPE vllm:iteration_tokens_total histogram\n"
        'vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="m"} 7.0\n'
        'vllm:iteration_tokens_total_count{engine="0",model_name="m"} 7.0\n'
        'vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 70.0\n'
    )
    reading = step_mix.parse_step_totals(vllm)
    assert reading == step_mix.StepTotals("vllm:iteration_tokens_total", 7, 70)  # no preemption counter
    counted = step_mix.parse_step_totals(vllm + 'vllm:num_preemptions_total{engine="0",model_name="m"} 4.0\n')
    assert counted == step_mix.StepTotals("vllm:iteration_tokens_total", 7, 70, 4)
    config = 'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="2000"} 1.0\n'
    assert step_mix.parse_step_totals(vllm + config).kv_tokens == 32_000  # type: ignore[union-attr]
    unsized = 'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="None"} 1.0\n'
    assert step_mix.parse_step_totals(vllm + unsized).kv_tokens is None  # type: ignore[union-attr]
    assert step_mix.step_mix(reading, counted)["preemptions"] is None  # type: ignore[arg-type]
    assert step_mix.step_mix(reading, reading)["tokens_per_step"] is None  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="different histograms"):
        step_mix.step_mix(before, reading)  # type: ignore[arg-type]
    assert step_mix.parse_step_totals("# TYPE up gauge\nup 1.0\n") is None
    for url in (
        "http://127.0.0.1:1/metrics",
        "http://127.0.0.1:abc/metrics",
    ):  # refused; an http.client error
        unreadable = asyncio.run(online_ab.read_steps(url))
        assert isinstance(unreadable, str) and url in unreadable
    assert online_ab.steps_of_run(before, "gone") == {"error": "gone"}  # type: ignore[arg-type]
    assert "different histograms" in online_ab.steps_of_run(before, reading)["error"]  # type: ignore[arg-type]


def test_steps_table_counts_unread_runs_and_runs_without_a_step(tmp_path: Path) -> None:
    """A run with no step (tokens per step null once written) and a run whose endpoint could not be read both
    reach the table, after a round trip through the run file, without stopping it."""
    records = [_record(label, r, 4.0, 30.0, 1000.0) for label in ("ours", "vllm") for r in (0, 1)]
    for record in records:
        record["result"]["duration"] = 10.0  # type: ignore[index]
    records[0]["steps"] = {
        "histogram": "h", "steps": 500.0, "tokens": 5000.0, "tokens_per_step": 10.0, "preemptions": 3.0,
        "kv_tokens": 90_000.0,
    }  # fmt: skip
    records[1]["steps"] = {
        "histogram": "h", "steps": 0.0, "tokens": 0.0, "tokens_per_step": None, "preemptions": None
    }  # fmt: skip
    records[2]["steps"] = {"error": "http://127.0.0.1:1/metrics: refused"}
    runs = tmp_path / "ab.json"
    from bench.common import write_json

    write_json(str(runs), records)
    text = online_ab.format_steps_table(online_ab.load_records([runs]))
    assert text is not None
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in text.splitlines()[2:]}
    header = [c.strip() for c in text.splitlines()[0].split("|")]
    ours = [c.strip() for c in rows[("ours", "4")].split("|")]
    assert ours[header.index("runs read")] == "2" and ours[header.index("not read")] == "0"
    assert ours[header.index("steps")] == "250 (0–500)" and ours[header.index("steps/s")] == "25.0 (0.0–50.0)"
    assert ours[header.index("tokens/step")] == "10.0"  # the run without a step has no tokens per step
    assert ours[header.index("preemptions")] == "3"  # nor a preemption count
    assert ours[header.index("KV tokens")] == "90,000"  # nor a capacity (a record of before the column: none)
    vllm = [c.strip() for c in rows[("vllm", "4")].split("|")]
    assert vllm[header.index("runs read")] == "0" and vllm[header.index("not read")] == "1"
    assert online_ab.format_steps_table([_record("ours", 0, 4.0, 30.0, 1000.0)]) is None


def test_the_stalls_table_reads_recorded_stalls_or_counts_them_from_detailed_gaps(tmp_path: Path) -> None:
    ms = 0.001
    recorded = _record("ours", 0, 4.0, 30.0, 1000.0)
    one_stall = online.itl_stalls([[5 * ms, 5 * ms, 25 * ms, 5 * ms]])
    recorded["result"]["itl_stalls"] = one_stall  # type: ignore[index]
    # A stall spread over two gaps (14 + 12 ms around a 5 ms median); the unsuccessful request's gaps are left
    # out by ``successes`` though it has no error message.
    detailed = _record("vllm", 0, 4.0, 40.0, 1000.0)
    stall_gaps = [5 * ms, 5 * ms, 14 * ms, 12 * ms, 5 * ms]
    detailed["result"].update(  # type: ignore[attr-defined]
        {"itls": [stall_gaps, [5 * ms, 5 * ms, 50 * ms]], "errors": ["", ""], "successes": [True, False]}
    )
    records = [recorded, detailed, _record("vllm", 1, 4.0, 40.0, 1000.0)]  # neither field: left out
    assert online_ab.stalls_of(records[2]["result"]) is None  # type: ignore[arg-type]
    table = online_ab.format_itl_stalls_table(records)
    assert table is not None
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
        for line in table.splitlines()[2:]
    }
    assert rows["ours"][1:8] == ["4", "250.0", "20.0", "20.0", "25.0", "25.0", "0"]
    assert rows["vllm"][1:8] == ["4", "200.0", "16.0", "16.0", "14.0", "14.0", "100"]
    # Files from before ``successes``: a request with an error message is left out.
    older = {"request_rate": 4.0, "itls": [stall_gaps, [5 * ms, 5 * ms, 50 * ms]], "errors": ["", "cut"]}
    assert online_ab.stalls_of(older) == online.itl_stalls([stall_gaps])
    with pytest.raises(SystemExit, match="lists 2 requests' gaps but 1 outcomes"):
        online_ab.stalls_of({**older, "errors": [""]})
    assert online_ab.format_itl_stalls_table([_record("ours", 0, 4.0, 30.0, 1000.0)]) is None
    runs = tmp_path / "ab.json.gz"
    runs.write_bytes(gzip.compress(json.dumps(records).encode()))
    out = tmp_path / "ab.md"
    assert online_ab.main(["table", str(runs), "--baseline", "vllm", "--out-md", str(out)]) == 0
    assert "Stalls: runs of gaps of at least 1.5x the stream's median gap" in out.read_text()
