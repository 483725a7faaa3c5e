"""A real daemon (engine + one CPU worker process, tiny random model) that served requests, and its scrape.

The fixture lives in conftest.py; tests import :class:`Scraped` and the constants from here."""

from __future__ import annotations

import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.append(str(Path(__file__).resolve().parents[1] / "e2e"))  # the real-process harness

from e2e_procs import Daemon, run_server  # noqa: E402

from ominix_runtime.pb import common_pb2, engine_pb2  # noqa: E402

REQUESTS = 6
SHARED_PREFIX = "The quick brown fox jumps over the lazy dog. " * 4


@dataclass
class Scraped:
    daemon: Daemon
    text: str  # the exposition after the requests below were served


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def _serve_requests(daemon: Daemon) -> None:
    """Finished requests (two share a prefix), one refused at the front (unknown model), one cancelled."""
    stub = daemon.stub
    for i in range(REQUESTS):
        prompt = SHARED_PREFIX + str(i % 2)
        sampling = common_pb2.SamplingParams(max_tokens=4 + i, temperature=0.0, ignore_eos=True)
        events = list(
            stub.Generate(engine_pb2.GenerateRequest(prompt=prompt, sampling=sampling), timeout=120)
        )
        assert events[-1].HasField("done"), events[-1]
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(engine_pb2.GenerateRequest(model="no-such-model", prompt="x"), timeout=30))
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    call = stub.Generate(
        engine_pb2.GenerateRequest(
            prompt="count", sampling=common_pb2.SamplingParams(max_tokens=500, ignore_eos=True)
        ),
        timeout=120,
    )
    for event in call:
        if event.HasField("token"):
            break
    call.cancel()


def _counted(text: str) -> bool:
    """Every request above shows in the scrape (worker figures refresh twice a second)."""
    seen = {"abort": 0.0, "model_not_found": 0.0, "ttft": 0.0, "generated": 0.0, "reported": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "ominix_requests_total" and s.labels["finish_reason"] == "abort":
                seen["abort"] += s.value
            elif s.name == "ominix_request_rejections_total" and s.labels["reason"] == "model_not_found":
                seen["model_not_found"] += s.value
            elif s.name == "ominix_request_ttft_seconds_count":
                seen["ttft"] += s.value
            elif s.name == "ominix_generation_tokens_total":
                seen["generated"] += s.value
            elif s.name == "ominix_request_generation_tokens_sum":
                seen["reported"] += s.value
    # The worker snapshot (periodic) has caught up with the run reports (per finished request).
    return all(v > 0 for v in seen.values()) and seen["generated"] >= seen["reported"]


def _wait_for_counts(url: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = _scrape(url)
        if _counted(text):
            return text
        assert time.monotonic() < deadline, f"the served requests did not show in the scrape:\n{text}"
        time.sleep(0.2)


@contextmanager
def served_daemon(model_dir: Path, log_dir: Path) -> Iterator[Scraped]:
    """Engine + one CPU worker on ``model_dir``, after serving the requests above, with its scrape."""
    with run_server(str(model_dir), log_dir, num_workers=1, kv_cache_memory="16MiB") as daemon:
        _serve_requests(daemon)
        yield Scraped(daemon, _wait_for_counts(daemon.metrics_url))
