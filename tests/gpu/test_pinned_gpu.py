"""Serving allocates no pinned host memory once the worker's start has warmed the cache (``pinned.py``): a
schedule of prompts and decodes at growing batch sizes, sampled and overlapped, grows the pinned allocator
from a cold cache (so the check can see an allocation) and not at all after ``warm_pinned_memory``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from test_decode_graphs import _runner
from test_hybrid_layers_gpu import drive

from bench.pinned_first_alloc import empty_host_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _host_allocations() -> int:
    host_memory_stats = getattr(torch.cuda, "host_memory_stats", None)
    stats = host_memory_stats() if host_memory_stats is not None else {}
    if "num_host_alloc" not in stats:
        pytest.skip("this torch reports no pinned allocator counters")
    return int(stats["num_host_alloc"])


def _schedule() -> list[object]:
    """Prompts arriving over 12 steps beside the decodes of those before them: batches of 1 to 6 rows."""
    from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData, SamplingParams

    rng = random.Random(5)
    steps: list[object] = []
    live: list[str] = []
    for step_id in range(1, 25):
        new = []
        if step_id % 2 == 1 and len(live) < 6:
            i = len(live)
            prompt = [rng.randrange(3, 1000) for _ in range(rng.choice([5, 17, 40, 70]))]
            new.append(
                NewRequestData(
                    request_id=f"r{i}",
                    prompt_token_ids=prompt,
                    sampling=SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64),
                    kv_block_ids=list(range(12 * i + 1, 12 * i + 13)),
                    num_computed_tokens=0,
                    num_scheduled_tokens=len(prompt),
                    effective_seed=i,
                )
            )
        running = [
            RunningRequestData(request_id=r, new_kv_block_ids=[], num_scheduled_tokens=1) for r in live
        ]
        steps.append(DecodeStep(step_id=step_id, new_requests=new, running_requests=running))
        live += [n.request_id for n in new]
    return steps


def test_a_warmed_cache_serves_every_step_without_a_pinned_allocation(tmp_path: Path) -> None:
    from ominix_worker.pinned import step_host_bytes, warm_pinned_memory

    if not empty_host_cache():
        pytest.skip("this torch has no entry point to empty the pinned cache: a cold cache cannot be had")
    runner = _runner(tmp_path)
    runner.overlap_steps = True
    before = _host_allocations()
    drive(runner, _schedule())  # type: ignore[arg-type]
    assert _host_allocations() > before, (
        "from a cold cache the schedule allocated nothing: the check sees nothing"
    )

    empty_host_cache()
    runner = _runner(tmp_path)
    runner.overlap_steps = True
    warm_pinned_memory(step_host_bytes(512, 8, runner.max_model_len, runner.block_size))
    before = _host_allocations()
    drive(runner, _schedule())  # type: ignore[arg-type]
    assert _host_allocations() == before


def test_the_first_allocation_bench_times_both_allocations(tmp_path: Path) -> None:
    from bench import pinned_first_alloc

    out = tmp_path / "pinned.json"
    assert pinned_first_alloc.main(["--sizes", "3000,70000", "--queue-ms", "5", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [a["bytes"] for a in report["allocations"]] == [3000, 70000]
    assert all(a["first_ms"] > 0 and a["second_ms"] >= 0 for a in report["allocations"])
    assert report["queued_matmuls"] >= 1
