"""Worker failover inside one EngineCore with fake step backends: resume, same tokens, reconnect."""

from __future__ import annotations

import asyncio

from ominix_runtime.contract import (
    Done,
    Error,
    GenerateRequest,
    RuntimeErrorKind,
    SamplingParams,
    Token,
    WorkerEvent,
    is_terminal,
)
from ominix_runtime.engine import EngineCore, EngineCoreConfig, RequestHandle
from ominix_runtime.testing.fake_backend import FakeConfig, FakeStepBackend

TIMEOUT = 20.0
NUM_REQUESTS = 20
MAX_TOKENS = 40


def _req(i: int) -> GenerateRequest:
    prompt = [10 + ((i * 7 + k) % 50) for k in range(9 + i % 5)]
    sp = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=1.0, seed=None if i % 2 else 100 + i, ignore_eos=True
    )
    return GenerateRequest(f"r{i}", prompt, sp)


def _fake(worker_id: str) -> FakeStepBackend:
    return FakeStepBackend(FakeConfig(worker_id=worker_id, step_latency=0.003, max_running_requests=16))


async def _collect(handle: RequestHandle) -> list[WorkerEvent]:
    return [e async for e in handle]


def _tokens(events: list[WorkerEvent]) -> list[int]:
    return [t for e in events if isinstance(e, Token) for t in e.token_ids]


async def _wait_until(predicate, timeout: float = 5.0) -> None:  # noqa: ANN001 - a zero-argument callable
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


async def _reference() -> dict[str, list[int]]:
    """Tokens of every request on one worker that never fails (seeds fixed from a first run's records)."""
    core = EngineCore([_fake("ref")], EngineCoreConfig())
    await core.start()
    try:
        handles = [core.submit(_req(i)) for i in range(NUM_REQUESTS)]
        outs = await asyncio.wait_for(asyncio.gather(*(_collect(h) for h in handles)), TIMEOUT)
    finally:
        await core.stop()
    return {h.request_id: _tokens(o) for h, o in zip(handles, outs, strict=True)}


def test_killed_worker_requests_resume_on_the_survivor_with_the_same_tokens() -> None:
    async def main() -> None:
        reference = await _reference()
        a, b = _fake("w0"), _fake("w1")
        core = EngineCore([a, b], EngineCoreConfig(reconnect_backoff_initial=0.05))
        await core.start()
        try:
            handles = [core.submit(_req(i)) for i in range(NUM_REQUESTS)]
            tasks = [asyncio.create_task(_collect(h)) for h in handles]
            victim = core.groups[0]
            # Crash once some of the victim's requests have streamed tokens (they must resume, not restart).
            await _wait_until(lambda: victim.counters.generated_tokens >= 30)
            a.crash()
            outs = await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)
            for h, events in zip(handles, outs, strict=True):
                assert sum(is_terminal(e) for e in events) == 1
                assert isinstance(events[-1], Done), events[-1]
                # Seeded requests continue exactly; unseeded ones keep their engine-drawn seed too.
                if int(h.request_id[1:]) % 2 == 0:
                    assert _tokens(events) == reference[h.request_id]
                assert len(_tokens(events)) == MAX_TOKENS
            survivor = core.groups[1]
            assert survivor.counters.resumed > 0 and victim.num_failures == 1
            assert survivor.kv_blocks[0] == 0
            core.check_integrity()
            assert core.ready  # one worker still serves
            a.revive()
            await _wait_until(lambda: victim.healthy and victim.running)
            assert victim.num_reconnects == 1 and victim.kv_blocks[0] == 0
            again = await asyncio.wait_for(_collect(core.submit(_req(0))), TIMEOUT)
            assert _tokens(again) == reference["r0"]
        finally:
            await core.stop()
        core.check_integrity()

    asyncio.run(main())


def test_no_survivor_ends_every_request_with_backend_unavailable_then_reconnects() -> None:
    async def main() -> None:
        backend = _fake("only")
        core = EngineCore([backend], EngineCoreConfig(reconnect_backoff_initial=0.05))
        await core.start()
        try:
            handles = [core.submit(_req(i)) for i in range(4)]
            tasks = [asyncio.create_task(_collect(h)) for h in handles]
            group = core.groups[0]
            await _wait_until(lambda: group.counters.generated_tokens >= 4)
            backend.crash()
            for events in await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT):
                assert sum(is_terminal(e) for e in events) == 1
                assert (
                    isinstance(events[-1], Error) and events[-1].kind == RuntimeErrorKind.BACKEND_UNAVAILABLE
                )
            assert not core.ready
            backend.revive()
            await _wait_until(lambda: core.ready)
            done = await asyncio.wait_for(_collect(core.submit(_req(7))), TIMEOUT)
            assert isinstance(done[-1], Done)
        finally:
            await core.stop()

    asyncio.run(main())


def test_a_failed_workers_requests_go_to_a_drained_group_only_when_no_other_can_take_them() -> None:
    """Three groups: w0 fails while w1 is drained (idle) and w2 is busier than w1. Every request of w0 resumes
    on w2; once w2 is gone too, on w1 rather than failing."""

    async def main() -> tuple[list[list[WorkerEvent]], list[list[WorkerEvent]], int, int]:
        backends = [_fake(f"w{i}") for i in range(3)]
        core = EngineCore(backends, EngineCoreConfig())
        await core.start()
        try:
            core.drain("w1")
            handles = [core.submit(_req(i)) for i in range(NUM_REQUESTS)]  # on w0 and w2 only
            tasks = [asyncio.create_task(_collect(h)) for h in handles]
            victim, drained, busy = core.groups
            assert victim.num_running + victim.num_queued > 0 and busy.num_running + busy.num_queued > 0
            await _wait_until(lambda: victim.counters.generated_tokens >= 10)
            backends[0].crash()
            first = await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)
            resumed_on_drained = drained.counters.resumed
            generated = busy.counters.generated_tokens
            handles = [core.submit(_req(i)) for i in range(4)]  # w0 is down: all on w2
            tasks = [asyncio.create_task(_collect(h)) for h in handles]
            await _wait_until(lambda: busy.counters.generated_tokens >= generated + 8)
            backends[2].crash()
            second = await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)
            return first, second, resumed_on_drained, drained.counters.resumed
        finally:
            await core.stop()

    first, second, resumed_before, resumed_after = asyncio.run(main())
    for events in first + second:
        assert sum(is_terminal(e) for e in events) == 1
        assert isinstance(events[-1], Done), events[-1]
        assert len(_tokens(events)) == MAX_TOKENS
    assert resumed_before == 0  # w2 took every request of w0
    assert resumed_after == 4  # with w2 gone, the drained w1 is the only one left
