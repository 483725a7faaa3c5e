"""Load generator for the engine's front API (``ominix.runtime.v1.Engine``) over grpc.aio.

Sends requests at a Poisson or gamma arrival rate (or all at once), streams every response and measures, per
request: TTFT (send to first token), TPOT = (E2EL - TTFT) / (output tokens - 1), ITL (gap between successive
token chunks) and E2EL. Prints mean/median/p99, request and token throughput, goodput under SLOs; writes JSON
and a PNG of the distributions and of throughput over time.

    python bench/serve.py --address 127.0.0.1:50061 --num-requests 64 --input-len 256 --output-len 64
    python bench/serve.py --launch --devices cpu --num-requests 8 --input-len 64 --output-len 16

Library use: ``await run_benchmark(address, BenchConfig(...))`` returns a ``BenchResult``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import multiprocessing
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: import ``bench.*`` from the repository root.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import (  # noqa: E402
    PlotData,
    Summary,
    exit_code_of,
    fmt,
    launch_service,
    run_while_alive,
    summarize_seconds,
    write_json,
    write_plot,
)
from bench.openai_front import is_openai  # noqa: E402
from ominix_runtime.client import AsyncEngineClient, ClientOptions  # noqa: E402
from ominix_runtime.pb import common_pb2, engine_pb2  # noqa: E402

_PRIORITIES = {
    "unspecified": common_pb2.PRIORITY_UNSPECIFIED,
    "realtime": common_pb2.PRIORITY_REALTIME,
    "interactive": common_pb2.PRIORITY_INTERACTIVE,
    "batch": common_pb2.PRIORITY_BATCH,
}


# ---------------------------------------------------------------- configuration and requests


@dataclass(slots=True)
class BenchConfig:
    num_requests: int = 64
    request_rate: float = math.inf  # requests/s; inf sends everything at once
    burstiness: float = 1.0  # gamma shape of inter-arrival times; 1.0 is Poisson, < 1 burstier
    input_len: int = 512  # random prompt tokens per request (after any shared prefix)
    output_len: int = 128  # max_tokens; exact with ignore_eos
    range_ratio: float = 0.0  # lengths drawn uniformly from [len*(1-r), len*(1+r)]
    shared_prefix_len: int = 0  # random tokens common to every prompt, placed before the distinct part
    max_concurrency: int | None = None  # requests in flight at most; None means no client-side limit
    seed: int = 0
    model: str = ""  # empty: the engine's only model
    temperature: float = 0.0
    ignore_eos: bool = True
    priority: str = "unspecified"
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_e2el_ms: float | None = None
    num_channels: int = 1  # gRPC connections to spread the streams over (in each client process)
    # Client processes sharing the requests (round robin; each with its own channels): one Python process
    # reading hundreds of streams runs out of CPU near 15-20k tokens/s. Needs an infinite rate, no limit.
    client_procs: int = 1
    request_timeout_s: float = 3600.0
    timeline_bin_s: float | None = None  # None: about 60 bins over the run
    progress: bool | None = None  # None: a progress bar only when stderr is a TTY
    label: str = ""
    load_sample_s: float = 0.0  # > 0: poll the engine's GetLoad this often (queue depth, KV use per request)
    # Every request of a client process in one GenerateBatch call (an infinite rate, no limit, gRPC only).
    batch_submit: bool = False


@dataclass(slots=True)
class RequestSpec:
    """One request to send: exactly one of prompt_ids, prompt_text, messages."""

    max_tokens: int
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    messages: list[tuple[str, str]] | None = None  # (role, content)

    @property
    def num_prompt_ids(self) -> int:
        return len(self.prompt_ids) if self.prompt_ids is not None else 0


@dataclass(slots=True)
class ModelFacts:
    name: str
    vocab_size: int
    special_ids: frozenset[int]  # bos/eos: kept out of random prompts
    max_model_len: int


def _draw_lengths(rng: np.random.Generator, mean: int, ratio: float, count: int) -> list[int]:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"range ratio must be within [0, 1), got {ratio}")
    low = max(1, int(mean * (1.0 - ratio)))
    high = max(low, int(mean * (1.0 + ratio)))
    return [int(v) for v in rng.integers(low, high + 1, size=count)]


def build_random_requests(
    config: BenchConfig, facts: ModelFacts, seed: int | None = None
) -> list[RequestSpec]:
    """Random token-id prompts, distinct per request (each distinct part starts with its own token id).

    With ``shared_prefix_len`` every prompt starts with the same random tokens, so the prefix cache can
    serve them; the distinct part follows.
    """
    rng = np.random.default_rng(config.seed if seed is None else seed)
    allowed = np.array([t for t in range(facts.vocab_size) if t not in facts.special_ids], dtype=np.int64)
    if config.num_requests > len(allowed):
        raise ValueError("more requests than token ids: cannot give each prompt a distinct first token")
    first_ids = rng.choice(allowed, size=config.num_requests, replace=False)
    prefix = rng.choice(allowed, size=config.shared_prefix_len).tolist()
    input_lens = _draw_lengths(rng, config.input_len, config.range_ratio, config.num_requests)
    output_lens = _draw_lengths(rng, config.output_len, config.range_ratio, config.num_requests)
    requests = []
    for first_id, input_len, output_len in zip(first_ids, input_lens, output_lens, strict=True):
        body = [int(first_id), *rng.choice(allowed, size=input_len - 1).tolist()]
        requests.append(RequestSpec(max_tokens=output_len, prompt_ids=prefix + body))
    return requests


async def fetch_model_facts(address: str, timeout_s: float = 30.0) -> ModelFacts:
    """The served model's vocabulary and special ids, from ListBackends."""
    if is_openai(address):
        raise ValueError(
            f"{address}: an OpenAI-compatible server's vocabulary comes from its config (openai_facts)"
        )
    async with AsyncEngineClient(address) as client:
        reply = await client.list_backends(timeout_s)
    if not reply.backends:
        raise RuntimeError(f"engine at {address} lists no backends")
    model = reply.backends[0].model
    special = set(model.eos_token_ids)
    if model.HasField("bos_token_id"):
        special.add(model.bos_token_id)
    return ModelFacts(model.name, model.vocab_size, frozenset(special), model.max_model_len)


async def openai_facts(address: str, config_path: str | Path) -> ModelFacts:
    """An OpenAI-compatible server's model: its id and length from ``/v1/models``, the vocabulary and special
    ids from the served model's ``config.json`` (the server does not report them)."""
    import aiohttp

    from bench.openai_front import served_model, vocabulary

    async with aiohttp.ClientSession() as session:
        name, max_model_len = await served_model(session, address)
    vocab_size, special = vocabulary(config_path)
    return ModelFacts(name, vocab_size, special, max_model_len)


async def fetch_backends(address: str, timeout_s: float = 30.0) -> engine_pb2.ListBackendsResponse:
    async with AsyncEngineClient(address) as client:
        return await client.list_backends(timeout_s)


def to_pb_request(spec: RequestSpec, config: BenchConfig, request_id: str) -> engine_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(
        max_tokens=spec.max_tokens, temperature=config.temperature, ignore_eos=config.ignore_eos
    )
    request = engine_pb2.GenerateRequest(
        request_id=request_id,
        model=config.model,
        sampling=sampling,
        priority=_PRIORITIES[config.priority],
        stream=True,
    )
    if spec.prompt_ids is not None:
        request.input_ids.ids.extend(spec.prompt_ids)
    elif spec.prompt_text is not None:
        request.prompt = spec.prompt_text
    elif spec.messages is not None:
        for role, content in spec.messages:
            request.messages.messages.add(role=role, content=content)
    else:
        raise ValueError("request has no prompt")
    return request


# ---------------------------------------------------------------- per-request measurement


@dataclass(slots=True)
class RequestResult:
    """Timings of one request; times are seconds since the run started (perf_counter based)."""

    index: int
    request_id: str
    send_time: float = 0.0
    end_time: float = 0.0
    first_token_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of every token chunk
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per chunk
    output_token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    server_ttft_s: float | None = None  # the engine's own arrival-to-prefill-end figure
    finish_reason: str = ""
    success: bool = False
    error: str = ""
    # perf_counter of the run's start (CLOCK_MONOTONIC on Linux, shared by every process on the host): added
    # to the times above, it places them beside another process's log.
    clock_origin: float = 0.0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.send_time

    @property
    def e2el_s(self) -> float:
        return self.end_time - self.send_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        ttft = self.ttft_s
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - ttft) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def _record(result: RequestResult, event: engine_pb2.GenerateEvent, now: float) -> bool:
    """Add one event of ``result``'s request, arrived at ``now``; True for its terminal event."""
    kind = event.WhichOneof("event")
    if kind == "token":
        if event.token.token_ids:
            if result.first_token_time is None:
                result.first_token_time = now
            result.chunk_times.append(now)
            result.chunk_tokens.append(len(event.token.token_ids))
            result.output_token_ids.extend(event.token.token_ids)
    elif kind == "prefill_done":
        result.server_ttft_s = event.prefill_done.ttft_seconds
        result.prompt_tokens = event.prefill_done.prompt_tokens
        result.cached_tokens = event.prefill_done.cached_tokens
    elif kind == "usage":
        result.prompt_tokens = event.usage.prompt_tokens
        result.output_tokens = event.usage.completion_tokens
        result.cached_tokens = event.usage.cached_tokens
    elif kind == "done":
        result.finish_reason = common_pb2.FinishReason.Name(event.done.finish_reason)
        result.success = event.done.finish_reason in (
            common_pb2.FINISH_REASON_STOP,
            common_pb2.FINISH_REASON_LENGTH,
        )
        if not result.success:
            result.error = result.finish_reason
        return True
    elif kind == "error":
        result.error = f"{common_pb2.ErrorCode.Name(event.error.code)}: {event.error.message}"
        result.success = False
        return True
    return False


def _settle(result: RequestResult, end_time: float) -> None:
    result.end_time = end_time
    if result.output_tokens == 0:  # no usage event: count what streamed
        result.output_tokens = sum(result.chunk_tokens)
    if result.success and result.first_token_time is None:
        result.success = False
        result.error = "finished without any token"


async def _send_one(
    client: AsyncEngineClient,
    request: engine_pb2.GenerateRequest,
    result: RequestResult,
    start: float,
    timeout_s: float,
) -> None:
    result.send_time = time.perf_counter() - start
    try:
        async for event in client.generate(request, timeout=timeout_s):
            _record(result, event, time.perf_counter() - start)
    except grpc.aio.AioRpcError as exc:
        result.success = False
        result.error = f"{exc.code().name}: {exc.details()}"
    _settle(result, time.perf_counter() - start)


async def _send_batch(
    client: AsyncEngineClient,
    requests: list[engine_pb2.GenerateRequest],
    results: list[RequestResult],
    start: float,
    timeout_s: float,
    progress: _Progress,
) -> None:
    """All of ``requests`` in one GenerateBatch call; each result ends at its own terminal event.
    ``timeout_s`` bounds the whole call."""
    by_id = {r.request_id: r for r in results}
    sent = time.perf_counter() - start
    for result in results:
        result.send_time = sent
    try:
        async for event in client.generate_batch(requests, timeout=timeout_s):
            result = by_id.get(event.request_id)
            if result is None:
                continue  # not one of ours: nothing to add it to
            now = time.perf_counter() - start
            if _record(result, event, now):
                _settle(result, now)
                progress.update()
    except grpc.aio.AioRpcError as exc:
        for result in results:
            if not result.end_time:
                result.success = False
                result.error = f"{exc.code().name}: {exc.details()}"
    now = time.perf_counter() - start
    for result in results:
        if not result.end_time:
            if not result.error:
                result.success, result.error = False, "the call ended without its terminal event"
            _settle(result, now)
            progress.update()


async def send_one(
    client: AsyncEngineClient, spec: RequestSpec, config: BenchConfig, request_id: str
) -> RequestResult:
    """One request over an open ``client``; its times are seconds since it was sent. For latency measured one
    request at a time over one connection, as a router keeps its connections open (``run_benchmark`` opens new
    channels for each run)."""
    result = RequestResult(index=0, request_id=request_id)
    request = to_pb_request(spec, config, request_id)
    result.clock_origin = time.perf_counter()
    await _send_one(client, request, result, result.clock_origin, config.request_timeout_s)
    return result


@dataclass(slots=True)
class LoadSample:
    """The engine's load at ``time_s`` (seconds since the run started), summed over its backends."""

    time_s: float
    queued_requests: int
    running_requests: int
    kv_pressure_pct: float


async def _sample_load(
    client: AsyncEngineClient, start: float, every_s: float, out: list[LoadSample]
) -> None:
    """Append a GetLoad sample every ``every_s`` until cancelled; an engine without GetLoad yields none."""
    while True:
        try:
            reply = await client.get_load(timeout=max(every_s, 1.0))
        except grpc.aio.AioRpcError:
            return
        total = reply.total
        capacity = total.kv_bytes_capacity
        out.append(
            LoadSample(
                time_s=time.perf_counter() - start,
                queued_requests=total.queued_requests,
                running_requests=total.running_requests,
                kv_pressure_pct=100.0 * total.kv_bytes_used / capacity if capacity else 0.0,
            )
        )
        await asyncio.sleep(every_s)


# ---------------------------------------------------------------- aggregate metrics


@dataclass(slots=True)
class BenchMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    max_output_throughput: float  # best timeline bin, output tokens / s
    good_requests: int | None  # requests meeting every SLO given; None without SLOs
    goodput: float | None  # good requests / s
    ttft: Summary
    tpot: Summary
    itl: Summary
    e2el: Summary


@dataclass(slots=True)
class Timeline:
    bin_s: float
    starts_s: list[float]
    output_tokens_per_s: list[float]
    finished_requests_per_s: list[float]


def meets_slos(
    result: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None, slo_e2el_ms: float | None
) -> bool:
    """A successful request within every SLO given (TPOT counts as met for single-token outputs)."""
    if not result.success:
        return False
    ttft = result.ttft_s
    if slo_ttft_ms is not None and (ttft is None or ttft * 1000.0 > slo_ttft_ms):
        return False
    tpot = result.tpot_s
    if slo_tpot_ms is not None and tpot is not None and tpot * 1000.0 > slo_tpot_ms:
        return False
    return not (slo_e2el_ms is not None and result.e2el_s * 1000.0 > slo_e2el_ms)


def throughput_timeline(results: Sequence[RequestResult], duration_s: float, bin_s: float) -> Timeline:
    """Output tokens and finished requests per second, in fixed bins over [0, duration)."""
    num_bins = max(1, math.ceil(duration_s / bin_s))
    tokens = [0.0] * num_bins
    finished = [0.0] * num_bins
    for result in results:
        for when, count in zip(result.chunk_times, result.chunk_tokens, strict=True):
            tokens[min(num_bins - 1, int(when / bin_s))] += count
        if result.success:
            finished[min(num_bins - 1, int(result.end_time / bin_s))] += 1
    return Timeline(
        bin_s=bin_s,
        starts_s=[i * bin_s for i in range(num_bins)],
        output_tokens_per_s=[t / bin_s for t in tokens],
        finished_requests_per_s=[f / bin_s for f in finished],
    )


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    slo_e2el_ms: float | None = None,
    timeline: Timeline | None = None,
) -> BenchMetrics:
    done = [r for r in results if r.success]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_tokens for r in done)
    has_slo = any(s is not None for s in (slo_ttft_ms, slo_tpot_ms, slo_e2el_ms))
    good = sum(meets_slos(r, slo_ttft_ms, slo_tpot_ms, slo_e2el_ms) for r in done) if has_slo else None
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: math.nan)
    # Only full bins: a partly filled last bin would understate the peak.
    full_bins = (
        timeline.output_tokens_per_s[:-1] if timeline and len(timeline.output_tokens_per_s) > 1 else []
    )
    return BenchMetrics(
        completed=len(done),
        failed=len(results) - len(done),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        total_cached_tokens=sum(r.cached_tokens for r in done),
        request_throughput=per_s(len(done)),
        output_throughput=per_s(output_tokens),
        total_token_throughput=per_s(input_tokens + output_tokens),
        max_output_throughput=max(full_bins) if full_bins else per_s(output_tokens),
        good_requests=good,
        goodput=None if good is None else per_s(good),
        ttft=summarize_seconds([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=summarize_seconds([r.tpot_s for r in done if r.tpot_s is not None]),
        itl=summarize_seconds([gap for r in done for gap in r.itls_s]),
        e2el=summarize_seconds([r.e2el_s for r in done]),
    )


@dataclass(slots=True)
class BenchResult:
    config: BenchConfig
    address: str
    metrics: BenchMetrics
    timeline: Timeline
    requests: list[RequestResult]
    started_at_unix: float
    load_samples: list[LoadSample] = field(default_factory=list)
    started_perf: float = 0.0  # time.perf_counter() at the start: the request times are relative to it

    def errors(self) -> list[str]:
        return [f"{r.request_id}: {r.error}" for r in self.requests if not r.success]

    def clock_span(self) -> dict[str, float]:
        """The run's bounds as perf_counter readings (CLOCK_MONOTONIC on Linux, shared by every process on the
        host), to line the run up with a worker's step log: the clock's start, the first and last send and the
        last end of the requests that succeeded, and the first token of any of them."""
        done = [r for r in self.requests if r.success]
        firsts = [r.first_token_time for r in done if r.first_token_time is not None]
        origin = self.started_perf
        span = {"origin": origin, "end": origin + self.metrics.duration_s}
        if done:  # a request that failed may never have been sent (its send time is then 0)
            span["first_send"] = origin + min(r.send_time for r in done)
            span["last_send"] = origin + max(r.send_time for r in done)
            span["last_end"] = origin + max(r.end_time for r in done)
        if firsts:
            span["first_token"] = origin + min(firsts)
        return span

    def to_json(self, include_requests: bool = True) -> dict[str, object]:
        payload: dict[str, object] = {
            "config": asdict(self.config),
            "address": self.address,
            "started_at_unix": self.started_at_unix,
            "metrics": asdict(self.metrics),
            "timeline": asdict(self.timeline),
            "clock_s": self.clock_span(),
        }
        if include_requests:
            payload["requests"] = [
                {
                    "request_id": r.request_id,
                    "success": r.success,
                    "error": r.error,
                    "finish_reason": r.finish_reason,
                    "prompt_tokens": r.prompt_tokens,
                    "output_tokens": r.output_tokens,
                    "cached_tokens": r.cached_tokens,
                    "send_time_s": r.send_time,
                    "ttft_s": r.ttft_s,
                    "server_ttft_s": r.server_ttft_s,
                    "tpot_s": r.tpot_s,
                    "e2el_s": r.e2el_s,
                    "itls_s": r.itls_s,
                }
                for r in self.requests
            ]
        return payload

    def plot_data(self) -> PlotData:
        done = [r for r in self.requests if r.success]
        title = self.config.label or f"{self.config.num_requests} requests @ {self.address}"
        return PlotData(
            title=f"{title}: {self.metrics.output_throughput:,.0f} out tok/s",
            ttft_s=[r.ttft_s for r in done if r.ttft_s is not None],
            tpot_s=[r.tpot_s for r in done if r.tpot_s is not None],
            itl_s=[gap for r in done for gap in r.itls_s],
            e2el_s=[r.e2el_s for r in done],
            timeline_s=self.timeline.starts_s,
            output_tokens_per_s=self.timeline.output_tokens_per_s,
            finished_requests_per_s=self.timeline.finished_requests_per_s,
        )


# ---------------------------------------------------------------- the run


def arrival_delays(num_requests: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps before each request: 0 for an infinite rate, else gamma(shape=burstiness, mean=1/rate) draws scaled
    so that the last request arrives at exactly num_requests / rate, as `vllm bench serve` schedules them: runs
    at one rate then span the same time whatever the draws, so out tok/s and goodput compare across systems."""
    if math.isinf(rate):
        return [0.0] * num_requests
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    rng = np.random.default_rng(seed + 1)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests)
    total = float(gaps.sum())
    return (gaps * (num_requests / rate / total)).tolist() if total > 0 else gaps.tolist()


class _Progress:
    def __init__(self, total: int, enabled: bool, label: str) -> None:
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is optional: without it, no bar
                return
            self._bar = tqdm(total=total, desc=label or "requests", unit="req", file=sys.stderr)

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def run_benchmark(
    address: str,
    config: BenchConfig,
    requests: Sequence[RequestSpec] | None = None,
    *,
    before_start: Callable[[], Awaitable[None]] | None = None,
) -> BenchResult:
    """Send ``requests`` (random ones built from ``config`` when None) and measure them. ``before_start`` is
    awaited once the channels are ready, right before the clock starts (client processes start together)."""
    if requests is None:
        requests = build_random_requests(config, await fetch_model_facts(address))
    if is_openai(address):
        if config.batch_submit:
            raise ValueError("batch submission is a gRPC call; an OpenAI-compatible server has none")
        return await _run_openai(address, config, requests)
    if config.client_procs > 1 and len(requests) > 1:
        return await _run_split(address, config, requests)
    options = ClientOptions(
        channel_options=(
            ("grpc.max_receive_message_length", -1),
            ("grpc.use_local_subchannel_pool", 1),  # separate connections per channel
        )
    )
    clients = [AsyncEngineClient(address, options) for _ in range(max(1, config.num_channels))]
    run_tag = uuid.uuid4().hex[:8]
    results = [RequestResult(index=i, request_id=f"bench-{run_tag}-{i}") for i in range(len(requests))]

    async def send(i: int, start: float) -> None:
        pb_request = to_pb_request(requests[i], config, results[i].request_id)
        await _send_one(clients[i % len(clients)], pb_request, results[i], start, config.request_timeout_s)

    load_samples: list[LoadSample] = []
    sampler: asyncio.Task[None] | None = None

    def sample_load(start: float) -> None:
        nonlocal sampler
        if config.load_sample_s > 0:
            sampler = asyncio.create_task(_sample_load(clients[0], start, config.load_sample_s, load_samples))

    try:
        for client in clients:
            await client.wait_ready(30.0)
        if before_start is not None:
            await before_start()
        if config.batch_submit:
            started_at_unix, start, duration = await _drive_batch(
                config,
                clients[0],
                [
                    to_pb_request(spec, config, r.request_id)
                    for spec, r in zip(requests, results, strict=True)
                ],
                results,
                sample_load,
            )
        else:
            started_at_unix, start, duration = await _drive(config, len(requests), send, sample_load)
    finally:
        if sampler is not None:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        for client in clients:
            await client.close()
    return _result(config, address, results, duration, started_at_unix, load_samples, start)


async def _drive(
    config: BenchConfig,
    num_requests: int,
    send: Callable[[int, float], Awaitable[None]],
    on_start: Callable[[float], None] | None = None,
) -> tuple[float, float, float]:
    """Both transports' run: ``send(i, start)`` for request i at its arrival (the schedule of ``config``),
    under the concurrency limit, with the progress bar; ``on_start(start)`` as the clock starts. Returns (wall
    time at the start, perf_counter start, duration)."""
    delays = arrival_delays(num_requests, config.request_rate, config.burstiness, config.seed)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    show = sys.stderr.isatty() if config.progress is None else config.progress
    progress = _Progress(num_requests, show, config.label)

    async def one(i: int, start: float) -> None:
        async with limit or contextlib.nullcontext():
            await send(i, start)
        progress.update()

    try:
        started_at_unix = time.time()
        start = time.perf_counter()
        if on_start is not None:
            on_start(start)
        await _arrive(delays, one, start)
        return started_at_unix, start, time.perf_counter() - start
    finally:
        progress.close()


async def _drive_batch(
    config: BenchConfig,
    client: AsyncEngineClient,
    requests: list[engine_pb2.GenerateRequest],
    results: list[RequestResult],
    on_start: Callable[[float], None] | None = None,
) -> tuple[float, float, float]:
    """``_drive`` for ``config.batch_submit``: every request at once, in one call."""
    if config.request_rate != math.inf or config.max_concurrency:
        raise ValueError("batch submission sends every request at once: no request rate or concurrency limit")
    show = sys.stderr.isatty() if config.progress is None else config.progress
    progress = _Progress(len(requests), show, config.label)
    try:
        started_at_unix = time.time()
        start = time.perf_counter()
        if on_start is not None:
            on_start(start)
        await _send_batch(client, requests, results, start, config.request_timeout_s, progress)
        return started_at_unix, start, time.perf_counter() - start
    finally:
        progress.close()


async def _arrive(
    delays: Sequence[float], one: Callable[[int, float], Awaitable[None]], start: float
) -> None:
    """Start request i after the i-th gap (the arrival schedule) and wait for all of them."""
    tasks = []
    for i, delay in enumerate(delays):
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, start)))
    await asyncio.gather(*tasks)


async def _run_openai(address: str, config: BenchConfig, requests: Sequence[RequestSpec]) -> BenchResult:
    """``run_benchmark`` against an OpenAI-compatible server (``bench/openai_front.py``): the same arrival
    schedule and token-id prompts, over HTTP streams instead of gRPC (no load sampling: the server has no
    GetLoad)."""
    import aiohttp

    from bench.openai_front import completion_body, served_model, stream_completion

    if any(spec.prompt_ids is None for spec in requests):
        raise ValueError("an OpenAI-compatible server is sent token-id prompts only")
    results = [RequestResult(index=i, request_id=f"bench-{i}") for i in range(len(requests))]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        model = config.model or (await served_model(session, address))[0]

        async def send(i: int, start: float) -> None:
            spec = requests[i]
            assert spec.prompt_ids is not None
            body = completion_body(
                model, spec.prompt_ids, spec.max_tokens, config.temperature, config.ignore_eos
            )
            await stream_completion(session, address, body, results[i], start, config.request_timeout_s)

        started_at_unix, start, duration = await _drive(config, len(requests), send)
    return _result(config, address, results, duration, started_at_unix, [], start)


def _result(
    config: BenchConfig,
    address: str,
    results: list[RequestResult],
    duration: float,
    started_at_unix: float,
    load_samples: list[LoadSample],
    start: float,
) -> BenchResult:
    bin_s = config.timeline_bin_s or _nice_bin(duration)
    timeline = throughput_timeline(results, duration, bin_s)
    metrics = compute_metrics(
        results,
        duration,
        slo_ttft_ms=config.slo_ttft_ms,
        slo_tpot_ms=config.slo_tpot_ms,
        slo_e2el_ms=config.slo_e2el_ms,
        timeline=timeline,
    )
    return BenchResult(config, address, metrics, timeline, results, started_at_unix, load_samples, start)


# ---------------------------------------------------------------- several client processes


def _client_process(
    k: int,
    address: str,
    config: BenchConfig,
    requests: list[RequestSpec],
    ready: Any,  # noqa: ANN401 - multiprocessing queues and event
    go: Any,  # noqa: ANN401
    out: Any,  # noqa: ANN401
) -> None:
    """One client process of a split run: ready once its channels are, then waits for the common go."""

    async def gate() -> None:
        ready.put(k)
        await asyncio.to_thread(go.wait)

    try:
        result = asyncio.run(run_benchmark(address, config, requests, before_start=gate))
        out.put((k, result, ""))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        ready.put(k)  # never leave the parent waiting for a process that failed before it was ready
        out.put((k, None, repr(exc)))


async def _run_split(address: str, config: BenchConfig, requests: Sequence[RequestSpec]) -> BenchResult:
    """``config.client_procs`` processes, request i in process i % procs, all started at one go; their
    per-request timings are put on one clock (perf_counter is the machine's monotonic clock, the same in
    every process) and measured as one run."""
    if not math.isinf(config.request_rate) or config.max_concurrency:
        raise ValueError("several client processes need an infinite request rate and no concurrency limit")
    procs = min(config.client_procs, len(requests))
    slices = [list(range(k, len(requests), procs)) for k in range(procs)]
    ctx = multiprocessing.get_context("spawn")  # no fork of a process with gRPC threads
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    children = []
    for k, indexes in enumerate(slices):
        child_config = replace(
            config, client_procs=1, progress=False, load_sample_s=config.load_sample_s if k == 0 else 0.0
        )
        child = ctx.Process(
            target=_client_process,
            args=(k, address, child_config, [requests[i] for i in indexes], ready, go, out),
            daemon=True,
        )
        child.start()
        children.append(child)
    try:
        for _ in children:
            await asyncio.to_thread(ready.get, True, 120.0)
        go.set()
        parts: dict[int, BenchResult] = {}
        for _ in children:
            k, part, error = await asyncio.to_thread(out.get, True, config.request_timeout_s + 120.0)
            if part is None:
                raise RuntimeError(f"client process {k} failed: {error}")
            parts[k] = part
    finally:
        for child in children:
            child.join(10.0)
            if child.is_alive():
                child.kill()
    origin = min(p.started_perf for p in parts.values())
    results: list[RequestResult | None] = [None] * len(requests)
    samples: list[LoadSample] = []
    for k, part in parts.items():
        shift = part.started_perf - origin
        for i, r in zip(slices[k], part.requests, strict=True):
            r.index = i
            r.send_time += shift
            r.end_time += shift
            if r.first_token_time is not None:
                r.first_token_time += shift
            r.chunk_times = [t + shift for t in r.chunk_times]
            results[i] = r
        samples += [replace(s, time_s=s.time_s + shift) for s in part.load_samples]
    duration = max(p.started_perf + p.metrics.duration_s for p in parts.values()) - origin
    started_at_unix = min(p.started_at_unix for p in parts.values())
    merged = [r for r in results if r is not None]
    return _result(config, address, merged, duration, started_at_unix, samples, origin)


def _nice_bin(duration_s: float) -> float:
    """About 60 bins, rounded to 1/2/5 × 10^k seconds."""
    target = max(duration_s / 60.0, 1e-3)
    exponent = math.floor(math.log10(target))
    for step in (1, 2, 5, 10):
        if step * 10**exponent >= target:
            return float(step * 10**exponent)
    return float(10 ** (exponent + 1))


# ---------------------------------------------------------------- report


def format_report(result: BenchResult) -> str:
    m = result.metrics
    lines = [
        f"==== {result.config.label or 'serving benchmark'} ====",
        f"successful requests:        {m.completed}",
        f"failed requests:            {m.failed}",
        f"duration (s):               {m.duration_s:.2f}",
        f"input tokens:               {m.total_input_tokens}  (served from prefix cache: {m.total_cached_tokens})",
        f"output tokens:              {m.total_output_tokens}",
        f"request throughput (req/s): {fmt(m.request_throughput, 2)}",
        f"output throughput (tok/s):  {fmt(m.output_throughput)}",
        f"peak output tok/s (bin):    {fmt(m.max_output_throughput)}",
        f"total throughput (tok/s):   {fmt(m.total_token_throughput)}",
    ]
    if m.goodput is not None:
        lines.append(f"goodput (req/s):            {fmt(m.goodput, 2)}  ({m.good_requests} within SLOs)")
    for name, summary in (("TTFT", m.ttft), ("TPOT", m.tpot), ("ITL", m.itl), ("E2EL", m.e2el)):
        lines.append(
            f"{name:<5} ms  mean {fmt(summary.mean_ms, 2):>10}  median {fmt(summary.median_ms, 2):>10}"
            f"  p99 {fmt(summary.p99_ms, 2):>10}  (n={summary.count})"
        )
    errors = result.errors()
    if errors:
        lines.append(f"first errors: {errors[:3]}")
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="req/s; 'inf' = all at once")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--shared-prefix-len", type=int, default=0)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--served-model", default="", help="model field of each request (default: the only one)"
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-ignore-eos", action="store_true", help="let EOS end requests early")
    parser.add_argument("--priority", choices=sorted(_PRIORITIES), default="unspecified")
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-tpot-ms", type=float, default=None)
    parser.add_argument("--slo-e2el-ms", type=float, default=None)
    parser.add_argument("--num-channels", type=int, default=1)
    parser.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="client processes sharing the requests (infinite rate only)",
    )
    parser.add_argument(
        "--batch-submit",
        action="store_true",
        help="send each client process's requests in one GenerateBatch call over its first channel "
        "(infinite rate only; the request timeout bounds the whole call)",
    )
    parser.add_argument("--no-progress", action="store_true")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        num_requests=args.num_requests,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        shared_prefix_len=args.shared_prefix_len,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        model=args.served_model,
        temperature=args.temperature,
        ignore_eos=not args.no_ignore_eos,
        priority=args.priority,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        slo_e2el_ms=args.slo_e2el_ms,
        num_channels=args.num_channels,
        client_procs=args.client_procs,
        progress=False if args.no_progress else None,
        batch_submit=args.batch_submit,
    )


def _with_suffix(path: str, suffix: str) -> str:
    p = Path(path)
    return str(p.with_name(f"{p.stem}{suffix}{p.suffix}")) if suffix else path


async def _main_async(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    facts = await fetch_model_facts(args.address)
    requests = build_random_requests(config, facts)
    if args.observations:
        config.load_sample_s = args.load_sample_s
    passes = []
    for k in range(args.repeat):
        config.label = f"pass {k + 1}/{args.repeat}" if args.repeat > 1 else "serving benchmark"
        result = await run_benchmark(args.address, config, requests)  # same prompts every pass
        passes.append(result)
        print(format_report(result), flush=True)
        suffix = f"-pass{k + 1}" if args.repeat > 1 else ""
        if args.plot:
            print(f"plot: {write_plot(_with_suffix(args.plot, suffix), result.plot_data())}")
        if args.observations:
            side = await _observations(args, result, facts)
            print(f"observations: {write_json(_with_suffix(args.observations, suffix), side)}")
    if args.out_json:
        payload = {"model": facts.name, "passes": [p.to_json(not args.no_request_details) for p in passes]}
        print(f"json: {write_json(args.out_json, payload)}")
    if len(passes) > 1 and passes[0].metrics.output_throughput > 0:
        ratio = passes[-1].metrics.output_throughput / passes[0].metrics.output_throughput
        print(f"last pass / first pass output tok/s: {ratio:.2f}x")
    return 0 if all(p.metrics.failed == 0 for p in passes) else 1


async def _observations(
    args: argparse.Namespace, result: BenchResult, facts: ModelFacts
) -> dict[str, object]:
    from bench.observations import observations_side

    backends = (await fetch_backends(args.address)).backends
    first = backends[0] if backends else None
    kind = common_pb2.BackendKind.Name(first.kind) if first is not None else "BACKEND_KIND_UNSPECIFIED"
    return observations_side(
        result,
        build=args.build,
        backend=kind.removeprefix("BACKEND_KIND_").lower(),
        accelerator=args.accelerator or (first.device if first is not None else ""),
        model_version=facts.name,
        replica=",".join(b.worker_id for b in backends),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--address", default="127.0.0.1:50061")
    add_config_arguments(parser)
    parser.add_argument(
        "--repeat", type=int, default=1, help="send the same prompts this many times, in turn"
    )
    parser.add_argument("--out-json", default=None)
    parser.add_argument("--no-request-details", action="store_true", help="JSON without per-request rows")
    parser.add_argument("--plot", default=None, help="PNG path for latency distributions and throughput")
    parser.add_argument(
        "--observations",
        default=None,
        help="JSON path for per-request observations in the release gate's format (docs/RELEASE.md)",
    )
    parser.add_argument("--build", default="", help="build label written with --observations")
    parser.add_argument(
        "--accelerator",
        default="",
        help="accelerator written with --observations (default: the backend's device)",
    )
    parser.add_argument(
        "--load-sample-s", type=float, default=0.1, help="GetLoad sampling period with --observations"
    )
    parser.add_argument(
        "--launch",
        action="store_true",
        help="start `ominix-runtime launch` on free ports (unknown arguments go to it) and stop it at the end",
    )
    args, launch_args = parser.parse_known_args(argv)
    if not args.launch:
        if launch_args:
            parser.error(f"unrecognized arguments: {' '.join(launch_args)}")
        return asyncio.run(_main_async(args))
    with launch_service(launch_args) as service:
        args.address = service.address
        return run_while_alive(_main_async(args), service)


if __name__ == "__main__":
    sys.exit(exit_code_of(main))
