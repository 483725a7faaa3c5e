"""The engine core driving SGLangBackend in front of the fake SGLang server (step 1 of the migration)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ominix_runtime.backends.sglang import SGLangBackend
from ominix_runtime.contract import (
    Done,
    Error,
    FinishReason,
    GenerateRequest,
    Granularity,
    PrefillDone,
    RuntimeErrorKind,
    SamplingParams,
    Token,
    WorkerEvent,
    is_terminal,
)
from ominix_runtime.engine.core import EngineCore, RequestHandle
from ominix_runtime.testing.fake_sglang import FakeSGLangServer, FakeSGLangState

T = TypeVar("T")


def with_engine(
    body: Callable[[FakeSGLangServer, EngineCore], Awaitable[T]], state: FakeSGLangState | None = None
) -> T:
    async def main() -> T:
        async with FakeSGLangServer(state or FakeSGLangState()) as server:
            core = EngineCore([SGLangBackend(server.url, timeout=5.0)])
            await core.start()
            try:
                return await body(server, core)
            finally:
                await core.stop()

    async def bounded() -> T:
        return await asyncio.wait_for(main(), 30.0)

    return asyncio.run(bounded())


def test_engine_streams_sglang_requests_concurrently() -> None:
    async def body(server: FakeSGLangServer, core: EngineCore) -> None:
        caps = core.capabilities()
        assert len(caps) == 1 and caps[0].granularity == Granularity.REQUEST
        handles = [
            core.submit(GenerateRequest(f"e-{i}", [3, 4, i + 5], SamplingParams(max_tokens=5, seed=i)))
            for i in range(4)
        ]

        async def drain(handle: RequestHandle) -> list[WorkerEvent]:
            return [e async for e in handle]

        results = await asyncio.gather(*(drain(h) for h in handles))
        for events in results:
            assert isinstance(events[0], PrefillDone)
            assert sum(is_terminal(e) for e in events) == 1
            done = events[-1]
            assert isinstance(done, Done) and done.finish_reason == FinishReason.LENGTH
            tokens = [e for e in events if isinstance(e, Token)]
            assert sum(len(t.token_ids) for t in tokens) == 5
            assert all(t.text for t in tokens)
        assert server.state.request_count == 4

    with_engine(body)


def test_engine_abort_reaches_sglang() -> None:
    async def body(server: FakeSGLangServer, core: EngineCore) -> None:
        handle = core.submit(GenerateRequest("ab-e", [3, 4], SamplingParams(max_tokens=1000)))
        events: list[WorkerEvent] = []
        async for event in handle:
            events.append(event)
            if isinstance(event, Token):
                assert core.abort("ab-e")
        assert isinstance(events[-1], Done) and events[-1].finish_reason == FinishReason.ABORT
        await core.stop()  # closes the backend, which flushes its pending abort notice
        assert "ab-e" in server.state.aborted_rids

    with_engine(body, FakeSGLangState(mode="slow", token_delay=0.02))


def test_engine_reports_sglang_failure_as_one_error() -> None:
    async def body(server: FakeSGLangServer, core: EngineCore) -> None:
        handle = core.submit(GenerateRequest("f-e", [3, 4], SamplingParams(max_tokens=10)))
        events = [e async for e in handle]
        assert sum(is_terminal(e) for e in events) == 1
        error = events[-1]
        assert isinstance(error, Error) and error.kind == RuntimeErrorKind.BACKEND_UNAVAILABLE

    with_engine(body, FakeSGLangState(mode="drop"))
