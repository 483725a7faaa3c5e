"""bench/policy_sim.py: the engine's scheduler under simulated arrivals ends every request with the workload's
output, its clock follows the cost model (a measured table of row counts included), each setting shows in the
steps it shapes, and a variant that names no SchedulerConfig field is refused."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # bench/ as a namespace package: its modules must not shadow installed ones

from bench.policy_sim import (  # noqa: E402
    LinearStepCost,
    MeasuredRowsCost,
    OverlappedStepCost,
    SimResult,
    Workload,
    arrivals_ms,
    capability,
    main,
    parse_variant,
    read_rows_ms,
    simulate,
)
from ominix_runtime.engine.config import EngineCoreConfig, SchedulerConfig  # noqa: E402

CAP = capability(max_batch_tokens=512, max_running=32, kv_blocks=2048)
COST = LinearStepCost(base_ms=2.0, decode_ms=0.1, prefill_ms=0.01)


def _run(config: SchedulerConfig, rate: float, prompts: int = 16, seed: int = 3) -> SimResult:
    w = Workload(rate, seconds=2.0, inf_prompts=prompts, input_len=96, output_len=12, seed=seed)
    return simulate(CAP, config, EngineCoreConfig(), COST, w)


def test_every_request_gets_its_tokens_and_the_clock_follows_the_cost() -> None:
    r = _run(SchedulerConfig(), math.inf)
    assert r.requests == 16 and len(r.ttft_ms) == 16 and len(r.tpot_ms) == 16
    assert len(r.itl_ms) == 16 * 11  # 12 tokens each: 11 gaps
    assert min(r.itl_ms) >= COST.base_ms  # a gap spans at least one step
    # The first step carries 5 whole prompts and part of a sixth (512 tokens, no decodes): its cost.
    assert min(r.ttft_ms) == pytest.approx(COST.base_ms + 512 * COST.prefill_ms)
    assert r.duration_ms >= max(r.ttft_ms)


def test_the_step_budget_with_decodes_bounds_every_step_that_carries_one() -> None:
    free = _run(SchedulerConfig(prefill_tokens_beside_decodes=0), math.inf)
    bounded = _run(
        SchedulerConfig(prefill_tokens_beside_decodes=0, max_batch_tokens_with_decodes=128), math.inf
    )
    assert free.max_tokens_beside_decodes > 128
    assert bounded.max_tokens_beside_decodes == 128
    assert max(bounded.itl_ms) < max(free.itl_ms)


def test_arrivals_are_online_py_s_and_seeded() -> None:
    a = _run(SchedulerConfig(), 20.0)
    b = _run(SchedulerConfig(), 20.0)
    c = _run(SchedulerConfig(), 20.0, seed=4)
    assert a.requests == b.requests == c.requests == 40  # 2 s at 20 req/s, as bench/online.py sends
    assert a.ttft_ms == b.ttft_ms and a.ttft_ms != c.ttft_ms
    times = arrivals_ms(Workload(20.0, 2.0, 0, 8, 8, seed=3))
    assert times == sorted(times) and times[-1] == pytest.approx(2_000.0)  # the last at count / rate


def test_the_engine_s_in_flight_depth() -> None:
    engine = EngineCoreConfig()
    assert engine.inflight_limit(0, 0) == 2 and engine.inflight_limit(127, 0) == 2
    assert engine.inflight_limit(128, 0) == engine.max_inflight_steps == 3
    assert engine.inflight_limit(5, 1) == 3  # a request waits for admission: a backlog, not light load
    assert EngineCoreConfig(light_load_below_running=0).inflight_limit(0, 0) == 3
    assert EngineCoreConfig(max_inflight_steps=1).inflight_limit(0, 0) == 1


def test_variants_name_scheduler_fields() -> None:
    label, config = parse_variant("small=prefill_tokens_beside_decodes=64,enable_prefix_caching=false")
    assert label == "small"
    assert config.prefill_tokens_beside_decodes == 64 and not config.enable_prefix_caching
    assert parse_variant("default=")[1] == SchedulerConfig()
    for bad in ("noequals", "x=not_a_field=3", "x=max_bypass_steps=many", "x=enable_prefix_caching=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_variant(bad)


def test_the_command_writes_one_row_per_rate_and_variant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    argv = ["--rates", "20,inf", "--seconds", "1", "--inf-prompts", "8", "--input-len", "64", "--output-len", "6",
            "--seeds", "2", "--max-batch-tokens", "256", "--max-running-requests", "16", "--kv-blocks", "512",
            "--variant", "a=", "--variant", "b=max_batch_tokens_with_decodes=64", "--out-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    assert [(r["variant"], r["rate"]) for r in rows] == [("a", "20"), ("b", "20"), ("a", "inf"), ("b", "inf")]
    assert rows[3]["max_tokens_beside_decodes"] <= 64 < rows[2]["max_tokens_beside_decodes"]
    assert "itl_p99" in capsys.readouterr().out


def test_the_overlapped_cost_takes_the_larger_of_the_weights_and_the_prefill() -> None:
    from ominix_runtime.release.cost_model import StepShape

    def shape(decodes: int, prefill: int) -> StepShape:
        return StepShape(prefill_tokens=prefill, decode_tokens=decodes, kv_blocks_in_use=0)

    overlapped = OverlappedStepCost(base_ms=5.0, decode_ms=0.05, prefill_ms=0.02)
    linear = LinearStepCost(base_ms=5.0, decode_ms=0.05, prefill_ms=0.02)
    assert overlapped.step_ms(shape(8, 1024)) == pytest.approx(20.48 + 0.4)
    assert linear.step_ms(shape(8, 1024)) == pytest.approx(5.0 + 20.48 + 0.4)
    assert overlapped.step_ms(shape(8, 100)) == pytest.approx(5.0 + 0.4)  # the weights' floor
    assert overlapped.step_ms(shape(0, 0)) == 0.0
    # A prompt in two chunks costs the decode rows of one more step, not a second fixed part as well.
    assert 2 * overlapped.step_ms(shape(8, 512)) == pytest.approx(overlapped.step_ms(shape(8, 1024)) + 0.4)


def test_the_cost_option_picks_the_model(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    args = ["--rates", "4", "--seconds", "1", "--seeds", "1", "--input-len", "64", "--output-len", "4"]
    assert main([*args, "--cost", "overlapped", "--out-json", str(out)]) == 0
    overlapped = json.loads(out.read_text())
    assert main([*args, "--cost", "linear", "--out-json", str(out)]) == 0
    linear = json.loads(out.read_text())
    assert overlapped != linear  # 64-token prompts: the overlapped steps lose their prefill cost
    with pytest.raises(SystemExit):
        main([*args, "--cost", "quadratic"])


def test_the_measured_cost_pads_a_step_to_the_table_and_extends_it_past_its_end() -> None:
    from ominix_runtime.release.cost_model import StepShape

    def shape(decodes: int, prefill: int) -> StepShape:
        return StepShape(prefill_tokens=prefill, decode_tokens=decodes, kv_blocks_in_use=0)

    cost = MeasuredRowsCost(5.0, 0.05, 0.02, {512: 10.0, 544: 13.0, 1024: 19.5, 1056: 21.5})
    assert cost.rows_time_ms(520) == 13.0  # padded to the next measured count, not interpolated
    assert cost.rows_time_ms(512) == 10.0 and cost.rows_time_ms(1) == 10.0
    assert cost.rows_time_ms(2112) == pytest.approx(43.0)  # past the table: the largest count's rate per row
    assert cost.step_ms(shape(8, 1024)) == pytest.approx(21.5 + 0.4)  # 1,032 rows: the 1,056 entry
    assert cost.step_ms(shape(8, 504)) == pytest.approx(10.0 + 0.4)  # 512 rows exactly
    # A prompt split in halves pays the slow count twice: what the straight lines never showed.
    assert 2 * cost.step_ms(shape(8, 512)) > cost.step_ms(shape(8, 1024)) + 4.0
    assert cost.step_ms(shape(200, 0)) == pytest.approx(5.0 + 10.0)  # decodes alone: the weights' floor
    assert cost.step_ms(shape(0, 0)) == 0.0
    for bad in ({}, {0: 1.0}, {64: 0.0}, {64: math.nan}, {64: math.inf}):
        with pytest.raises(ValueError, match="positive"):
            MeasuredRowsCost(5.0, 0.05, 0.02, bad)


def test_the_measured_table_is_read_from_prefix_step_json_or_a_plain_object(tmp_path: Path) -> None:
    stored = read_rows_ms(REPO / "bench" / "configs" / "h200-llama8b-bucket-ms.json")
    assert len(stored) == 64 and min(stored) == 32 and max(stored) == 2048
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"64": 5.0, "128": 6.5}))
    assert read_rows_ms(plain) == {64: 5.0, 128: 6.5}
    no_buckets = json.dumps({"suffix_step": {"median_ms": 6.1}, "trials": 15})  # run without the timing
    for text in (
        json.dumps({"piecewise_bucket_ms": {}}),
        no_buckets,
        json.dumps([1, 2]),
        json.dumps({"x": 1.0}),
    ):
        plain.write_text(text)
        with pytest.raises(ValueError, match=str(plain)):
            read_rows_ms(plain)


def test_the_measured_cost_needs_its_table_and_the_table_its_cost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = tmp_path / "rows.json"
    table.write_text(json.dumps({"256": 6.0, "1024": 20.0, "2048": 41.0}))
    args = ["--rates", "4", "--seconds", "1", "--seeds", "1", "--input-len", "64", "--output-len", "4"]
    out = tmp_path / "sim.json"
    assert main([*args, "--cost", "measured", "--bucket-ms", str(table), "--out-json", str(out)]) == 0
    measured = json.loads(out.read_text())
    assert main([*args, "--cost", "overlapped", "--out-json", str(out)]) == 0
    # 64-token prompts: the table's smallest count (256 rows, 6 ms) lifts their steps above the 5 ms floor.
    assert (
        measured[0]["variant"] == "default"
        and measured[0]["ttft_p50"] > json.loads(out.read_text())[0]["ttft_p50"]
    )
    for extra in (["--cost", "measured"], ["--bucket-ms", str(table)]):
        with pytest.raises(SystemExit):
            main([*args, *extra])
        assert "go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--cost", "measured", "--bucket-ms", str(tmp_path / "missing.json")])
    assert "missing.json" in capsys.readouterr().err
