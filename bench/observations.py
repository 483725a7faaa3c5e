"""Per-request observations of a bench/serve.py run in the release gate's format (docs/RELEASE.md).

Request ``i`` of a run is ``req-i``: the same seed gives the same prompts, so two runs (two builds of ours,
or ours and vLLM/SGLang converted by ``ominix-runtime mirror-gate``) join on it. Queue depth is the engine's
queued requests at the last GetLoad sample before the request was sent; KV pressure is the highest KV use
sampled while it ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.serve import BenchResult, LoadSample, RequestResult


def _queue_depth(samples: Sequence[LoadSample], at_s: float) -> int | None:
    before = [s for s in samples if s.time_s <= at_s]
    return before[-1].queued_requests if before else (samples[0].queued_requests if samples else None)


def _kv_pressure_pct(samples: Sequence[LoadSample], start_s: float, end_s: float) -> float | None:
    during = [s.kv_pressure_pct for s in samples if start_s <= s.time_s <= end_s]
    if during:
        return round(max(during), 3)
    before = [s for s in samples if s.time_s <= start_s]  # a request shorter than the sampling period
    return round(before[-1].kv_pressure_pct, 3) if before else None


def observation(
    r: RequestResult,
    samples: Sequence[LoadSample],
    *,
    backend: str,
    accelerator: str,
    model_version: str,
    route: str,
    replica: str,
) -> dict[str, object]:
    ttft = r.ttft_s
    return {
        "request_id": f"req-{r.index}",
        "backend": backend,
        "accelerator": accelerator,
        "model_version": model_version,
        "ok": r.success,
        "error": r.error,
        "latency_ms": round(r.e2el_s * 1e3, 3),
        "ttft_ms": round(ttft * 1e3, 3) if ttft is not None else None,
        "decode_gaps_ms": [round(g * 1e3, 3) for g in r.itls_s],
        "output_token_ids": list(r.output_token_ids),
        "queue_depth": _queue_depth(samples, r.send_time),
        "kv_pressure_pct": _kv_pressure_pct(samples, r.send_time, r.end_time),
        "route": route,
        "replica": replica,
    }


def observations_side(
    result: BenchResult, *, build: str, backend: str, accelerator: str, model_version: str, replica: str
) -> dict[str, object]:
    """One side of a gate input: ``{"build": ..., "observations": [...]}``."""
    return {
        "build": build,
        "observations": [
            observation(
                r,
                result.load_samples,
                backend=backend,
                accelerator=accelerator,
                model_version=model_version,
                route=result.address,
                replica=replica,
            )
            for r in result.requests
        ],
    }
