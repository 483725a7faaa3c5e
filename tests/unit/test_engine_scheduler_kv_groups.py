"""Scheduler on a sliding-window KV layout: admission by the real per-group footprint."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sched_helpers import Run, drive, finished_ok, make, request

from ominix_runtime.contract import NULL_BLOCK_ID, AttentionKind, KVGroup, OminixError
from ominix_runtime.engine.config import SchedulerConfig
from ominix_runtime.engine.scheduler import Scheduler
from ominix_runtime.testing.fake_backend import FakeConfig

PROMPT_LEN = 2048
NUM_REQUESTS = 16
OUT = 128


def _long_context_run(sliding_window: int) -> tuple[Run, int, int]:
    """16 requests of 2,048 prompt tokens on 256 blocks of 16; returns the run, peak running, peak leased."""
    fake = FakeConfig(
        kv_num_blocks=256, kv_block_size=16, max_batch_tokens=512, sliding_window=sliding_window
    )
    run = make(fake, SchedulerConfig())
    for i in range(NUM_REQUESTS):
        run.scheduler.add_request(request(f"r{i}", [(i * 7 + j) % 997 + 3 for j in range(PROMPT_LEN)], OUT))
    peaks = [0, 0]

    def watch(r: Run) -> None:
        peaks[0] = max(peaks[0], r.scheduler.num_running)
        peaks[1] = max(peaks[1], r.scheduler.registry.num_leased_blocks)

    drive(run, on_step=watch)
    for i in range(NUM_REQUESTS):
        assert finished_ok(run, f"r{i}")
        assert len(run.tokens(f"r{i}")) == OUT
    run.scheduler.registry.check_quiescent()
    return run, peaks[0], peaks[1]


def test_a_sliding_window_layout_runs_many_more_long_requests_at_once() -> None:
    full_run, full_peak, _ = _long_context_run(sliding_window=0)
    window_run, window_peak, window_blocks = _long_context_run(sliding_window=128)
    # A full layout needs 2,176 / 16 = 136 blocks per request at the end: one at a time in 256 blocks (a
    # second one is only ever admitted for a chunk before it is preempted again).
    assert full_peak <= 2
    assert full_run.scheduler.counters.preemptions > 0
    # A window of 128 keeps ~9 blocks per decoding request (plus a chunk while prefilling): all 16 run at
    # once, without a single preemption.
    assert window_peak == NUM_REQUESTS
    assert window_run.scheduler.counters.preemptions == 0
    assert window_blocks < 256
    assert len(window_run.steps) * 4 < len(full_run.steps)
    # The fake worker checked every read inside each window; the sampled tokens do not depend on the layout.
    for i in range(NUM_REQUESTS):
        assert window_run.tokens(f"r{i}") == full_run.tokens(f"r{i}")


def test_a_prefix_hit_on_a_sliding_layout_reads_only_the_window() -> None:
    fake = FakeConfig(kv_num_blocks=64, kv_block_size=16, max_batch_tokens=128, sliding_window=32)
    run = make(fake, SchedulerConfig())
    prompt = [(j * 13) % 991 + 3 for j in range(300)]
    run.scheduler.add_request(request("a", prompt, 4))
    drive(run)
    run.scheduler.add_request(request("b", prompt + [5, 6, 7], 4))
    drive(run)
    (new_b,) = [n for s in run.steps for n in s.new_requests if n.request_id == "b"]
    assert new_b.num_computed_tokens == 288  # hit: every block of "a" up to 288 was still cached
    # Blocks behind b's window went out as nulls; the fake worker checked the window it read.
    assert new_b.kv_block_ids[: (288 - 32) // 16] == [NULL_BLOCK_ID] * ((288 - 32) // 16)
    assert NULL_BLOCK_ID not in new_b.kv_block_ids[(288 - 32) // 16 :]
    assert run.tokens("b") and finished_ok(run, "b")
    run.scheduler.registry.check_quiescent()


def test_admission_bounds_length_only_where_a_window_cannot_fit() -> None:
    # 64 blocks of 16 hold a 128-token window plus a 512-token chunk: any length up to max_model_len runs.
    roomy = make(FakeConfig(kv_num_blocks=64, sliding_window=128, max_model_len=65536), SchedulerConfig())
    roomy.scheduler.add_request(request("long", [5] * 5000, 4))
    drive(roomy)
    assert finished_ok(roomy, "long")
    roomy.scheduler.registry.check_quiescent()
    # 16 blocks cannot: the window group bounds a request like a full group would, so it is refused, not stuck.
    tight = make(FakeConfig(kv_num_blocks=16, sliding_window=128, max_model_len=65536), SchedulerConfig())
    with pytest.raises(OminixError, match="KV"):
        tight.scheduler.add_request(request("long", [5] * 300, 4))
    tight.scheduler.add_request(request("short", [5] * 200, 4))
    drive(tight)
    assert finished_ok(tight, "short")


def _gemma_like_run(layout: str) -> tuple[Run, int]:
    """16 requests of 1,024 prompt tokens on the KV memory of 160 blocks of 16 in each of 6 layers.

    ``uniform``: one full-attention group of 160 blocks. ``hybrid``: five 128-token-window layers and one
    global layer, pools as the worker sizes them for 8 running requests and 256-token steps
    (``ominix_worker.kv_cache.group_block_counts`` without its window cache room: 96 window blocks; 160 × 6 - 96 ×
    5 = 480 global ones).
    Returns the run and the peak number of running requests.
    """
    full_blocks = 480 if layout == "hybrid" else 160
    fake = FakeConfig(
        kv_num_blocks=full_blocks, kv_block_size=16, max_batch_tokens=256, max_running_requests=8
    )
    run = make(fake, SchedulerConfig())
    if layout == "hybrid":
        groups = (
            KVGroup(AttentionKind.FULL, (5,), 16, full_blocks),
            KVGroup(AttentionKind.SLIDING_WINDOW, (0, 1, 2, 3, 4), 16, 96, sliding_window=128),
        )
        capability = replace(
            run.backend.capability(), model=replace(run.backend.capability().model, num_layers=6)
        )
        capability = replace(capability, kv_groups=groups)
        assert capability.problems() == []
        run.scheduler = Scheduler(capability, SchedulerConfig(), seed=1234)
    for i in range(NUM_REQUESTS):
        run.scheduler.add_request(request(f"r{i}", [(i * 11 + j) % 997 + 3 for j in range(1024)], 32))
    peak = [0]

    def watch(r: Run) -> None:
        peak[0] = max(peak[0], r.scheduler.num_running)
        if r.scheduler.registry.num_groups == 2:
            for rid in r.scheduler.running:  # a decoding request keeps only its window in the sliding pool
                lease = r.scheduler.registry.lease(rid)
                assert lease is not None
                live = sum(1 for b in lease.block_tables[1] if b != NULL_BLOCK_ID)
                assert live <= -(-(128 + 256) // 16) + 1

    drive(run, on_step=watch)
    for i in range(NUM_REQUESTS):
        assert finished_ok(run, f"r{i}") and len(run.tokens(f"r{i}")) == 32
    run.scheduler.registry.check_quiescent()
    return run, peak[0]


def test_a_hybrid_layout_admits_many_more_long_requests_than_a_uniform_one() -> None:
    """Admission by the per-group footprint: the global layer's pool bounds long requests, the window pool
    only their windows. On the same memory the hybrid layout runs all 8 it may at once; the uniform one fits
    two (1,056 tokens = 66 of its 160 blocks; a third is only ever admitted for a chunk, then preempted)."""
    uniform, uniform_peak = _gemma_like_run("uniform")
    hybrid, hybrid_peak = _gemma_like_run("hybrid")
    assert uniform_peak <= 3 and uniform.scheduler.counters.preemptions > 0
    assert hybrid_peak == 8
    assert len(hybrid.steps) * 2 < len(uniform.steps)
    assert hybrid.scheduler.counters.preemptions * 4 < uniform.scheduler.counters.preemptions
    for i in range(NUM_REQUESTS):  # the fake worker's tokens do not depend on the layout
        assert hybrid.tokens(f"r{i}") == uniform.tokens(f"r{i}")


def _prompts_again(
    prompt_len: int, window_cache_windows: int, cold_first: bool, monkeypatch: pytest.MonkeyPatch
) -> list[int]:
    """8 requests of ``prompt_len`` tokens decode 96 more (the prompt's window slides out of a 32-token window),
    then the same prompts come again; pools as the worker sizes them (one global layer, one window layer,
    uniform memory of 400 blocks each) with ``window_cache_windows`` cached windows per running request (window
    pool: 8 × 4 + 8 = 40 blocks for the running windows, plus 8 × 4 × 2 = 64 with four cached windows).
    ``cold_first=False`` sends every slid-out block to the back of the free queue (plain LRU).
    Returns the prompt tokens each second request found cached."""
    from ominix_runtime.engine.kv_registry import KVRegistry
    from ominix_worker import kv_cache
    from ominix_worker.config import AttentionGroup

    monkeypatch.setattr(kv_cache, "WINDOW_CACHE_WINDOWS", window_cache_windows)
    if not cold_first:
        monkeypatch.setattr(KVRegistry, "_cold_blocks", lambda self, group, num_known_tokens: 0)
    full_blocks, window_blocks = kv_cache.group_block_counts(
        (AttentionGroup(0, (1,)), AttentionGroup(32, (0,))), 400, 16, 8, 128
    )
    fake = FakeConfig(
        kv_num_blocks=full_blocks, kv_block_size=16, max_batch_tokens=128, max_running_requests=8
    )
    run = make(fake, SchedulerConfig())
    groups = (
        KVGroup(AttentionKind.FULL, (1,), 16, full_blocks),
        KVGroup(AttentionKind.SLIDING_WINDOW, (0,), 16, window_blocks, sliding_window=32),
    )
    capability = replace(
        run.backend.capability(), model=replace(run.backend.capability().model, num_layers=2)
    )
    run.scheduler = Scheduler(replace(capability, kv_groups=groups), SchedulerConfig(), seed=7)
    prompts = [[(i * 31 + j) % 997 + 3 for j in range(prompt_len)] for i in range(8)]
    for i, prompt in enumerate(prompts):
        run.scheduler.add_request(request(f"a{i}", prompt, 96))
    drive(run)
    for i, prompt in enumerate(prompts):
        run.scheduler.add_request(request(f"b{i}", prompt, 4))
    drive(run)
    for i in range(8):
        assert finished_ok(run, f"a{i}") and finished_ok(run, f"b{i}")
        assert run.tokens(f"b{i}") == run.tokens(f"a{i}")[:4]  # a hit computes what a miss would
    run.scheduler.registry.check_quiescent()
    firsts = {n.request_id: n for s in run.steps for n in s.new_requests if n.request_id.startswith("b")}
    return [firsts[f"b{i}"].num_computed_tokens for i in range(8)]


def test_window_cache_room_lets_a_prompt_sent_again_hit_the_prefix_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A window pool sized for the running windows alone reuses every slid-out block while decoding goes on:
    # the second pass finds the global layer's prefix but not the window before it, so nothing is a hit.
    assert _prompts_again(96, 0, True, monkeypatch) == [0] * 8
    # Four cached windows per running request keep each prompt's last window: every prompt hits (all but the
    # last block, which the request recomputes to sample its first token).
    assert _prompts_again(96, 4, True, monkeypatch) == [80] * 8


def test_blocks_before_the_prompts_last_window_are_reused_first(monkeypatch: pytest.MonkeyPatch) -> None:
    # Long prompts: prefill slides most of each prompt out of the window. In plain LRU order those blocks
    # sit ahead of the prompts' last windows, decoding reuses them first, and every miss of the second pass
    # evicts the window the next prompt needs: no hit at all. Sent to the front instead, they go first and
    # every prompt's last window is still cached.
    with monkeypatch.context() as plain:
        assert _prompts_again(256, 4, False, plain) == [0] * 8
    assert _prompts_again(256, 4, True, monkeypatch) == [240] * 8
