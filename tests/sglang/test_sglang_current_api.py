"""The SGLang adapter against today's server surface: api key, current endpoints with fallback, KV bytes,
priority, validation-error chunks and the re-sent output of an aborted requeued request."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from ominix_runtime.backends.sglang import SGLangBackend, SGLangStreamMapper, parse_load, sglang_priority
from ominix_runtime.contract import (
    Done,
    Error,
    FinishReason,
    GenerateRequest,
    OminixError,
    Priority,
    RuntimeErrorKind,
    SamplingParams,
    Token,
    WorkerEvent,
)
from ominix_runtime.testing.fake_sglang import FakeSGLangServer, FakeSGLangState, token_text

T = TypeVar("T")


def with_server(
    body: Callable[[FakeSGLangServer, SGLangBackend], Awaitable[T]],
    client_key: str | None = None,
    **state: Any,
) -> T:
    async def main() -> T:
        async with FakeSGLangServer(FakeSGLangState(**state)) as server:
            backend = SGLangBackend(server.url, timeout=5.0, api_key=client_key)
            try:
                return await body(server, backend)
            finally:
                await backend.close()

    return asyncio.run(asyncio.wait_for(main(), 20.0))


async def collect(backend: SGLangBackend, request: GenerateRequest) -> list[WorkerEvent]:
    return [event async for event in backend.generate(request)]


def test_api_key_is_sent_on_every_call_and_required_by_the_server() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        cap = await backend.describe()
        assert cap.model.name == "fake/sglang-model"
        events = await collect(backend, GenerateRequest("key-1", [5, 6], SamplingParams(max_tokens=3)))
        assert isinstance(events[-1], Done) and events[-1].finish_reason == FinishReason.LENGTH
        assert (await backend.load())["kv_tokens_capacity"] == 65536.0
        keyless = SGLangBackend(server.url, timeout=5.0)
        try:
            with pytest.raises(OminixError) as info:
                await keyless.describe()
            assert "401" in info.value.message
        finally:
            await keyless.close()

    with_server(body, client_key="s3cret", api_key="s3cret")


def test_deprecated_endpoints_are_the_fallback_of_an_older_server() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        cap = await backend.describe()
        assert cap.model.max_model_len == 4096 and cap.kv_num_blocks == 65536
        load = await backend.load()  # /get_load: tokens, no pool size -> no byte figures stated
        assert load["kv_tokens_capacity"] == 65536.0 and "kv_bytes_used" not in load

    with_server(body, legacy_only=True)


def test_v1_loads_gives_true_kv_bytes_while_requests_run() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        await backend.describe()
        request = GenerateRequest("kv-1", list(range(10, 110)), SamplingParams(max_tokens=500))
        stream = backend.generate(request)
        async for event in stream:
            if isinstance(event, Token):
                break
        load = await backend.load()
        assert load["running_requests"] == 1.0
        assert load["kv_bytes_capacity"] == 65536 * 4096
        assert load["kv_bytes_used"] == pytest.approx(load["kv_tokens_used"] * 4096)
        assert load["kv_tokens_used"] >= 100
        await backend.abort("kv-1")
        rest = [e async for e in stream]
        assert isinstance(rest[-1], Done) and rest[-1].finish_reason == FinishReason.ABORT

    with_server(body, mode="slow", token_delay=0.02)


def test_priority_is_forwarded_only_when_the_server_schedules_by_it() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        await backend.describe()
        for rid, prio in (("p-1", Priority.REALTIME), ("p-2", Priority.BATCH)):
            events = await collect(
                backend, GenerateRequest(rid, [7, 8], SamplingParams(max_tokens=2), priority=prio)
            )
            assert isinstance(events[-1], Done)
        assert server.state.priorities == [2, 0]  # larger first, SGLang's default ordering

    with_server(body, enable_priority_scheduling=True)

    async def without(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        await backend.describe()
        events = await collect(backend, GenerateRequest("p-3", [7, 8], SamplingParams(max_tokens=2)))
        assert isinstance(events[-1], Done) and server.state.priorities == [None]

    with_server(without)
    assert sglang_priority(Priority.REALTIME, low_values_first=True) == 0


def test_validation_error_chunk_is_invalid_argument() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        events = await collect(backend, GenerateRequest("bad-1", [40000], SamplingParams(max_tokens=2)))
        assert len(events) == 1 and isinstance(events[0], Error)
        assert events[0].kind == RuntimeErrorKind.INVALID_ARGUMENT and "vocabulary" in events[0].message

    with_server(body)
    # After output started, an error chunk is the server's failure, not the caller's.
    mapper = SGLangStreamMapper("m-1")
    mapper.on_chunk(
        {"text": " a", "output_ids": [5], "meta_info": {"prompt_tokens": 2, "completion_tokens": 1}}
    )
    (error,) = mapper.on_chunk({"error": {"message": "boom"}})
    assert isinstance(error, Error) and error.kind == RuntimeErrorKind.INTERNAL


def test_aborting_a_requeued_request_streams_no_text_twice() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        await backend.describe()
        request = GenerateRequest("rq-1", [3, 4, 5], SamplingParams(max_tokens=1000))
        events: list[WorkerEvent] = []
        async for event in backend.generate(request):
            events.append(event)
            if sum(isinstance(e, Token) for e in events) == 3 and not server.state.aborted_rids:
                await backend.abort("rq-1")
        done = events[-1]
        assert isinstance(done, Done) and done.finish_reason == FinishReason.ABORT
        ids = [t for e in events if isinstance(e, Token) for t in e.token_ids]
        text = "".join(e.text for e in events if isinstance(e, Token))
        assert len(ids) >= 3 and len(ids) == len(set(ids))  # the re-sent ids were not appended again
        assert text == "".join(token_text(t) for t in ids) == done.text  # nor the re-sent text

    with_server(body, mode="slow", token_delay=0.02, incremental_output=True, resend_output_on_abort=True)


def test_request_over_the_kv_pool_waits_then_runs() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        await backend.describe()
        reqs = [GenerateRequest(f"w-{i}", [10 + i] * 40, SamplingParams(max_tokens=20)) for i in range(3)]
        ends = await asyncio.gather(*(collect(backend, r) for r in reqs))
        assert all(isinstance(e[-1], Done) and e[-1].finish_reason == FinishReason.LENGTH for e in ends)
        # 60 tokens each in a pool of 100: they ran one after another.
        too_big = await collect(backend, GenerateRequest("w-big", [9] * 90, SamplingParams(max_tokens=20)))
        assert isinstance(too_big[-1], Error) and too_big[-1].kind == RuntimeErrorKind.INVALID_ARGUMENT

    with_server(body, max_total_num_tokens=100, context_length=4096)


def test_parse_load_sums_dp_ranks_of_both_shapes() -> None:
    gib = 1 << 30
    current = {
        "loads": [
            {
                "num_running_reqs": 2,
                "num_waiting_reqs": 1,
                "num_used_tokens": 300,
                "max_total_num_tokens": 1000,
                "gen_throughput": 50.0,
                "memory": {"kv_cache_gb": 1.0, "token_capacity": 1000},
            },
            {
                "num_running_reqs": 1,
                "num_waiting_reqs": 0,
                "num_used_tokens": 100,
                "max_total_num_tokens": 1000,
                "gen_throughput": 30.0,
                "memory": {"kv_cache_gb": 1.0, "token_capacity": 1000},
            },
        ]
    }
    out = parse_load(current)
    assert out["running_requests"] == 3 and out["queued_requests"] == 1
    assert out["kv_bytes_capacity"] == 2 * gib and out["kv_bytes_used"] == pytest.approx(2 * gib * 400 / 2000)
    assert out["decode_tokens_per_second"] == 80.0
    legacy = parse_load([{"num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 50}])
    assert legacy == {"queued_requests": 1.0, "running_requests": 2.0, "kv_tokens_used": 50.0}
