"""Admission at its edges: a request id between its client's going and its end, an Abort that comes while the
prompt is tokenized, and a request the engine fails to take behind a front process.

A cancelled request is aborted at once, but behind ``--front-procs`` its terminal event comes back over the
link a round trip later: until then a new request of the same id is refused (ALREADY_EXISTS), never handed
the old one's events. An Abort of a live request whose prompt is still being tokenized is not lost: the
request ends with ABORT as soon as it is admitted. A bug on one request's submission refuses that request
(INTERNAL) and leaves the front's link, and every other request on it, alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from server_harness import SMOLLM2_VOCAB, RunningDaemon, start_daemon, stop_daemon

from ominix_runtime.config import FrontConfig
from ominix_runtime.contract import GenerateRequest, OminixError, RuntimeErrorKind
from ominix_runtime.engine.config import EngineCoreConfig
from ominix_runtime.engine.core import EngineCore, EventSink, RequestHandle
from ominix_runtime.engine.negotiation import ServingTerms
from ominix_runtime.models import DEFAULT_MODEL_NAME
from ominix_runtime.pb import common_pb2, engine_pb2
from ominix_runtime.server.engine_service import AlreadyLive, EngineService, EngineServiceBase
from ominix_runtime.server.front_process import EngineLink, FrontService
from ominix_runtime.server.logging import configure_logging
from ominix_runtime.testing.fake_backend import FakeConfig, FakeStepBackend
from ominix_runtime.testing.front_link import linked_front


def _request(rid: str, max_tokens: int) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=rid,
        input_ids=engine_pb2.TokenIds(ids=[11, 12, 13, 14]),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


async def _consume(
    front: EngineServiceBase, pb: engine_pb2.GenerateRequest, out: list[engine_pb2.GenerateEvent]
) -> None:
    admitted = await front.admit(pb, pb.request_id)
    async with contextlib.aclosing(front.stream_and_release(admitted)) as events:
        async for event in events:
            out.append(event)


@contextlib.asynccontextmanager
async def _front_over_a_link() -> AsyncIterator[tuple[EngineCore, EngineLink, FrontService]]:
    """An engine core on a fake step backend, and one front's service linked to it over the hub's socket."""
    backend = FakeStepBackend(
        FakeConfig(model_name=DEFAULT_MODEL_NAME, vocab_size=SMOLLM2_VOCAB, step_latency=0.005)
    )
    core = EngineCore([backend], EngineCoreConfig())
    await core.start(ServingTerms(DEFAULT_MODEL_NAME, None))
    try:
        async with linked_front(core, EngineService(core, None, DEFAULT_MODEL_NAME)) as (link, front):
            yield core, link, front
    finally:
        await core.stop(drain_timeout=0)


def test_a_cancelled_id_behind_a_front_process_is_refused_until_its_end_comes_back() -> None:
    async def main() -> tuple[bool, list[engine_pb2.GenerateEvent], int]:
        async with _front_over_a_link() as (core, link, front):
            first: list[engine_pb2.GenerateEvent] = []
            streaming = asyncio.create_task(_consume(front, _request("reuse", 300), first))
            while not any(e.HasField("token") for e in first):
                await asyncio.sleep(0.005)
            streaming.cancel()  # the client went away mid-stream: the front aborts it over the link
            with contextlib.suppress(asyncio.CancelledError):
                await streaming
            # At once, the old request's Done(ABORT) has not come back: the id is still the old request's.
            refused = False
            try:
                await _consume(front, _request("reuse", 20), [])
            except AlreadyLive:
                refused = True
            while link.holds("reuse"):
                await asyncio.sleep(0.005)
            second: list[engine_pb2.GenerateEvent] = []
            await asyncio.wait_for(_consume(front, _request("reuse", 20), second), 20)
            return refused, second, sum(load.running_requests for load in core.load())

    refused, second, running = asyncio.run(main())
    assert refused
    # Once it ended, the id runs again with its own events only.
    assert sum(len(e.token.token_ids) for e in second if e.HasField("token")) == 20
    assert [e.done.finish_reason for e in second if e.HasField("done")] == [common_pb2.FINISH_REASON_LENGTH]
    assert running == 0


@pytest.fixture(scope="module")
def in_process_daemon() -> Iterator[RunningDaemon]:
    configure_logging("warning", json_output=True)
    running, thread = start_daemon(
        FakeConfig(vocab_size=SMOLLM2_VOCAB, eos_token_ids=(2,), max_model_len=2048, step_latency=0.002),
        front=FrontConfig(procs=0),
    )
    try:
        yield running
    finally:
        stop_daemon(running, thread)


def test_an_abort_while_the_prompt_is_tokenized_ends_the_request(in_process_daemon: RunningDaemon) -> None:
    service = in_process_daemon.daemon._service  # noqa: SLF001
    pool = service._pool  # noqa: SLF001
    assert pool is not None
    encode = pool.encode_prompt

    async def slow_encode(text: str, parse_special: bool) -> list[int]:
        await asyncio.sleep(0.5)  # a long prompt being tokenized
        return await encode(text, parse_special)

    pool.encode_prompt = slow_encode  # type: ignore[method-assign]
    try:
        events: list[engine_pb2.GenerateEvent] = []
        pb = engine_pb2.GenerateRequest(
            request_id="abort-early",
            prompt="hello there",
            sampling=common_pb2.SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True),
        )
        reader = threading.Thread(
            target=lambda: events.extend(in_process_daemon.stub.Generate(pb, timeout=30))
        )
        reader.start()
        time.sleep(0.2)  # the request is live, its prompt still being tokenized
        found = in_process_daemon.stub.Abort(
            engine_pb2.AbortRequest(request_id="abort-early"), timeout=5
        ).found
        reader.join(30)
    finally:
        pool.encode_prompt = encode  # type: ignore[method-assign]
    assert found
    assert [e.done.finish_reason for e in events if e.HasField("done")] == [common_pb2.FINISH_REASON_ABORT]
    assert sum(len(e.token.token_ids) for e in events if e.HasField("token")) < 300


def test_a_submission_that_fails_in_the_engine_refuses_that_request_only() -> None:
    async def main() -> tuple[OminixError, list[engine_pb2.GenerateEvent]]:
        async with _front_over_a_link() as (core, _link, front):
            submit = core.submit

            def failing_submit(request: GenerateRequest, sink: EventSink | None = None) -> RequestHandle:
                if request.request_id == "broken":
                    raise RuntimeError("a bug on this request")
                return submit(request, sink)

            core.submit = failing_submit  # type: ignore[method-assign]
            with pytest.raises(OminixError) as refused:
                await _consume(front, _request("broken", 4), [])
            after: list[engine_pb2.GenerateEvent] = []
            await asyncio.wait_for(_consume(front, _request("after", 4), after), 20)
            return refused.value, after

    refused, after = asyncio.run(main())
    assert refused.kind == RuntimeErrorKind.INTERNAL and "a bug on this request" in refused.message
    assert [e.done.finish_reason for e in after if e.HasField("done")] == [common_pb2.FINISH_REASON_LENGTH]


class _Caller:
    """The servicer context of an Abort from a caller without an API key."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def abort(self, code: object, details: str = "", trailing_metadata: object = ()) -> None:
        raise AssertionError(f"refused: {code} {details}")


class _SlowTokenizer:
    """Encodes any text as three ids once ``release`` is set: a prompt still being tokenized."""

    max_token_chars = 64

    def __init__(self) -> None:
        self.release = threading.Event()

    def encode(self, text: str, parse_special: bool = False) -> list[int]:
        assert self.release.wait(30)
        return [11, 12, 13]


def test_an_abort_through_another_front_finds_a_prompt_still_being_tokenized() -> None:
    """Behind --front-procs an Abort reaching another front is forwarded to the engine process, which held
    only the requests fronts had submitted: one still being tokenized was not found and ran to its end. The
    front announces it (Resolving) now; the engine process has that front abort it, and it ends with ABORT."""

    async def main() -> tuple[bool, list[engine_pb2.GenerateEvent], bool]:
        backend = FakeStepBackend(
            FakeConfig(model_name=DEFAULT_MODEL_NAME, vocab_size=SMOLLM2_VOCAB, step_latency=0.005)
        )
        core = EngineCore([backend], EngineCoreConfig())
        await core.start(ServingTerms(DEFAULT_MODEL_NAME, None))
        engine_side = EngineService(core, None, DEFAULT_MODEL_NAME)
        try:
            async with linked_front(core, engine_side) as (_, front):
                tokenizer = _SlowTokenizer()
                front.tokenizer = tokenizer  # type: ignore[assignment]
                pb = engine_pb2.GenerateRequest(
                    request_id="elsewhere",
                    prompt="hello there",
                    sampling=common_pb2.SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True),
                )
                events: list[engine_pb2.GenerateEvent] = []
                streaming = asyncio.create_task(_consume(front, pb, events))
                while not engine_side.fronts or engine_side.fronts.resolving_owner("elsewhere") is None:
                    await asyncio.sleep(0.005)  # announced over the link
                answer = await engine_side.Abort(engine_pb2.AbortRequest(request_id="elsewhere"), _Caller())  # type: ignore[arg-type]
                unknown = await engine_side.Abort(engine_pb2.AbortRequest(request_id="nobody"), _Caller())  # type: ignore[arg-type]
                tokenizer.release.set()
                await asyncio.wait_for(streaming, 20)
                return answer.found, events, unknown.found
        finally:
            await core.stop(drain_timeout=0)

    found, events, unknown_found = asyncio.run(main())
    assert found and not unknown_found
    assert [e.done.finish_reason for e in events if e.HasField("done")] == [common_pb2.FINISH_REASON_ABORT]
    assert sum(len(e.token.token_ids) for e in events if e.HasField("token")) < 300
