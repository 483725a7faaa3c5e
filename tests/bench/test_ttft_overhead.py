"""bench/ttft_overhead.py and bench/offline.py --shared-prefix against a real `serve` engine in front of the fake
step worker: they run end to end, the prefix is served from the cache, and the fake worker charges device time
only for steps that compute something."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.ttft_overhead import fake_service, make_request, time_to_first_token  # noqa: E402

pytestmark = pytest.mark.slow


def test_ttft_overhead_reports_both_shapes_for_each_front_count(tmp_path: Path) -> None:
    out = tmp_path / "ttft.json"
    argv = [sys.executable, str(ROOT / "bench" / "ttft_overhead.py"), "--trials", "5", "--json", str(out)]
    argv += ["--prefix-len", "64", "--suffix-len", "8"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert set(report) == {"front_procs=0", "front_procs=1"}
    for shapes in report.values():
        assert len(shapes) == 2
        for row in shapes.values():
            assert row["trials"] == 5 and 0 < row["p50_ms"] <= row["p90_ms"] < 1000


def test_a_step_that_only_ends_a_request_costs_the_fake_device_nothing(tmp_path: Path) -> None:
    """With a 300 ms fake step, back-to-back one-token requests each wait one step, not two: the step that
    carries the finished id (sent as each request ends) does not hold the next request's prefill."""

    async def first_tokens(address: str) -> list[float]:
        from ominix_runtime.client import AsyncEngineClient

        async with AsyncEngineClient(address) as client:
            return [await time_to_first_token(client, make_request(f"r{i}", [7, 8, 9], 1)) for i in range(3)]

    with fake_service(0, 300.0, tmp_path) as (address, _watched):
        ttfts = asyncio.run(first_tokens(address))
    assert all(0.3 <= t < 0.55 for t in ttfts[1:]), ttfts


def test_offline_shared_prefix_over_one_connection_reports_the_cached_prefix(tmp_path: Path) -> None:
    with fake_service(0, 0.0, tmp_path) as (address, _watched):
        argv = [sys.executable, str(ROOT / "bench" / "offline.py"), "--address", address, "--shared-prefix"]
        argv += ["--prefix-len", "256", "--prefix-trials", "2", "--no-progress", "--no-request-details"]
        argv += ["--out-json", str(tmp_path / "offline.json")]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "256 tokens cached" in done.stdout, done.stdout
    runs = json.loads((tmp_path / "offline.json").read_text())["runs"]["shared_prefix"]
    assert len(runs["ttft_cold_ms"]) == len(runs["ttft_warm_ms"]) == 2
