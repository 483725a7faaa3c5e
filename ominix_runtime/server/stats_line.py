"""The periodic stats line (``--stats-interval``): running and waiting requests, KV usage, throughput."""

from __future__ import annotations

import time
from typing import Any

from ominix_runtime.engine.stats import EngineStats


class StatsLine:
    """Fields of one stats line; throughput is measured between two consecutive lines."""

    def __init__(self, now: float | None = None) -> None:
        self._last: tuple[float, int, int] | None = None
        if now is not None:
            self._last = (now, 0, 0)

    def fields(self, stats: EngineStats, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        prompt, generated = stats.prompt_tokens, stats.generated_tokens
        prompt_rate = generation_rate = 0.0
        if self._last is not None:
            then, last_prompt, last_generated = self._last
            elapsed = max(now - then, 1e-9)
            prompt_rate = (prompt - last_prompt) / elapsed
            generation_rate = (generated - last_generated) / elapsed
        self._last = (now, prompt, generated)
        total = stats.kv_blocks_total
        return {
            "running": stats.running_requests,
            "waiting": stats.queued_requests,
            "kv_usage": round(stats.kv_blocks_used / total, 4) if total else 0.0,
            "prompt_tokens_per_s": round(prompt_rate, 1),
            "generation_tokens_per_s": round(generation_rate, 1),
            "prefix_cache_hit_ratio": round(stats.prefix_cache_hit_ratio, 4),
        }

    @staticmethod
    def idle(fields: dict[str, Any]) -> bool:
        """Nothing running, waiting or flowing: repeated idle lines carry no news."""
        return not (
            fields["running"]
            or fields["waiting"]
            or fields["prompt_tokens_per_s"]
            or fields["generation_tokens_per_s"]
        )
