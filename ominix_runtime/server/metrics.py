"""Prometheus metrics. The only module that imports prometheus_client.

Fed from the engine's run reports (one per finished request), step reports (one per worker step) and
periodic load / stats snapshots; served on its own HTTP port with its own registry.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.exposition import generate_latest

from ominix_runtime.engine.stats import EngineStats, LoadSnapshot, RunReport, StepReport

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True, slots=True)
class WorkerFigures:
    """Per-worker figures read from the engine's worker groups."""

    worker_id: str
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions: int
    integrity_violations: int
    prefix_cache_hit_ratio: float | None = None  # None: not known for this worker (request-level backend)


class EngineMetrics:
    """Metric families of one engine daemon, in a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("ominix_requests", "Finished requests by outcome.", ["outcome"], registry=r)
        self.queue_depth = Gauge(
            "ominix_queue_depth", "Requests admitted and waiting.", ["worker_id"], registry=r
        )
        self.running = Gauge("ominix_running_requests", "Requests holding KV.", ["worker_id"], registry=r)
        self.ttft = Histogram(
            "ominix_request_ttft_seconds", "Arrival to first token.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "ominix_request_tpot_seconds",
            "Mean time per output token after the first.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "ominix_request_e2e_seconds",
            "Arrival to the terminal event.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "ominix_request_queue_time_seconds",
            "Arrival to first scheduled.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "ominix_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            "ominix_generation_tokens", "Generated tokens of finished requests.", registry=r
        )
        self.kv_used = Gauge(
            "ominix_kv_blocks_used", "KV blocks leased or cached.", ["worker_id"], registry=r
        )
        self.kv_total = Gauge("ominix_kv_blocks_total", "KV blocks in all.", ["worker_id"], registry=r)
        self.prefix_hit_ratio = Gauge(
            "ominix_prefix_cache_hit_ratio",
            "Prompt tokens served from the prefix cache / prompt tokens.",
            ["worker_id"],
            registry=r,
        )
        self.preemptions = Counter(
            "ominix_preemptions", "Requests preempted (recompute).", ["worker_id"], registry=r
        )
        self.step_duration = Histogram(
            "ominix_scheduler_step_duration_seconds",
            "Wall time of one worker step.",
            ["worker_id"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "ominix_scheduler_batch_size",
            "Requests in one step.",
            ["worker_id"],
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.integrity_violations = Counter(
            "ominix_integrity_violations", "KV registry integrity check failures.", ["worker_id"], registry=r
        )
        self._last_cumulative: dict[tuple[str, str], float] = {}
        self._http_server: WSGIServer | None = None

    # ---- feeding -------------------------------------------------------------------------------------

    def observe_run(self, report: RunReport) -> None:
        """One finished request's run report."""
        self.requests.labels(outcome=report.finish_reason.name.lower()).inc()
        for histogram, value in (
            (self.ttft, report.ttft),
            (self.tpot, report.tpot),
            (self.e2e, report.e2e),
            (self.queue_time, report.queue_time),
        ):
            if value is not None and value >= 0:
                histogram.observe(value)
        self.prompt_tokens.inc(report.prompt_tokens)
        self.generation_tokens.inc(report.output_tokens)

    def observe_rejection(self) -> None:
        self.requests.labels(outcome="rejected").inc()

    def observe_step(self, worker_id: str, report: StepReport) -> None:
        """One worker step's report."""
        self.step_duration.labels(worker_id=worker_id).observe(report.duration)
        self.batch_size.labels(worker_id=worker_id).observe(report.batch_size)

    def update_snapshots(
        self, loads: Iterable[LoadSnapshot], stats: EngineStats, workers: Iterable[WorkerFigures] = ()
    ) -> None:
        """Gauges from per-worker load snapshots, per-worker registry figures and the engine-wide stats."""
        for load in loads:
            self.queue_depth.labels(worker_id=load.worker_id).set(load.queued_requests)
            self.running.labels(worker_id=load.worker_id).set(load.running_requests)
        for w in workers:
            self.kv_used.labels(worker_id=w.worker_id).set(w.kv_blocks_used)
            self.kv_total.labels(worker_id=w.worker_id).set(w.kv_blocks_total)
            self._advance(self.preemptions, w.worker_id, w.preemptions)
            self._advance(self.integrity_violations, w.worker_id, w.integrity_violations)
            if w.prefix_cache_hit_ratio is not None:
                self.prefix_hit_ratio.labels(worker_id=w.worker_id).set(w.prefix_cache_hit_ratio)
        self.prefix_hit_ratio.labels(worker_id="all").set(stats.prefix_cache_hit_ratio)

    def _advance(self, counter: Counter, worker_id: str, cumulative: float) -> None:
        """Counters from cumulative snapshot values: add what grew since the last snapshot."""
        key = (counter._name, worker_id)  # noqa: SLF001 - the family name is the natural key
        previous = self._last_cumulative.get(key, 0.0)
        if cumulative > previous:
            counter.labels(worker_id=worker_id).inc(cumulative - previous)
        else:
            counter.labels(worker_id=worker_id)  # make the series visible at 0
        self._last_cumulative[key] = max(previous, cumulative)

    # ---- serving -------------------------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def start_http(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics on ``host:port`` in a daemon thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http_server = server
        return int(server.server_address[1])

    def stop_http(self) -> None:
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None
