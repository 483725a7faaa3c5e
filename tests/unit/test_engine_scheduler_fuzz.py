"""Random workloads: the fake worker accepts every step, integrity holds, and tokens never depend on KV
pressure, overlap, chunking, limits on the tokens beside decodes, a burst's budget or aborts of other
requests."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_helpers import Run, drive, make, request

from ominix_runtime.contract import Done, FinishReason, Priority
from ominix_runtime.engine.config import SchedulerConfig
from ominix_runtime.testing.fake_backend import FakeConfig

workload = st.lists(
    st.tuples(
        st.integers(0, 3),  # shared prefix family
        st.integers(1, 40),  # prompt length
        st.integers(1, 24),  # max_tokens
        st.sampled_from(list(Priority)),
        st.booleans(),  # abort this one mid-way
    ),
    min_size=1,
    max_size=12,
)


def _run(
    jobs: list[tuple[int, int, int, Priority, bool]],
    blocks: int,
    budget: int,
    inflight: int,
    bs: int,
    beside_decodes: int = 0,
    arrivals: list[int] | None = None,
    with_decodes: int = 0,
    burst: tuple[int, int] = (0, 0),
) -> Run:
    """``arrivals[i]``: the loop turn at which job i is submitted (None: all before the first step);
    ``burst``: (burst_backlog_tokens, max_batch_tokens_in_burst)."""
    run = make(
        FakeConfig(kv_num_blocks=blocks, kv_block_size=bs, max_batch_tokens=budget, max_running_requests=6),
        SchedulerConfig(
            max_bypass_steps=3,
            prefill_tokens_beside_decodes=beside_decodes,
            max_batch_tokens_with_decodes=with_decodes,
            burst_backlog_tokens=burst[0],
            max_batch_tokens_in_burst=burst[1],
        ),
    )
    due = arrivals or [0] * len(jobs)
    pending = sorted(range(len(jobs)), key=lambda i: (due[i], i))
    turn = 0

    def submit_due() -> bool:
        while pending and due[pending[0]] <= turn:
            i = pending.pop(0)
            family, n, max_tokens, prio, _abort = jobs[i]
            req = request(
                f"r{i}", [50 + family * 3 + (k % 5) for k in range(n)], max_tokens=max_tokens, seed=i
            )
            req.priority = prio
            run.scheduler.add_request(req)
        return bool(pending)

    submit_due()
    to_abort = {f"r{i}" for i, job in enumerate(jobs) if job[4]}

    def on_step(r: Run) -> bool:
        nonlocal turn
        turn += 1
        for rid in list(to_abort):
            if len(r.tokens(rid)) >= 2:  # abort once it has produced something
                r.record(r.scheduler.abort_request(rid))
                to_abort.discard(rid)
        return submit_due()

    return drive(run, max_inflight=inflight, on_step=on_step, max_steps=20_000)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    jobs=workload,
    blocks=st.integers(11, 40),
    budget=st.integers(8, 64),
    inflight=st.sampled_from([1, 2, 3]),
    beside_decodes=st.sampled_from([0, 1, 5, 16]),
    with_decodes=st.sampled_from(
        [0, 6, 9, 24]
    ),  # at least the 6 running slots: below, the scheduler raises it
    arrivals=st.lists(st.integers(0, 30), min_size=12, max_size=12),  # loop turn of each job's submission
    # (burst_backlog_tokens, max_batch_tokens_in_burst): off, a burst whenever every waiting request has a
    # slot and the KV holds them, a burst budget at or above the one with decodes (clamped to the step
    # budget), one below it (raised to it)
    burst=st.sampled_from([(0, 0), (1, 64), (8, 24), (40, 48), (16, 4)]),
)
def test_random_workloads_match_an_unconstrained_run(
    jobs: list[tuple[int, int, int, Priority, bool]],
    blocks: int,
    budget: int,
    inflight: int,
    beside_decodes: int,
    with_decodes: int,
    arrivals: list[int],
    burst: tuple[int, int],
) -> None:
    bs = 4
    jobs = [(f, min(n, blocks * bs - m), m, p, a) for f, n, m, p, a in jobs if m < blocks * bs]
    jobs = [j for j in jobs if j[1] >= 1]
    if not jobs:
        return
    tight = _run(
        jobs, blocks, budget, inflight, bs, beside_decodes, arrivals[: len(jobs)], with_decodes, burst
    )
    # The reference: one step in flight, nothing short, no budget with decodes (so no burst budget either).
    loose = _run([(f, n, m, p, False) for f, n, m, p, _ in jobs], 4096, 512, 1, bs)
    for i, job in enumerate(jobs):
        rid = f"r{i}"
        end = tight.terminal(rid)
        assert isinstance(end, Done)
        full = loose.tokens(rid)
        got = tight.tokens(rid)
        if job[4] and end.finish_reason == FinishReason.ABORT:
            assert got == full[: len(got)]  # an aborted request's tokens are a prefix of the real ones
        else:
            assert end.finish_reason == FinishReason.LENGTH and got == full and len(got) == job[2]
    assert tight.scheduler.registry.num_leased_blocks == 0
