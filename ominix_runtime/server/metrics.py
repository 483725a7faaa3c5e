"""Prometheus metrics. The only module that imports prometheus_client.

Fed from the engine's plain reports: one run report per finished request, one step report per worker step,
and per-worker stats snapshots (gauges and cumulative counters) read periodically. Served on its own HTTP
port from a private registry. Names follow the Prometheus conventions (base units, ``_total`` only on
counters, no ``_created`` series); docs/METRICS.md lists each family with its vLLM and TGI counterpart.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from ominix_runtime import __version__
from ominix_runtime.contract import FinishReason, RuntimeErrorKind
from ominix_runtime.engine.stats import RunReport, StepReport, WorkerStats

# `_created` series double every counter and histogram and no dashboard reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated

# Buckets span a CPU worker (tens to hundreds of ms per token, seconds to first token) and a GPU worker
# (a few ms per token, tens of ms to first token), with enough resolution around each to read p50/p99.
TTFT_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip
REQUEST_SECONDS_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
    120.0, 300.0, 600.0, 1200.0,
)  # fmt: skip
TOKENS_PER_REQUEST_BUCKETS = (
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 4000, 8000, 16000, 32000, 64000, 128000,
)  # fmt: skip
STEP_SECONDS_BUCKETS = (
    0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STEP_TOKENS_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

FINISH_REASONS = tuple(r.name.lower() for r in FinishReason)
# Why a request was refused before it ran: the error kinds, a model this engine does not serve, a bad id.
REJECTION_REASONS = (
    *(k.name.lower() for k in RuntimeErrorKind),
    "model_not_found",
    "invalid_request_id",
    "duplicate_request_id",
)


class EngineMetrics:
    """Metric families of one engine daemon, in a private registry."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = ""
        r = self.registry
        build = Gauge(
            "ominix_build_info",
            "Always 1; the labels say which build of ominix-runtime serves.",
            ["version", "python_version"],
            registry=r,
        )
        build.labels(version=__version__, python_version=platform.python_version()).set(1)
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self.requests = Counter(
            "ominix_requests",
            "Requests that ended after admission, by finish reason (stop, length, abort, error).",
            ["model_name", "finish_reason"],
            registry=r,
        )
        self.rejections = Counter(
            "ominix_request_rejections",
            "Requests refused before admission, by reason (an error kind, or model_not_found).",
            ["model_name", "reason"],
            registry=r,
        )
        self.front_processes = Gauge(
            "ominix_front_processes",
            "Front processes serving the clients' streams on the engine port (--front-procs).",
            registry=r,
        )
        self.front_restarts = Counter(
            "ominix_front_restarts",
            "Front processes started again after one exited (its clients' streams broke).",
            registry=r,
        )

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r)

        self.ttft = histogram(
            "ominix_request_ttft_seconds", "Arrival to the first output token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "ominix_request_inter_token_latency_seconds",
            "Gap between consecutive token deliveries of one request (one sample per step).",
            TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "ominix_request_tpot_seconds",
            "Mean time per output token after the first, per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "ominix_request_e2e_seconds", "Arrival to the terminal event.", REQUEST_SECONDS_BUCKETS
        )
        self.queue_time = histogram(
            "ominix_request_queue_time_seconds",
            "Arrival to first scheduled on a worker.",
            REQUEST_SECONDS_BUCKETS,
        )
        self.prefill_time = histogram(
            "ominix_request_prefill_time_seconds",
            "First scheduled to the first output token.",
            REQUEST_SECONDS_BUCKETS,
        )
        self.decode_time = histogram(
            "ominix_request_decode_time_seconds",
            "First output token to the terminal event.",
            REQUEST_SECONDS_BUCKETS,
        )
        self.prompt_tokens = histogram(
            "ominix_request_prompt_tokens", "Prompt tokens per finished request.", TOKENS_PER_REQUEST_BUCKETS
        )
        self.generation_tokens = histogram(
            "ominix_request_generation_tokens",
            "Generated tokens per finished request.",
            TOKENS_PER_REQUEST_BUCKETS,
        )
        self.step_duration = Histogram(
            "ominix_scheduler_step_duration_seconds",
            "Wall time of one worker step, from its start on the worker to its result.",
            ["worker_id"],
            buckets=STEP_SECONDS_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "ominix_scheduler_batch_size",
            "Requests in one worker step.",
            ["worker_id"],
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.step_tokens = Histogram(
            "ominix_scheduler_step_tokens",
            "Tokens computed in one worker step (prefill and decode).",
            ["worker_id"],
            buckets=STEP_TOKENS_BUCKETS,
            registry=r,
        )
        self.workers = WorkerCollector()
        r.register(self.workers)
        self._http_server: Any = None
        if model_name:
            self.set_model_name(model_name)

    def set_model_name(self, model_name: str) -> None:
        """The served model: the label of requests that named none; its series start at 0."""
        self.model_name = model_name
        for reason in FINISH_REASONS:
            self.requests.labels(model_name=model_name, finish_reason=reason)
        for reason in REJECTION_REASONS:
            self.rejections.labels(model_name=model_name, reason=reason)

    # ---- feeding -------------------------------------------------------------------------------------

    def observe_run(self, report: RunReport) -> None:
        """One finished request's run report."""
        model = report.model or self.model_name
        self.requests.labels(model_name=model, finish_reason=report.finish_reason.name.lower()).inc()
        phases = (
            (self.ttft, report.ttft),
            (self.tpot, report.tpot),
            (self.e2e, report.e2e),
            (self.queue_time, report.queue_time),
            (self.prefill_time, _difference(report.ttft, report.queue_time)),
            (self.decode_time, _difference(report.e2e, report.ttft)),
        )
        for histogram, value in phases:
            if value is not None and value >= 0:
                histogram.labels(model_name=model).observe(value)
        itl = self.itl.labels(model_name=model)
        for gap in report.inter_token_latencies:
            itl.observe(gap)
        self.prompt_tokens.labels(model_name=model).observe(report.prompt_tokens)
        self.generation_tokens.labels(model_name=model).observe(report.output_tokens)

    def observe_rejection(self, reason: str, model: str = "") -> None:
        """A request refused before admission; ``reason`` is one of :data:`REJECTION_REASONS`."""
        self.rejections.labels(model_name=model or self.model_name, reason=reason).inc()

    def observe_step(self, worker_id: str, report: StepReport) -> None:
        """One worker step's report."""
        self.step_duration.labels(worker_id=worker_id).observe(report.duration)
        self.batch_size.labels(worker_id=worker_id).observe(report.batch_size)
        self.step_tokens.labels(worker_id=worker_id).observe(report.num_tokens)

    def update_workers(self, workers: Iterable[WorkerStats]) -> None:
        """The latest per-worker stats snapshot (gauges now, counters since start)."""
        self.workers.update(list(workers))

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


def _difference(end: float | None, start: float | None) -> float | None:
    return end - start if end is not None and start is not None else None


class WorkerCollector(Collector):
    """Per-worker gauges and counters, exported from the latest :class:`WorkerStats` snapshot.

    A worker group's own counters start again when it reconnects to a restarted worker (a fresh KV
    registry); the exported counters carry the earlier total forward, so they only ever grow.
    """

    def __init__(self) -> None:
        self._stats: list[WorkerStats] = []
        self._carried: dict[tuple[str, str], tuple[int, int]] = {}  # (name, worker) -> (base, last)

    def update(self, stats: list[WorkerStats]) -> None:
        for w in stats:
            for name, value in _counter_values(w):
                base, last = self._carried.get((name, w.worker_id), (0, 0))
                if value < last:  # the group's counter started again
                    base += last
                self._carried[(name, w.worker_id)] = (base, value)
        self._stats = stats

    def _counter(self, name: str, worker_id: str) -> int:
        base, last = self._carried.get((name, worker_id), (0, 0))
        return base + last

    def describe(self) -> Iterator[Metric]:
        return iter(self._families([]))

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(self._stats))

    def _families(self, stats: list[WorkerStats]) -> list[Metric]:
        wid = ["worker_id"]
        up = GaugeMetricFamily(
            "ominix_worker_up",
            "1 while the engine's stream to the worker is open and healthy, else 0.",
            labels=["worker_id", "backend"],
        )
        gauges = {
            "running": GaugeMetricFamily(
                "ominix_requests_running", "Requests scheduled on the worker (holding KV).", labels=wid
            ),
            "waiting": GaugeMetricFamily(
                "ominix_requests_waiting", "Requests admitted and waiting to be scheduled.", labels=wid
            ),
            "preempted": GaugeMetricFamily(
                "ominix_requests_preempted",
                "Waiting requests that were preempted and will be recomputed.",
                labels=wid,
            ),
        }
        kv = {
            "capacity": GaugeMetricFamily(
                "ominix_kv_blocks_capacity", "KV cache blocks the worker holds in all.", labels=wid
            ),
            "capacity_tokens": GaugeMetricFamily(
                "ominix_kv_capacity_tokens",
                "Tokens the worker's KV blocks hold in all (blocks x tokens per block).",
                labels=wid,
            ),
            "used": GaugeMetricFamily(
                "ominix_kv_blocks_used", "KV blocks leased by live requests.", labels=wid
            ),
            "cached": GaugeMetricFamily(
                "ominix_kv_blocks_cached",
                "KV blocks not leased that keep prefix-cache content (reusable, evicted on demand).",
                labels=wid,
            ),
            "free": GaugeMetricFamily(
                "ominix_kv_blocks_free", "KV blocks neither leased nor caching content.", labels=wid
            ),
            "ratio": GaugeMetricFamily(
                "ominix_kv_usage_ratio",
                "Leased KV blocks / KV capacity (0 to 1); cached blocks count as available.",
                labels=wid,
            ),
        }
        counters = {
            name: CounterMetricFamily(metric, doc, labels=wid)
            for name, (metric, doc) in _COUNTER_FAMILIES.items()
        }
        token_labels = ["model_name", "worker_id"]
        prompt = CounterMetricFamily(
            "ominix_prompt_tokens", "Prompt tokens of requests admitted on the worker.", labels=token_labels
        )
        generation = CounterMetricFamily(
            "ominix_generation_tokens", "Tokens the worker generated.", labels=token_labels
        )
        for w in stats:
            up.add_metric([w.worker_id, w.backend], 1.0 if w.up else 0.0)
            gauges["running"].add_metric([w.worker_id], w.running_requests)
            gauges["waiting"].add_metric([w.worker_id], w.waiting_requests)
            gauges["preempted"].add_metric([w.worker_id], w.preempted_requests)
            if w.kv_known:
                kv["capacity"].add_metric([w.worker_id], w.kv_blocks_capacity)
                kv["capacity_tokens"].add_metric([w.worker_id], w.kv_blocks_capacity * w.kv_block_size)
                kv["used"].add_metric([w.worker_id], w.kv_blocks_used)
                kv["cached"].add_metric([w.worker_id], w.kv_blocks_cached)
                kv["free"].add_metric([w.worker_id], w.kv_blocks_free)
                ratio = w.kv_blocks_used / w.kv_blocks_capacity if w.kv_blocks_capacity else 0.0
                kv["ratio"].add_metric([w.worker_id], ratio)
            for name, family in counters.items():
                if name in _PREFIX_CACHE_COUNTERS and not w.kv_known:
                    continue  # a request-level backend's cache is its own: no series that would stay at 0
                family.add_metric([w.worker_id], self._counter(name, w.worker_id))
            prompt.add_metric([w.model_name, w.worker_id], self._counter("prompt_tokens", w.worker_id))
            generation.add_metric(
                [w.model_name, w.worker_id], self._counter("generation_tokens", w.worker_id)
            )
        return [up, *gauges.values(), *kv.values(), *counters.values(), prompt, generation]


# Counter families of the engine's prefix cache: only for backends whose KV the engine keeps (kv_known).
_PREFIX_CACHE_COUNTERS = frozenset({"prefix_queried_tokens", "prefix_hit_tokens"})
# Counter families read from WorkerStats: key -> (metric name without _total, help).
_COUNTER_FAMILIES: dict[str, tuple[str, str]] = {
    "prefix_queried_tokens": (
        "ominix_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache at admission.",
    ),
    "prefix_hit_tokens": (
        "ominix_prefix_cache_hit_tokens",
        "Prompt tokens found in the prefix cache at admission (not recomputed).",
    ),
    "preemptions": ("ominix_preemptions", "Requests preempted to free KV (recomputed later)."),
    "admission_held_steps": (
        "ominix_backlog_admission_held_steps",
        "Steps that left a backlog waiting for more free running slots (--backlog-admission-slots).",
    ),
    "burst_budget_steps": (
        "ominix_burst_budget_steps",
        "Steps beside decodes that took a burst's token budget (--max-batch-tokens-in-burst).",
    ),
    "failovers": (
        "ominix_worker_failovers",
        "Times the worker failed (stream broken, heartbeat or step missed) and its requests failed over.",
    ),
    "restarts": (
        "ominix_worker_restarts",
        "Times the engine reconnected to the worker after a failure (the worker was restarted).",
    ),
    "resumed_requests": (
        "ominix_requests_resumed",
        "Requests taken over by this worker from a failed one (resumed from the tokens already sent).",
    ),
    "integrity_violations": (
        "ominix_integrity_violations",
        "KV registry integrity check failures (should stay 0).",
    ),
    "protocol_violations": (
        "ominix_protocol_violations",
        "Events a request-level backend sent against the event contract (should stay 0).",
    ),
}


def _counter_values(w: WorkerStats) -> list[tuple[str, int]]:
    values = [(name, int(getattr(w, name))) for name in _COUNTER_FAMILIES]
    return [*values, ("prompt_tokens", w.prompt_tokens), ("generation_tokens", w.generation_tokens)]
