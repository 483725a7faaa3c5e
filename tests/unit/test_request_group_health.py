"""A request-level group (SGLang) follows its backend's health: the load poller asks the backend every
LOAD_POLL_INTERVAL_S; HEALTH_FAILURES_TO_DOWN failed, raising or hanging checks in a row mark the group
unhealthy (routing skips it, GetLoad says UNHEALTHY, the worker stats behind ominix_worker_up say down), fewer do
not, and a passing one brings it back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from ominix_runtime.contract import BackendHealth, Done, GenerateRequest, SamplingParams, WorkerEvent
from ominix_runtime.engine import EngineCore, EngineCoreConfig, RequestHandle
from ominix_runtime.engine.config import SchedulerConfig
from ominix_runtime.engine.groups import request_group
from ominix_runtime.testing.fake_backend import FakeConfig, FakeRequestBackend

POLL_S = 0.05


class _FlakyBackend(FakeRequestBackend):
    """A request-level fake whose health check fails (``down``), raises, or never answers (``hang``)."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(FakeConfig(worker_id=worker_id, model_name="m"))
        self.state = "up"
        self.health_checks = 0
        self.generated: list[str] = []

    async def health(self) -> bool:
        self.health_checks += 1
        if self.state == "hang":
            await asyncio.Event().wait()
        if self.state == "raise":
            raise ConnectionError("connection refused")
        return self.state == "up"

    async def generate(self, request: GenerateRequest) -> AsyncIterator[WorkerEvent]:
        self.generated.append(request.request_id)
        async for event in super().generate(request):
            yield event


async def _collect(handle: RequestHandle) -> list[WorkerEvent]:
    return [e async for e in handle]


def _req(rid: str) -> GenerateRequest:
    return GenerateRequest(rid, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))


async def _polled(backend: _FlakyBackend, times: int = 2) -> None:
    """Wait until the poller has asked ``backend`` ``times`` more times and applied the last answer."""
    target = backend.health_checks + times
    for _ in range(200):
        if backend.health_checks >= target:
            break
        await asyncio.sleep(POLL_S / 5)
    assert backend.health_checks >= target, "the group does not ask its backend's health"
    await asyncio.sleep(POLL_S / 5)


@pytest.mark.parametrize("failure", ["down", "raise", "hang"])
def test_a_request_level_group_follows_its_backends_health(
    failure: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one of two backends of model m fails its health check, its group reads unhealthy everywhere
    (GetLoad, worker stats, routing: every request goes to the other); once it passes again the group is back."""
    monkeypatch.setattr(request_group, "LOAD_POLL_INTERVAL_S", POLL_S)
    monkeypatch.setattr(request_group, "HEALTH_TIMEOUT_S", 0.1)

    async def main() -> None:
        sick, well = _FlakyBackend("sick"), _FlakyBackend("well")
        core = EngineCore([sick, well], EngineCoreConfig())
        await core.start()
        try:
            group = next(g for g in core.groups if g.worker_id == "sick")

            def health() -> BackendHealth:
                return next(load.health for load in core.load() if load.worker_id == "sick")

            assert group.stats().up and health() == BackendHealth.AVAILABLE

            sick.state = failure
            await _polled(sick, request_group.HEALTH_FAILURES_TO_DOWN + 1)
            assert not group.healthy and not group.stats().up and health() == BackendHealth.UNHEALTHY
            for i in range(4):
                assert isinstance((await _collect(core.submit(_req(f"r{i}"))))[-1], Done)
            assert sick.generated == [] and len(well.generated) == 4

            sick.state = "up"
            await _polled(sick)
            assert group.healthy and group.stats().up and health() == BackendHealth.AVAILABLE
        finally:
            await core.stop()

    asyncio.run(asyncio.wait_for(main(), 20))


def test_requests_queued_while_the_backend_was_down_go_out_when_it_is_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An unhealthy group forwards none of its queued requests (a freed running slot stays unused); they go to
    the backend as soon as its health check passes again."""
    monkeypatch.setattr(request_group, "LOAD_POLL_INTERVAL_S", POLL_S)

    async def main() -> None:
        backend = _FlakyBackend("sick")
        backend.token_delay = 0.3  # "first" runs ~0.9 s: the group turns unhealthy before it ends
        core = EngineCore([backend], EngineCoreConfig(scheduler=SchedulerConfig(max_running_requests=1)))
        await core.start()
        try:
            first, queued = core.submit(_req("first")), core.submit(_req("queued"))
            backend.state = "down"
            await _polled(backend, request_group.HEALTH_FAILURES_TO_DOWN + 1)
            assert isinstance((await _collect(first))[-1], Done)
            await asyncio.sleep(5 * POLL_S)
            assert backend.generated == ["first"] and core.groups[0].num_queued == 1
            backend.state = "up"
            try:
                events = await asyncio.wait_for(_collect(queued), 5)
            except asyncio.TimeoutError:
                pytest.fail("the request queued while the backend was down did not go out once it was back")
            assert isinstance(events[-1], Done) and backend.generated == ["first", "queued"]
        finally:
            await core.stop()

    asyncio.run(asyncio.wait_for(main(), 20))


def test_failed_checks_short_of_a_run_leave_the_group_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A health route that answers late now and then (it may run a generation under load) is no outage: checks
    that fail every other time, never HEALTH_FAILURES_TO_DOWN in a row, leave the group healthy throughout."""
    monkeypatch.setattr(request_group, "LOAD_POLL_INTERVAL_S", POLL_S)

    class _Alternating(_FlakyBackend):
        async def health(self) -> bool:
            self.state = "down" if self.state == "up" else "up"
            return await super().health()

    async def main() -> None:
        backend = _Alternating("flaky")
        core = EngineCore([backend], EngineCoreConfig())
        await core.start()
        try:
            group = core.groups[0]
            seen: list[bool] = []
            for _ in range(8):
                await _polled(backend, 1)
                seen.append(group.healthy)
            assert seen == [True] * 8 and core.ready
        finally:
            await core.stop()

    asyncio.run(asyncio.wait_for(main(), 20))
