"""The periodic stats line: throughput between two lines, KV usage, idle lines skipped."""

from __future__ import annotations

from ominix_runtime.engine.stats import EngineStats
from ominix_runtime.server.stats_line import StatsLine


def test_stats_line_measures_throughput_between_lines() -> None:
    line = StatsLine(now=100.0)
    busy = EngineStats(
        prompt_tokens=400,
        generated_tokens=50,
        running_requests=3,
        queued_requests=2,
        kv_blocks_used=16,
        kv_blocks_total=64,
    )
    fields = line.fields(busy, now=102.0)
    assert fields["prompt_tokens_per_s"] == 200.0 and fields["generation_tokens_per_s"] == 25.0
    assert fields["running"] == 3 and fields["waiting"] == 2 and fields["kv_usage"] == 0.25
    assert not StatsLine.idle(fields)
    later = EngineStats(prompt_tokens=400, generated_tokens=50, kv_blocks_total=64)
    quiet = line.fields(later, now=112.0)
    assert quiet["generation_tokens_per_s"] == 0.0 and StatsLine.idle(quiet)
