"""promtool checks a live scrape of a daemon that served requests; every metric the dashboard and the alert
rules use exists in it; the figures in it agree with what was served."""

from __future__ import annotations

import json
import re

import yaml
from obs_daemon import REQUESTS, Scraped
from obs_tools import DEPLOY, promtool, run
from prometheus_client.parser import text_string_to_metric_families

_METRIC = re.compile(r"\b(ominix_[a-z0-9_]+)")


def _samples(text: str) -> dict[str, list]:
    """Sample name -> samples (a histogram contributes its _bucket, _sum and _count names)."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _value(samples: dict[str, list], name: str, **labels: str) -> float:
    return sum(s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items()))


def test_promtool_accepts_the_live_scrape(served: Scraped) -> None:
    result = run([promtool(), "check", "metrics"], input=served.text)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stdout + result.stderr


def test_promtool_flags_a_convention_break(served: Scraped) -> None:
    """The check can fail: a gauge named like a counter (the old ominix_kv_blocks_total) is reported."""
    broken = served.text + "# HELP ominix_kv_blocks_total KV blocks.\n# TYPE ominix_kv_blocks_total gauge\n"
    broken += 'ominix_kv_blocks_total{worker_id="w"} 1.0\n'
    result = run([promtool(), "check", "metrics"], input=broken)
    assert result.returncode != 0
    assert "ominix_kv_blocks_total" in result.stdout + result.stderr


def test_no_created_series_and_build_info(served: Scraped) -> None:
    samples = _samples(served.text)
    assert not [n for n in samples if n.endswith("_created")]
    (build,) = samples["ominix_build_info"]
    assert build.value == 1 and build.labels["version"] and build.labels["python_version"]


def test_every_metric_in_the_dashboard_and_alerts_is_scraped(served: Scraped) -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "ominix-runtime.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    used = {m for e in exprs for m in _METRIC.findall(e)}
    assert len(used) >= 20, sorted(used)
    missing = used - set(_samples(served.text))
    assert not missing, f"used by the dashboard or the alerts but not exported: {sorted(missing)}"


def test_scraped_figures_match_what_was_served(served: Scraped) -> None:
    s = _samples(served.text)
    model = next(iter({x.labels["model_name"] for x in s["ominix_request_ttft_seconds_count"]}))
    assert model == "tiny-llama"
    done = _value(s, "ominix_requests_total", finish_reason="length") + _value(
        s, "ominix_requests_total", finish_reason="stop"
    )
    assert done == REQUESTS
    assert _value(s, "ominix_requests_total", finish_reason="abort") == 1
    assert _value(s, "ominix_request_rejections_total", reason="model_not_found") == 1
    assert _value(s, "ominix_request_ttft_seconds_count") == REQUESTS + 1
    # max_tokens 4..9 over the finished requests: ITL has (n - 1) gaps per request at most one per step.
    generated = _value(s, "ominix_request_generation_tokens_sum")
    assert generated >= sum(range(4, 4 + REQUESTS))
    assert 0 < _value(s, "ominix_request_inter_token_latency_seconds_count") <= generated
    (worker,) = s["ominix_worker_up"]
    assert worker.value == 1 and worker.labels["backend"] == "cpu"
    wid = worker.labels["worker_id"]
    capacity = _value(s, "ominix_kv_blocks_capacity", worker_id=wid)
    parts = sum(_value(s, f"ominix_kv_blocks_{k}", worker_id=wid) for k in ("used", "cached", "free"))
    assert capacity > 0 and parts == capacity
    assert _value(s, "ominix_kv_capacity_tokens", worker_id=wid) == capacity * 16  # the CPU worker's blocks
    # Requests 2..5 share their prompt with an earlier one: the prefix cache served full blocks of it.
    hits = _value(s, "ominix_prefix_cache_hit_tokens_total", worker_id=wid)
    assert 0 < hits < _value(s, "ominix_prefix_cache_queried_tokens_total", worker_id=wid)
    assert _value(s, "ominix_generation_tokens_total", worker_id=wid) >= generated
    assert _value(s, "ominix_scheduler_step_duration_seconds_count", worker_id=wid) > 0
    for counter in ("ominix_integrity_violations_total", "ominix_worker_failovers_total"):
        assert _value(s, counter, worker_id=wid) == 0
