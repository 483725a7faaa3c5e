"""EngineCore end to end with in-process fake backends: streams, failures, deadlines, routing, stop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import pytest

from ominix_runtime.contract import (
    BackendAdapter,
    DecodeStep,
    Done,
    Error,
    FinishReason,
    GenerateRequest,
    OminixError,
    PrefillDone,
    Priority,
    RuntimeErrorKind,
    SamplingParams,
    Token,
    Usage,
    WorkerEvent,
    is_terminal,
)
from ominix_runtime.engine import EngineCore, EngineCoreConfig, RequestHandle, RunReport, StepReport
from ominix_runtime.engine.config import SchedulerConfig
from ominix_runtime.engine.groups.step_group import StepWorkerGroup
from ominix_runtime.engine.negotiation import ServingTerms
from ominix_runtime.engine.waiting_queue import WaitingQueue
from ominix_runtime.testing.fake_backend import FakeConfig, FakeRequestBackend, FakeStepBackend

TIMEOUT = 20.0


def _req(
    rid: str,
    n: int = 12,
    max_tokens: int = 8,
    seed: int | None = 3,
    base: int = 10,
    priority: Priority = Priority.INTERACTIVE,
    deadline: float | None = None,
) -> GenerateRequest:
    prompt = [base + (i % 40) for i in range(n)]
    sp = SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True)
    return GenerateRequest(rid, prompt, sp, priority=priority, deadline=deadline)


async def _collect(handle: RequestHandle) -> list[WorkerEvent]:
    return [e async for e in handle]


def _tokens(events: list[WorkerEvent]) -> list[int]:
    return [t for e in events if isinstance(e, Token) for t in e.token_ids]


def _run(
    backends: Sequence[BackendAdapter],
    body: Callable[[EngineCore], Awaitable[None]],
    config: EngineCoreConfig | None = None,
) -> EngineCore:
    async def main() -> EngineCore:
        core = EngineCore(backends, config or EngineCoreConfig())
        await core.start()
        try:
            await asyncio.wait_for(body(core), TIMEOUT)
        finally:
            await core.stop()
        core.check_integrity()
        return core

    return asyncio.run(main())


def _check_stream(events: list[WorkerEvent]) -> None:
    assert isinstance(events[0], (PrefillDone, Usage)), events[:2]
    assert sum(is_terminal(e) for e in events) == 1 and is_terminal(events[-1])
    assert isinstance(events[-2], Usage)


def test_preempted_requests_match_an_unpreempted_run_through_the_engine() -> None:
    results: list[dict[str, list[int]]] = []
    preemptions: list[int] = []
    for blocks in (400, 20):
        backend = FakeStepBackend(FakeConfig(kv_num_blocks=blocks, kv_block_size=4, max_batch_tokens=64))

        async def body(core: EngineCore) -> None:
            handles = [core.submit(_req(f"r{i}", n=10 + i, max_tokens=24, seed=i, base=i)) for i in range(10)]
            outs = await asyncio.gather(*(_collect(h) for h in handles))
            for events in outs:
                _check_stream(events)
            results.append({h.request_id: _tokens(o) for h, o in zip(handles, outs, strict=True)})
            preemptions.append(core.stats().preemptions)

        _run([backend], body)
        assert not backend.violations
    assert preemptions[0] == 0 and preemptions[1] > 0
    assert results[0] == results[1]
    assert all(len(t) == 24 for t in results[0].values())


def test_a_request_too_long_to_recompute_without_chunking_gets_its_error_on_its_stream() -> None:
    """Unchunked, a request preempted after its prompt + outputs outgrew max_batch_tokens is ended by the
    scheduler while it builds a step: its client still gets the Error (and only that terminal event), its KV
    is freed, and the requests behind it finish."""
    backend = FakeStepBackend(FakeConfig(max_batch_tokens=64, kv_block_size=4, kv_num_blocks=32))
    config = EngineCoreConfig(
        scheduler=SchedulerConfig(
            enable_chunked_prefill=False, enable_prefix_caching=False, max_bypass_steps=2
        )
    )

    async def body(core: EngineCore) -> None:
        first = core.submit(_req("first", n=40, max_tokens=40))
        long = core.submit(_req("long", n=60, max_tokens=30, base=20))  # the later arrival: the victim
        events = await asyncio.wait_for(_collect(long), 5.0)
        later = [core.submit(_req(f"later{i}", n=3, max_tokens=4, base=30 + i)) for i in range(4)]
        assert sum(is_terminal(e) for e in events) == 1 and isinstance(events[-2], Usage)
        end = events[-1]
        assert isinstance(end, Error) and end.kind == RuntimeErrorKind.KV_CAPACITY_EXCEEDED
        assert "max_batch_tokens" in end.message and len(_tokens(events)) > 64 - 60
        for done in await asyncio.gather(*(_collect(h) for h in [first, *later])):
            _check_stream(done)
            assert isinstance(done[-1], Done)
        assert core.stats().preemptions >= 1 and core.groups[0].kv_blocks[0] == 0

    _run([backend], body, config)


def test_abort_frees_kv_and_ends_the_stream_once() -> None:
    backend = FakeStepBackend(FakeConfig(step_latency=0.002))

    async def body(core: EngineCore) -> None:
        handle = core.submit(_req("a", max_tokens=500, n=40))
        events: list[WorkerEvent] = []
        async for e in handle:
            events.append(e)
            if isinstance(e, Token):
                handle.abort()
        assert isinstance(events[-1], Done) and events[-1].finish_reason == FinishReason.ABORT
        assert core.abort("a") is False
        group = core.groups[0]
        assert group.kv_blocks[0] == 0

    _run([backend], body)


def test_deadline_ends_the_request_with_timeout() -> None:
    import time

    backend = FakeStepBackend(FakeConfig(step_latency=0.005))

    async def body(core: EngineCore) -> None:
        handle = core.submit(_req("late", max_tokens=1000, deadline=time.monotonic() + 0.1))
        events = await _collect(handle)
        assert isinstance(events[-1], Error) and events[-1].kind == RuntimeErrorKind.TIMEOUT
        stats = core.stats()  # a passed deadline is a failure (GetStats: "failed (errors, timeouts)")
        assert (stats.failed, stats.aborted) == (1, 0)
        assert core.load()[0].kv_bytes_used == 0

    _run([backend], body)


@pytest.mark.parametrize(
    ("fake", "expect"),
    [
        (FakeConfig(die_after_steps=3), RuntimeErrorKind.BACKEND_UNAVAILABLE),
        (FakeConfig(hang_at_step=2), RuntimeErrorKind.BACKEND_UNAVAILABLE),
    ],
)
def test_backend_failure_ends_every_request_and_marks_the_group_unhealthy(
    fake: FakeConfig, expect: RuntimeErrorKind
) -> None:
    backend = FakeStepBackend(fake)

    async def body(core: EngineCore) -> None:
        handles = [core.submit(_req(f"r{i}", max_tokens=50)) for i in range(4)]
        outs = await asyncio.gather(*(_collect(h) for h in handles))
        for events in outs:
            assert sum(is_terminal(e) for e in events) == 1
            assert isinstance(events[-1], Error) and events[-1].kind == expect
        assert core.load()[0].healthy is False
        with pytest.raises(OminixError) as exc:
            core.submit(_req("after"))
        assert exc.value.kind == RuntimeErrorKind.BACKEND_UNAVAILABLE

    _run([backend], body, EngineCoreConfig(step_timeout=0.3))


def test_per_request_failure_and_unknown_outputs_do_not_break_the_group() -> None:
    backend = FakeStepBackend(FakeConfig(fail_step=1, unknown_output_at_step=3))

    async def body(core: EngineCore) -> None:
        first = await _collect(core.submit(_req("first")))
        assert isinstance(first[-1], Error) and first[-1].message == "injected failure"
        second = await _collect(core.submit(_req("second")))
        _check_stream(second)
        assert isinstance(second[-1], Done)
        assert core.stats().failed == 1 and core.load()[0].healthy

    core = _run([backend], body)
    assert core.groups[0].counters.unexpected_outputs == 1


def test_an_engine_with_every_group_drained_is_not_ready_until_one_is_undrained() -> None:
    """Every new request would be refused, so health must say NOT_SERVING (a router then sends them
    elsewhere); one group drained of two leaves the engine ready."""

    async def main() -> list[bool]:
        groups = [FakeStepBackend(FakeConfig(worker_id=w, step_latency=0.002)) for w in ("a", "b")]
        core = EngineCore(list(groups), EngineCoreConfig())
        await core.start()
        seen = [core.ready]
        core.drain("a")
        seen.append(core.ready)
        core.drain("")
        seen.append(core.ready)
        with pytest.raises(OminixError):
            core.submit(_req("refused"))
        core.drain("b", draining=False)
        seen.append(core.ready)
        await core.stop(drain_timeout=0)
        return seen

    assert asyncio.run(asyncio.wait_for(main(), TIMEOUT)) == [True, True, False, True]


def test_stop_drains_then_ends_the_rest_and_rejects_new_requests() -> None:
    async def main() -> None:
        backend = FakeStepBackend(FakeConfig(step_latency=0.002))
        core = EngineCore([backend], EngineCoreConfig())
        await core.start()
        assert core.ready
        short = core.submit(_req("short", max_tokens=3))
        long = core.submit(_req("long", max_tokens=100_000 // 100))
        collect = [asyncio.create_task(_collect(h)) for h in (short, long)]
        await core.stop(drain_timeout=0.2)
        short_events, long_events = await asyncio.wait_for(asyncio.gather(*collect), TIMEOUT)
        assert isinstance(short_events[-1], Done)
        assert (
            isinstance(long_events[-1], Error)
            and long_events[-1].kind == RuntimeErrorKind.BACKEND_UNAVAILABLE
        )
        assert not core.ready and backend.closed
        with pytest.raises(OminixError) as exc:
            core.submit(_req("new"))
        assert exc.value.kind == RuntimeErrorKind.BACKEND_UNAVAILABLE

    asyncio.run(main())


def test_listeners_get_one_run_report_per_request_and_step_reports() -> None:
    reports: list[RunReport] = []
    steps: list[tuple[str, StepReport]] = []

    async def body(core: EngineCore) -> None:
        core.add_listener(reports.append)
        core.add_step_listener(lambda w, r: steps.append((w, r)))
        await asyncio.gather(*(_collect(core.submit(_req(f"r{i}", max_tokens=5))) for i in range(3)))

    _run([FakeStepBackend()], body)
    assert sorted(r.request_id for r in reports) == ["r0", "r1", "r2"]
    r = reports[0]
    assert r.output_tokens == 5 and r.finish_reason == FinishReason.LENGTH and r.worker_id == "fake-0"
    assert r.ttft is not None and r.tpot is not None and r.e2e >= r.ttft >= 0
    assert all(w == "fake-0" for w, _ in steps)
    assert sum(s.num_sampled_tokens for _, s in steps) == 15 and steps[0][1].num_tokens == 36


def test_routing_prefers_the_cached_prefix_among_equally_loaded_groups() -> None:
    a = FakeStepBackend(FakeConfig(worker_id="a"))
    b = FakeStepBackend(FakeConfig(worker_id="b"))

    async def body(core: EngineCore) -> None:
        await _collect(core.submit(_req("warm", n=64, base=5)))
        warm_group = next(g for g in core.groups if g.counters.accepted == 1)
        for i in range(3):
            await _collect(core.submit(_req(f"again{i}", n=64, base=5)))
        assert warm_group.counters.accepted == 4
        # A 64-token prompt found whole: only its last token computed again.
        assert core.stats().cached_tokens == 3 * 63
        # Many concurrent requests spread over both groups.
        handles = [core.submit(_req(f"spread{i}", n=20, base=100 + i, max_tokens=30)) for i in range(16)]
        assert all(load.running_requests + load.queued_requests >= 4 for load in core.load())
        await asyncio.gather(*(_collect(h) for h in handles))

    _run([a, b], body)


def test_a_burst_of_submissions_reads_counts_and_never_walks_the_waiting_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The queue limit and the routing read the groups' counts: admitting a burst costs O(1) a request, not a
    walk over every waiting request (a load snapshot's waiting tokens) per submission."""
    walks = 0
    waiting_tokens = WaitingQueue.num_waiting_tokens

    def counted(queue: WaitingQueue) -> int:
        nonlocal walks
        walks += 1
        return waiting_tokens.fget(queue)  # type: ignore[misc]

    monkeypatch.setattr(WaitingQueue, "num_waiting_tokens", property(counted))
    backends = [FakeStepBackend(FakeConfig(worker_id=w, max_running_requests=8)) for w in ("a", "b")]

    async def body(core: EngineCore) -> None:
        handles = [core.submit(_req(f"r{i}", n=8, max_tokens=1, base=i % 50)) for i in range(300)]
        assert walks == 0
        assert sum(load.queued_requests + load.running_requests for load in core.load()) == 300
        assert walks == 2  # load() itself still reports waiting tokens, once per group
        for events in await asyncio.gather(*(_collect(h) for h in handles)):
            _check_stream(events)

    _run(backends, body)


def test_a_request_groups_queue_counts_follow_submissions_starts_and_ends() -> None:
    """A request-level group counts its queued requests and their prompt tokens as they come, start and end
    (ended while queued included), rather than walking its live requests on every read."""
    backend = FakeRequestBackend(FakeConfig(worker_id="req", max_running_requests=2), token_delay=0.002)

    async def body(core: EngineCore) -> None:
        (group,) = core.groups
        handles = {f"q{i}": core.submit(_req(f"q{i}", n=10 + i, max_tokens=4)) for i in range(6)}
        queued = [f"q{i}" for i in range(2, 6)]  # two forwarded at once, four behind them
        assert (group.num_queued, group.num_running) == (4, 2)
        assert group.num_waiting_tokens == sum(10 + int(rid[1:]) for rid in queued)
        handles["q4"].abort()  # ends while queued
        assert (group.num_queued, group.num_waiting_tokens) == (3, 12 + 13 + 15)
        for events in await asyncio.gather(*(_collect(h) for h in handles.values())):
            assert sum(is_terminal(e) for e in events) == 1
        assert (group.num_queued, group.num_running, group.num_waiting_tokens) == (0, 0, 0)

    _run([backend], body)


def test_requests_ended_before_their_forwarding_task_runs_give_their_running_slot_back() -> None:
    """A request aborted or finished in the same turn of the loop as its submission (its forwarding task
    cancelled before its first step) gets one terminal event and frees its running slot: more such ends than
    max_running_requests still leave the group forwarding the requests that follow."""
    backend = FakeRequestBackend(FakeConfig(worker_id="req", max_running_requests=2))

    async def body(core: EngineCore) -> None:
        (group,) = core.groups
        ended = []
        for i in range(3):
            ended.append(core.submit(_req(f"abort{i}", max_tokens=4)))
            assert core.abort(f"abort{i}")
            ended.append(core.submit(_req(f"stop{i}", max_tokens=4)))
            assert core.finish(f"stop{i}", FinishReason.STOP, "")
        for events in await asyncio.gather(*(_collect(h) for h in ended)):
            assert sum(is_terminal(e) for e in events) == 1 and isinstance(events[-1], Done)
        await asyncio.sleep(0)  # the cancelled tasks finish
        assert group._num_running == 0  # noqa: SLF001 - the slots themselves, not the live count
        after = [core.submit(_req(f"after{i}", max_tokens=3)) for i in range(3)]
        outs = await asyncio.wait_for(asyncio.gather(*(_collect(h) for h in after)), 2.0)
        for events in outs:
            _check_stream(events)
            assert isinstance(events[-1], Done) and events[-1].finish_reason == FinishReason.LENGTH
            assert len(_tokens(events)) == 3

    _run([backend], body)


def test_capability_problems_refuse_to_start() -> None:
    async def main() -> None:
        core = EngineCore([FakeStepBackend(FakeConfig(eos_token_ids=()))], EngineCoreConfig())
        with pytest.raises(OminixError) as exc:
            await core.start()
        assert exc.value.kind == RuntimeErrorKind.CAPABILITY_MISMATCH
        assert "eos_token_ids is empty" in exc.value.message
        twins = EngineCore([FakeStepBackend(), FakeStepBackend()], EngineCoreConfig())
        with pytest.raises(OminixError, match="same worker_id"):
            await twins.start()
        worker = FakeStepBackend()
        other_model = EngineCore([worker], EngineCoreConfig())
        with pytest.raises(OminixError, match="model mismatch"):
            await other_model.start(ServingTerms(model_name="another-model"))
        assert worker.num_streams_opened == 0  # negotiation runs before any Run stream opens

    asyncio.run(main())


def test_request_level_backend_is_admitted_by_priority_and_checked() -> None:
    backend = FakeRequestBackend(FakeConfig(worker_id="req", max_running_requests=1), token_delay=0.001)
    order: list[str] = []

    async def body(core: EngineCore) -> None:
        assert await backend.health()
        core.add_listener(lambda r: order.append(r.request_id))
        blocker = core.submit(_req("first", max_tokens=5))
        handles = [blocker]
        for rid, prio in (
            ("batch", Priority.BATCH),
            ("rt", Priority.REALTIME),
            ("inter", Priority.INTERACTIVE),
        ):
            handles.append(core.submit(_req(rid, max_tokens=3, priority=prio)))
        outs = await asyncio.gather(*(_collect(h) for h in handles))
        for events in outs:
            _check_stream(events)
        assert core.stats().protocol_violations == 0

    _run([backend], body)
    assert order == ["first", "rt", "inter", "batch"]


def test_broken_request_backend_is_counted_and_clients_still_see_one_terminal_event() -> None:
    backend = FakeRequestBackend(FakeConfig(worker_id="broken"), broken=True)

    async def body(core: EngineCore) -> None:
        events = await _collect(core.submit(_req("x", max_tokens=3)))
        assert isinstance(events[0], Token)  # forwarded as the backend sent it
        assert sum(is_terminal(e) for e in events) == 1
        await asyncio.sleep(0.05)  # let the forwarder read the duplicate terminal event
        stats = core.stats()
        assert stats.protocol_violations == 2
        assert any("before prefill_done" in v for v in stats.recent_protocol_violations)
        assert any("after its terminal event" in v for v in stats.recent_protocol_violations)

    _run([backend], body)


def test_a_flush_while_requests_share_a_prefix_keeps_the_registry_consistent() -> None:
    """A flush (``/flush_cache``) while two running requests share cached prefix blocks: the registry stays
    consistent while they share, both finish with the tokens they would have had, and nothing they computed
    is served afterwards: a request that extends the first one's prompt with its outputs finds only what a
    request admitted after the flush cached."""

    async def body(core: EngineCore) -> None:
        first = core.submit(_req("a", n=40, max_tokens=40))
        events_a = await first.next_events()  # its prompt is computed and cached by now
        second = core.submit(_req("b", n=40, max_tokens=40))
        events_b = await second.next_events()
        assert isinstance(events_b[0], PrefillDone) and events_b[0].cached_tokens == 32  # 2 blocks of 16
        assert not any(is_terminal(e) for e in events_a + events_b)  # both still run at the flush
        assert await core.flush_cache() == {"fake-0": True}
        core.check_integrity()  # two leases share blocks that are no longer cached
        events_a += await _collect(first)
        events_b += await _collect(second)
        for events in (events_a, events_b):
            _check_stream(events)
        assert _tokens(events_a) == _tokens(events_b)  # same prompt and seed
        fresh = await _collect(core.submit(_req("c", n=40, max_tokens=1)))  # caches the prompt's 2 blocks
        assert isinstance(fresh[0], PrefillDone) and fresh[0].cached_tokens == 0
        follow_up = _req("d", n=40, max_tokens=2)
        follow_up.prompt_token_ids = follow_up.prompt_token_ids + _tokens(events_a)[:30]
        events_d = await _collect(core.submit(follow_up))
        assert isinstance(events_d[0], PrefillDone) and events_d[0].cached_tokens == 32

    _run([FakeStepBackend(FakeConfig(step_latency=0.002))], body)


def test_idle_integrity_checks_are_counted_and_catch_corruption() -> None:
    async def body(core: EngineCore) -> None:
        await _collect(core.submit(_req("one")))
        for _ in range(500):  # bounded wait for the driver's idle check
            if core.stats().integrity_checks:
                break
            await asyncio.sleep(0.01)
        assert core.stats().integrity_checks >= 1 and core.stats().integrity_violations == 0
        group = core.groups[0]
        assert isinstance(group, StepWorkerGroup)
        registry = group.scheduler.registry
        registry._pools[0].num_leased += 1  # simulate a leak
        before = core.stats().integrity_checks
        await _collect(core.submit(_req("two")))
        for _ in range(500):
            if core.stats().integrity_checks > before:
                break
            await asyncio.sleep(0.01)
        assert core.stats().integrity_violations >= 1
        registry._pools[0].num_leased -= 1

    _run([FakeStepBackend()], body, EngineCoreConfig(idle_integrity_check_interval=0.0))


def test_a_reader_that_falls_behind_gets_queued_tokens_as_one_event() -> None:
    """Tokens that pile up while a stream's reader is busy come out as one Token (ids in order, one terminal);
    a request with stop strings keeps one event per token, so no token is sent past a match."""
    backend = FakeStepBackend(FakeConfig())

    async def body(core: EngineCore) -> None:
        plain = core.submit(_req("plain", max_tokens=12))
        stops = _req("stops", max_tokens=12)
        stops.sampling.stop = ["never-matched"]
        with_stops = core.submit(stops)
        while core.stats().running_requests or core.stats().queued_requests:
            await asyncio.sleep(0.01)  # both finish before anything reads their streams
        late = await _collect(plain)
        _check_stream(late)
        assert [len(e.token_ids) for e in late if isinstance(e, Token)] == [12]
        per_token = await _collect(with_stops)
        _check_stream(per_token)
        assert [len(e.token_ids) for e in per_token if isinstance(e, Token)] == [1] * 12
        assert _tokens(late) == _tokens(per_token)  # same prompt, seed and sampling: same tokens

    _run([backend], body)
    assert not backend.violations


def test_results_already_back_are_applied_together_and_reach_the_stream_as_one_event() -> None:
    """A result that is already there when the driver takes one (the engine is behind its worker) is applied
    before anything is delivered: a reader waiting on its stream gets the tokens of those steps as one Token,
    the same tokens as a request read step by step, one terminal event, every step reported."""
    backend = FakeStepBackend(FakeConfig())  # answers every step at once: results are always back in a row
    steps: list[StepReport] = []

    async def body(core: EngineCore) -> None:
        core.add_step_listener(lambda _wid, report: steps.append(report))
        plain = core.submit(_req("plain", max_tokens=12))
        stops = _req("stops", max_tokens=12)
        stops.sampling.stop = ["never-matched"]  # a request with stop strings keeps one event per token
        events, per_token = await asyncio.gather(_collect(plain), _collect(core.submit(stops)))
        for stream in (events, per_token):
            _check_stream(stream)
        sizes = [len(e.token_ids) for e in events if isinstance(e, Token)]
        assert sum(sizes) == 12 and len(sizes) < 12 and max(sizes) > 1
        assert [len(e.token_ids) for e in per_token if isinstance(e, Token)] == [1] * 12
        assert _tokens(events) == _tokens(per_token)

    core = _run([backend], body, EngineCoreConfig(max_inflight_steps=3))
    assert not backend.violations
    assert sum(r.num_sampled_tokens for r in steps) == 24
    assert core.stats().running_requests == 0


@pytest.mark.parametrize("light_load_below_running", [0, 4, 64])
def test_steps_in_flight_follow_the_load(
    light_load_below_running: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three steps in flight while at least ``light_load_below_running`` requests run (exactly that many
    included), at most two below it, also once requests finish while three are out (0: three always); the
    tokens are those of a run with one step in flight."""
    from ominix_runtime.testing.fake_backend import FakeStepStream

    # (requests running when the step was scheduled, steps in flight once it is sent)
    sends: list[tuple[int, int]] = []
    groups: list[StepWorkerGroup] = []
    send = FakeStepStream.send

    async def counting_send(self: FakeStepStream, step: DecodeStep) -> None:
        await send(self, step)  # the driver sends right after scheduling: no step is being answered
        running = groups[0].scheduler.num_running - len(step.new_requests) if groups else 0
        sends.append((running, len(self._pending)))

    monkeypatch.setattr(FakeStepStream, "send", counting_send)
    # Two requests alone; then six that finish in turn: 6 run, then 5, exactly 4, and 1 last.
    phases = [{"a": 16, "b": 16}, {"c0": 8, "c1": 10, "c2": 20, "c3": 20, "c4": 20, "c5": 30}]

    def run(config: EngineCoreConfig) -> dict[str, list[int]]:
        outputs: dict[str, list[int]] = {}

        async def body(core: EngineCore) -> None:
            groups[:] = [g for g in core._groups if isinstance(g, StepWorkerGroup)]
            for phase in phases:
                handles = [
                    core.submit(_req(rid, max_tokens=n, base=10 + i))
                    for i, (rid, n) in enumerate(phase.items())
                ]
                streams = await asyncio.gather(*(_collect(h) for h in handles))
                for rid, events in zip(phase, streams, strict=True):
                    _check_stream(events)
                    outputs[rid] = _tokens(events)

        backend = FakeStepBackend(FakeConfig(step_latency=0.002))
        _run([backend], body, config)
        assert not backend.violations
        return outputs

    reference = run(EngineCoreConfig(max_inflight_steps=1))
    assert {rid: len(tokens) for rid, tokens in reference.items()} == {**phases[0], **phases[1]}
    sends.clear()
    config = EngineCoreConfig(max_inflight_steps=3, light_load_below_running=light_load_below_running)
    assert run(config) == reference
    deepest = {n: max(depth for running, depth in sends if running == n) for n, _ in sends}
    assert deepest[1] == (3 if light_load_below_running == 0 else 2)
    assert deepest[6] == deepest[5] == (2 if light_load_below_running == 64 else 3)
    if light_load_below_running == 4:
        assert deepest[4] == 3  # exactly the threshold: no longer light
        assert all(depth <= 2 for running, depth in sends if running < 4)
    if light_load_below_running == 64:
        assert all(depth <= 2 for _, depth in sends)


def test_a_backlog_keeps_three_steps_in_flight_under_light_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below the running threshold the depth is two only while nothing waits for admission: with eight
    requests and room for two, steps built while some waited go out three deep, and those built with
    nothing waiting at most two; every request still ends with its tokens."""
    from ominix_runtime.testing.fake_backend import FakeStepStream

    sends: list[tuple[int, int]] = []  # (requests waiting before the step was built, steps in flight)
    groups: list[StepWorkerGroup] = []
    send = FakeStepStream.send

    async def counting_send(self: FakeStepStream, step: DecodeStep) -> None:
        await send(self, step)
        waited = (
            groups[0].scheduler.num_waiting + len(step.new_requests) if groups else 0
        )  # admitted ones waited
        sends.append((waited, len(self._pending)))

    monkeypatch.setattr(FakeStepStream, "send", counting_send)
    lengths = {f"r{i}": 6 + i for i in range(8)}

    async def body(core: EngineCore) -> None:
        groups[:] = [g for g in core._groups if isinstance(g, StepWorkerGroup)]
        handles = [
            core.submit(_req(rid, max_tokens=n, base=10 + i)) for i, (rid, n) in enumerate(lengths.items())
        ]
        for rid, events in zip(lengths, await asyncio.gather(*(_collect(h) for h in handles)), strict=True):
            _check_stream(events)
            assert len(_tokens(events)) == lengths[rid]

    backend = FakeStepBackend(FakeConfig(step_latency=0.002))
    config = EngineCoreConfig(
        scheduler=SchedulerConfig(max_running_requests=2), max_inflight_steps=3, light_load_below_running=64
    )
    _run([backend], body, config)
    assert not backend.violations
    assert max(depth for waiting, depth in sends if waiting) == 3
    assert all(depth <= 2 for waiting, depth in sends if not waiting)


def test_reader_waker_wakes_in_slices_in_order_and_each_reader_once() -> None:
    """More waiting readers than a slice: all are woken, first come first, across several loop turns; tokens
    put twice before their reader was woken are taken together, with a single wake-up."""
    from ominix_runtime.engine.core import _WAKE_SLICE, EventInbox, ReaderWaker

    async def main() -> None:
        waker = ReaderWaker()
        inboxes = [EventInbox(waker) for _ in range(_WAKE_SLICE * 2 + 3)]
        woken: list[int] = []

        async def read(i: int) -> list[WorkerEvent]:
            events = await inboxes[i].take()
            woken.append(i)
            return events

        readers = [asyncio.create_task(read(i)) for i in range(len(inboxes))]
        await asyncio.sleep(0)  # every reader waits
        for i, inbox in enumerate(inboxes):
            inbox.put(Token(f"r{i}", [i], []))
        inboxes[0].put(Token("r0", [99], []))
        await asyncio.sleep(0)  # one loop turn: the first slice only
        assert len(woken) <= _WAKE_SLICE
        taken = await asyncio.gather(*readers)
        assert woken == list(range(len(inboxes)))
        assert [t.token_ids for t in taken[0] if isinstance(t, Token)] == [[0], [99]]
        assert all(len(events) == 1 for events in taken[1:])

    asyncio.run(main())


def test_reader_waker_still_wakes_after_the_loop_it_was_pending_on_ended() -> None:
    """A wake-up turn left pending when its event loop stopped does not block readers on the next loop."""
    from ominix_runtime.engine.core import EventInbox, ReaderWaker

    waker = ReaderWaker()
    old = asyncio.new_event_loop()
    try:
        inbox = EventInbox(waker)
        reader = old.create_task(inbox.take())
        old.run_until_complete(asyncio.sleep(0))  # the reader waits
        old.call_soon(inbox.put, Token("a", [1], []))  # schedules the wake-up turn for the next iteration...
        old.call_soon(old.stop)  # ...which never comes
        old.run_forever()
        reader.cancel()
    finally:
        old.close()

    async def read_on_a_new_loop() -> list[WorkerEvent]:
        fresh = EventInbox(waker)
        task = asyncio.ensure_future(fresh.take())
        await asyncio.sleep(0)
        fresh.put(Token("b", [2], []))
        return await asyncio.wait_for(task, TIMEOUT)

    assert [e.token_ids for e in asyncio.run(read_on_a_new_loop()) if isinstance(e, Token)] == [[2]]


def test_results_taken_together_share_the_time_they_ran_in_their_step_reports() -> None:
    """Three results taken at once ran one after another on the worker: each step report gets a third of the
    time since the first could start, so the decode-rate estimate is not inflated by steps of no time."""
    from ominix_runtime.contract import RunningRequestData
    from ominix_runtime.engine.groups.step_group import _Applied

    reports: list[StepReport] = []

    async def body(core: EngineCore) -> None:
        core.add_step_listener(lambda _wid, report: reports.append(report))
        group = core.groups[0]
        assert isinstance(group, StepWorkerGroup)
        group._last_result_at = 10.0
        rows = [RunningRequestData(f"r{i}", [], 1) for i in range(4)]
        applied = [
            _Applied(
                DecodeStep(i, running_requests=rows), 9.0, 0.0, [Token(f"r{j}", [5], []) for j in range(4)]
            )
            for i in (1, 2, 3)
        ]
        group._record_steps(applied, now=10.6)
        assert [r.duration for r in reports] == pytest.approx([0.2, 0.2, 0.2])
        assert group.decode_tokens_per_second == pytest.approx(4 / 0.2)
        assert list(group.recent_step_durations)[-3:] == pytest.approx([0.2, 0.2, 0.2])

    _run([FakeStepBackend()], body)
