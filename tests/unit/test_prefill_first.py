"""prefill_first: while a prompt can go, a step carries prompts only; the decodes go when none can."""

from __future__ import annotations

import pytest
from sched_helpers import Run, drive, make, request

from ominix_runtime.contract import Done, FinishReason
from ominix_runtime.engine.config import SchedulerConfig
from ominix_runtime.testing.fake_backend import FakeConfig

PROMPT = 24
OUTPUT = 6


def _burst(config: SchedulerConfig, n: int, fake: FakeConfig, inflight: int) -> Run:
    """``n`` requests of PROMPT tokens and OUTPUT outputs, all queued before the first step."""
    run = make(fake, config)
    for i in range(n):
        run.scheduler.add_request(
            request(f"r{i}", [100 + i + k % 7 for k in range(PROMPT)], max_tokens=OUTPUT)
        )
    drive(run, max_inflight=inflight)
    assert run.scheduler.registry.num_leased_blocks == 0
    return run


def _ended_by_length(run: Run, n: int) -> None:
    for i in range(n):
        end = run.terminal(f"r{i}")
        assert isinstance(end, Done) and end.finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize("inflight", [1, 2, 3])
def test_a_burst_runs_every_prompt_before_any_decode_and_then_decodes_at_full_batch(inflight: int) -> None:
    n = 8
    fake = FakeConfig(max_batch_tokens=64, kv_block_size=4, kv_num_blocks=512)
    first = _burst(SchedulerConfig(prefill_first=True), n, fake, inflight)
    mixed = _burst(SchedulerConfig(), n, fake, inflight)
    _ended_by_length(first, n)
    for i in range(n):  # the same tokens either way (seeded sampling)
        assert first.tokens(f"r{i}") == mixed.tokens(f"r{i}") and len(first.tokens(f"r{i}")) == OUTPUT

    plans = first.plans
    prompt_steps = [p for p in plans if p.num_prefill_tokens]
    assert all(p.num_decode_tokens == 0 for p in prompt_steps)  # no step carries both
    last_prompt = max(i for i, p in enumerate(plans) if p.num_prefill_tokens)
    assert all(p.num_prefill_tokens == 0 for p in plans[last_prompt + 1 :])
    assert sum(p.num_prefill_tokens for p in prompt_steps) == n * PROMPT
    # The prompts took whole budgets (the last one the rest), then every decode step carried all n.
    assert [p.num_prefill_tokens for p in prompt_steps] == [64, 64, 64]
    decodes = [p.num_decode_tokens for p in plans if p.num_decode_tokens]
    assert decodes == [n] * (OUTPUT - 1)
    # The default puts decodes beside the later prompts, so it runs more decode steps below full batch.
    assert any(p.num_prefill_tokens and p.num_decode_tokens for p in mixed.plans)


def test_decodes_go_while_no_running_slot_is_free() -> None:
    fake = FakeConfig(max_batch_tokens=64, kv_block_size=4, kv_num_blocks=512, max_running_requests=2)
    run = _burst(SchedulerConfig(prefill_first=True), 5, fake, 2)
    _ended_by_length(run, 5)
    # Two run at a time: the others wait for a slot while the first two decode.
    assert any(p.num_decode_tokens == 2 and p.num_prefill_tokens == 0 for p in run.plans)


def test_decodes_go_when_the_waiting_prompt_cannot_get_kv() -> None:
    # 16 blocks of 4 tokens: two requests of 30 tokens (8 blocks each) fill the cache, and unchunked the
    # third's whole prompt (6 blocks) waits for one of them to end while a slot is free. The decodes must
    # go on meanwhile: a step of prompts only would hold nothing.
    fake = FakeConfig(max_batch_tokens=64, kv_block_size=4, kv_num_blocks=16, max_running_requests=4)
    run = _burst(SchedulerConfig(prefill_first=True, enable_chunked_prefill=False), 3, fake, 2)
    _ended_by_length(run, 3)
    first_admitted_r2 = next(
        i for i, s in enumerate(run.steps) if any(r.request_id == "r2" for r in s.new_requests)
    )
    assert first_admitted_r2 > 0
    assert any(p.num_decode_tokens for p in run.plans[:first_admitted_r2])


def test_a_prompt_arriving_while_others_decode_goes_in_a_step_of_its_own() -> None:
    fake = FakeConfig(max_batch_tokens=64, kv_block_size=4, kv_num_blocks=512)
    run = make(fake, SchedulerConfig(prefill_first=True))
    s = run.scheduler
    s.add_request(request("a", [5] * 10, max_tokens=12))
    late_added = False

    def on_step(r: Run) -> bool:
        nonlocal late_added
        if not late_added and len(r.tokens("a")) >= 3:
            s.add_request(request("b", [9] * 10, max_tokens=2))
            late_added = True
        return not late_added

    drive(run, max_inflight=1, on_step=on_step)
    for rid in ("a", "b"):
        assert isinstance(run.terminal(rid), Done)
    b_step = next(i for i, st in enumerate(run.steps) if any(r.request_id == "b" for r in st.new_requests))
    assert run.plans[b_step].num_decode_tokens == 0 and run.plans[b_step].num_prefill_tokens == 10
    assert run.plans[b_step + 1].num_decode_tokens == 2  # then both decode together
