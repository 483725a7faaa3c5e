"""The per-worker metric families of /metrics against what each backend kind can know: a step-level group
(the engine keeps its KV and prefix cache) exports the KV and prefix-cache series; a request-level backend
(SGLang, whose cache is its own) exports neither, rather than series stuck at 0 (docs/METRICS.md)."""

from __future__ import annotations

from dataclasses import fields

from prometheus_client import generate_latest

from ominix_runtime.engine.stats import WorkerStats
from ominix_runtime.server.metrics import EngineMetrics


def _stats(worker_id: str, backend: str, kv_known: bool) -> WorkerStats:
    numbers = {f.name: 3 for f in fields(WorkerStats) if f.type in ("int", int)}
    return WorkerStats(
        **{
            **numbers,
            "worker_id": worker_id,
            "backend": backend,
            "model_name": "m",
            "up": True,
            "kv_known": kv_known,
        }
    )


def test_a_request_level_backend_exports_no_kv_or_prefix_cache_series() -> None:
    metrics = EngineMetrics("m")
    metrics.update_workers(
        [_stats("gpu-0", "cuda", kv_known=True), _stats("sglang@h:1", "sglang", kv_known=False)]
    )
    lines = generate_latest(metrics.registry).decode().splitlines()
    for family in (
        "ominix_kv_blocks_used",
        "ominix_prefix_cache_hit_tokens_total",
        "ominix_prefix_cache_queried_tokens_total",
    ):
        series = [line for line in lines if line.startswith(family + "{")]
        assert [s for s in series if 'worker_id="gpu-0"' in s], (family, series)
        assert not [s for s in series if "sglang" in s], (family, series)
    assert [line for line in lines if line.startswith("ominix_worker_up{") and "sglang" in line]
