"""SGLangBackend against the fake SGLang server over real HTTP on loopback."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import pytest

from ominix_runtime.backends.sglang import SGLangBackend
from ominix_runtime.bind_probe import free_port
from ominix_runtime.contract import (
    BackendKind,
    Done,
    Error,
    FinishReason,
    GenerateRequest,
    Granularity,
    OminixError,
    PrefillDone,
    RuntimeErrorKind,
    SamplingParams,
    Token,
    Usage,
    WorkerEvent,
    is_terminal,
)
from ominix_runtime.engine.negotiation import check_group
from ominix_runtime.testing.fake_sglang import (
    FakeSGLangServer,
    FakeSGLangState,
    fake_logprob,
    token_stream,
    token_text,
)

T = TypeVar("T")
TEST_TIMEOUT_S = 20.0
VOCAB = 32000


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, TEST_TIMEOUT_S)

    return asyncio.run(bounded())


def with_server(body: Callable[[FakeSGLangServer, SGLangBackend], Awaitable[T]], **state: Any) -> T:
    async def main() -> T:
        async with FakeSGLangServer(FakeSGLangState(**state)) as server:
            backend = SGLangBackend(server.url, timeout=5.0)
            try:
                return await body(server, backend)
            finally:
                await backend.close()

    return run(main())


async def collect(backend: SGLangBackend, request: GenerateRequest) -> list[WorkerEvent]:
    return [event async for event in backend.generate(request)]


def expected_tokens(input_ids: list[int], seed: int | None, n: int) -> list[int]:
    return list(itertools.islice(token_stream(input_ids, seed, VOCAB), n))


def assert_well_formed(events: list[WorkerEvent]) -> None:
    """PrefillDone first (when any output came), exactly one terminal event, and it is the last one."""
    assert sum(is_terminal(e) for e in events) == 1, events
    assert is_terminal(events[-1])
    if any(isinstance(e, Token) for e in events):
        assert isinstance(events[0], PrefillDone)
        assert sum(isinstance(e, PrefillDone) for e in events) == 1


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_stream_maps_to_ordered_events(incremental: bool) -> None:
    prompt = [11, 12, 13, 14]

    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        request = GenerateRequest("req-1", prompt, SamplingParams(max_tokens=6, seed=7, temperature=0.5))
        events = await collect(backend, request)
        assert_well_formed(events)
        assert isinstance(events[0], PrefillDone) and events[0].prompt_tokens == 4
        tokens = [e for e in events if isinstance(e, Token)]
        assert len(tokens) == 6 and all(len(t.token_ids) == 1 for t in tokens)
        ids = [i for t in tokens for i in t.token_ids]
        assert ids == expected_tokens(prompt, 7, 6)
        assert "".join(t.text for t in tokens) == "".join(token_text(i) for i in ids)
        usage, done = events[-2], events[-1]
        assert isinstance(usage, Usage) and (usage.prompt_tokens, usage.completion_tokens) == (4, 6)
        assert isinstance(done, Done) and done.finish_reason == FinishReason.LENGTH
        assert done.text == "".join(t.text for t in tokens)
        sent = server.state.generate_bodies[-1]
        assert sent["rid"] == "req-1" and sent["stream"] is True and sent["input_ids"] == prompt
        assert "text" not in sent

    with_server(body, incremental_output=incremental)


def test_sampling_params_use_sglang_names() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        sampling = SamplingParams(
            max_tokens=3,
            temperature=0.0,
            top_p=0.9,
            top_k=20,
            min_p=0.05,
            seed=123,
            stop=["zzz"],
            stop_token_ids=[7],
            ignore_eos=True,
            repetition_penalty=1.1,
            frequency_penalty=0.2,
            presence_penalty=0.3,
            min_tokens=1,
        )
        await collect(backend, GenerateRequest("req-2", [5, 6], sampling))
        params = server.state.generate_bodies[-1]["sampling_params"]
        assert params == {
            "max_new_tokens": 3,
            "min_new_tokens": 1,
            "temperature": 0.0,
            "top_p": 0.9,
            "top_k": 20,
            "min_p": 0.05,
            "ignore_eos": True,
            "repetition_penalty": 1.1,
            "frequency_penalty": 0.2,
            "presence_penalty": 0.3,
            "stop": ["zzz"],
            "stop_token_ids": [7],
            "sampling_seed": 123,
        }

    with_server(body)


def test_text_prompt_goes_as_text_and_ids_win_when_present() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        text_only = GenerateRequest("t-1", [], SamplingParams(max_tokens=2), prompt_text="hello there")
        events = await collect(backend, text_only)
        assert_well_formed(events)
        assert server.state.generate_bodies[-1]["text"] == "hello there"
        assert "input_ids" not in server.state.generate_bodies[-1]
        assert all(t.text for t in events if isinstance(t, Token))  # text filled, no local detokenizer needed
        both = GenerateRequest("t-2", [9, 10], SamplingParams(max_tokens=2), prompt_text="ignored")
        await collect(backend, both)
        assert server.state.generate_bodies[-1]["input_ids"] == [9, 10]
        assert "text" not in server.state.generate_bodies[-1]

    with_server(body)


def test_same_seed_same_tokens_and_prefix_cache_reported() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        prompt = list(range(3, 40))
        first = await collect(backend, GenerateRequest("s-1", prompt, SamplingParams(max_tokens=5, seed=1)))
        again = await collect(backend, GenerateRequest("s-2", prompt, SamplingParams(max_tokens=5, seed=1)))
        other = await collect(backend, GenerateRequest("s-3", prompt, SamplingParams(max_tokens=5, seed=2)))

        def ids(events: list[WorkerEvent]) -> list[int]:
            return [i for e in events if isinstance(e, Token) for i in e.token_ids]

        assert ids(first) == ids(again) != ids(other)
        prefill = again[0]
        assert isinstance(prefill, PrefillDone) and prefill.cached_tokens == len(prompt) - 1
        usage = again[-2]
        assert isinstance(usage, Usage) and usage.cached_tokens == len(prompt) - 1

    with_server(body)


def test_stop_token_and_stop_string_finish_with_stop() -> None:
    prompt = [21, 22, 23]
    third = expected_tokens(prompt, 5, 3)[2]

    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        by_id = await collect(
            backend,
            GenerateRequest("x-1", prompt, SamplingParams(max_tokens=10, seed=5, stop_token_ids=[third])),
        )
        done = by_id[-1]
        assert isinstance(done, Done) and done.finish_reason == FinishReason.STOP and done.matched_stop == ""
        assert [i for e in by_id if isinstance(e, Token) for i in e.token_ids][-1] == third
        stop = token_text(third).strip()
        by_text = await collect(
            backend, GenerateRequest("x-2", prompt, SamplingParams(max_tokens=10, seed=5, stop=[stop]))
        )
        done = by_text[-1]
        assert (
            isinstance(done, Done) and done.finish_reason == FinishReason.STOP and done.matched_stop == stop
        )
        assert stop not in done.text  # SGLang trims the matched stop string

    with_server(body)


def test_abort_mid_stream_ends_with_done_abort() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        request = GenerateRequest("ab-1", [3, 4, 5], SamplingParams(max_tokens=1000))
        events: list[WorkerEvent] = []
        async for event in backend.generate(request):
            events.append(event)
            if sum(isinstance(e, Token) for e in events) == 2 and not server.state.aborted_rids:
                load = await backend.load()
                assert load["running_requests"] == 1.0 and load["kv_tokens_used"] >= 3
                await backend.abort("ab-1")
        assert_well_formed(events)
        done = events[-1]
        assert isinstance(done, Done) and done.finish_reason == FinishReason.ABORT
        assert server.state.aborted_rids == ["ab-1"]
        assert sum(isinstance(e, Token) for e in events) < 1000

    with_server(body, mode="slow", token_delay=0.02)


def test_consumer_leaving_early_aborts_on_the_server() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        stream = backend.generate(GenerateRequest("gone-1", [3, 4], SamplingParams(max_tokens=1000)))
        async for event in stream:
            if isinstance(event, Token):
                break
        assert isinstance(stream, AsyncGenerator)  # generate() promises an iterator; it is a generator
        await stream.aclose()
        await backend.close()  # waits for the abort notice to reach the server
        assert "gone-1" in server.state.aborted_rids

    with_server(body, mode="slow", token_delay=0.02)


def test_failing_server_gives_one_internal_error_with_its_message() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        events = await collect(backend, GenerateRequest("f-1", [3], SamplingParams(max_tokens=4)))
        assert len(events) == 1 and isinstance(events[0], Error)
        assert events[0].kind == RuntimeErrorKind.INTERNAL
        assert "HTTP 500" in events[0].message and "failing on purpose" in events[0].message
        assert await backend.health() is False

    with_server(body, mode="failing")


def test_mid_stream_error_chunk_gives_one_error_after_tokens() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        events = await collect(backend, GenerateRequest("m-1", [3], SamplingParams(max_tokens=50)))
        assert_well_formed(events)
        assert any(isinstance(e, Token) for e in events)
        error = events[-1]
        assert isinstance(error, Error) and error.kind == RuntimeErrorKind.INTERNAL
        assert "middle of the stream" in error.message

    with_server(body, mode="midstream_error")


def test_dropped_connection_gives_backend_unavailable() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        events = await collect(backend, GenerateRequest("d-1", [3], SamplingParams(max_tokens=50)))
        assert_well_formed(events)
        error = events[-1]
        assert isinstance(error, Error) and error.kind == RuntimeErrorKind.BACKEND_UNAVAILABLE
        assert "mid-stream" in error.message

    with_server(body, mode="drop")


def test_flaky_mode_cycles_and_each_request_still_ends_once() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        outcomes = []
        for i in range(6):
            events = await collect(
                backend, GenerateRequest(f"fl-{i}", [3, i + 3], SamplingParams(max_tokens=5))
            )
            assert_well_formed(events)
            last = events[-1]
            assert is_terminal(last)
            outcomes.append("done" if isinstance(last, Done) else last.kind.name)
        assert outcomes == ["done", "INTERNAL", "BACKEND_UNAVAILABLE"] * 2

    with_server(body, mode="flaky")


def test_prompt_too_long_is_an_invalid_argument_error() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        events = await collect(backend, GenerateRequest("long-1", [3] * 64, SamplingParams(max_tokens=4)))
        assert len(events) == 1 and isinstance(events[0], Error)
        assert "context length" in events[0].message

    with_server(body, context_length=32)


def test_unreachable_server() -> None:
    async def main() -> None:
        backend = SGLangBackend(f"127.0.0.1:{free_port()}", timeout=2.0)
        try:
            events = await collect(backend, GenerateRequest("u-1", [3], SamplingParams(max_tokens=4)))
            assert len(events) == 1 and isinstance(events[0], Error)
            assert (
                events[0].kind == RuntimeErrorKind.BACKEND_UNAVAILABLE and "cannot reach" in events[0].message
            )
            assert await backend.health() is False
            with pytest.raises(OminixError) as info:
                await backend.describe()
            assert info.value.kind == RuntimeErrorKind.BACKEND_UNAVAILABLE
            with pytest.raises(OminixError):
                await backend.load()
        finally:
            await backend.close()

    run(main())


def test_describe_health_and_load() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        assert await backend.health() is True
        cap = await backend.describe()
        assert cap.kind == BackendKind.SGLANG and cap.granularity == Granularity.REQUEST
        assert cap.worker_id == f"sglang@{server.url}"
        assert cap.model.name == "fake/sglang-model" and cap.model.max_model_len == 4096
        assert cap.kv_block_size == 16 and cap.kv_num_blocks == 65536 // 16
        assert cap.max_running_requests == 128 and cap.max_batch_tokens == 8192
        assert cap.dtype == "bfloat16" and cap.version == "0.0.0-fake"
        check_group([cap], "fake/sglang-model", 2048, "bfloat16")
        assert cap.model.architecture == "LlamaForCausalLM"  # from the `architectures` list
        # KV bytes from the pool size /v1/loads states (65536 tokens x 4096 bytes).
        assert cap.kv_bytes_per_block == 16 * 4096 and cap.kv_bytes_capacity == 65536 * 4096
        load = await backend.load()
        assert load == {
            "queued_requests": 0.0,
            "running_requests": 0.0,
            "kv_tokens_used": 0.0,
            "kv_tokens_capacity": 65536.0,
            "kv_bytes_capacity": 65536.0 * 4096,
            "kv_bytes_used": 0.0,
        }
        assert await backend.flush_cache() is True and server.state.flush_count == 1

    with_server(body, page_size=16)


def test_fake_non_streaming_generate_matches_streaming() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        streamed = await collect(
            backend, GenerateRequest("n-1", [8, 9], SamplingParams(max_tokens=4, seed=3))
        )
        async with aiohttp.ClientSession() as session:
            payload = {"input_ids": [8, 9], "sampling_params": {"max_new_tokens": 4, "sampling_seed": 3}}
            async with session.post(server.url + "/generate", json=payload) as resp:
                assert resp.status == 200
                whole = await resp.json()
        assert whole["output_ids"] == [i for e in streamed if isinstance(e, Token) for i in e.token_ids]
        assert whole["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        last = streamed[-1]
        assert isinstance(last, Done) and whole["text"] == last.text

    with_server(body)


def test_fake_runs_as_a_process(tmp_path: Any) -> None:
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ominix_runtime.testing.fake_sglang",
            "--port",
            str(port),
            "--mode",
            "normal",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for _ in range(50):  # bounded: the banner comes first, then "ready" once the socket listens
            line = proc.stdout.readline()
            if not line or "ready" in line:
                break
        assert "ready" in line, line

        async def main() -> None:
            backend = SGLangBackend(f"http://127.0.0.1:{port}", timeout=5.0)
            try:
                assert await backend.health()
                events = await collect(backend, GenerateRequest("p-1", [3, 4], SamplingParams(max_tokens=3)))
                assert_well_formed(events)
                assert isinstance(events[-1], Done)
                async with (
                    aiohttp.ClientSession() as session,
                    session.get(f"http://127.0.0.1:{port}/_fake/stats") as resp,
                ):
                    stats = json.loads(await resp.text())
                assert stats["requests"] == 1
            finally:
                await backend.close()

        run(main())
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_logprobs_are_mapped_per_token(incremental: bool) -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        request = GenerateRequest("lp-1", [3, 4], SamplingParams(max_tokens=4, seed=9, logprobs=2))
        events = await collect(backend, request)
        sent = server.state.generate_bodies[-1]
        assert sent["return_logprob"] is True and sent["top_logprobs_num"] == 2
        tokens = [e for e in events if isinstance(e, Token)]
        assert [len(t.logprobs) for t in tokens] == [1, 1, 1, 1]
        for t in tokens:
            lp = t.logprobs[0]
            assert lp.sampled.token_id == t.token_ids[0]
            assert lp.sampled.logprob == pytest.approx(fake_logprob(t.token_ids[0]))
            assert [x.token_id for x in lp.top] == [t.token_ids[0], (t.token_ids[0] + 1) % VOCAB]
        plain = await collect(backend, GenerateRequest("lp-2", [3, 4], SamplingParams(max_tokens=2)))
        assert all(not e.logprobs for e in plain if isinstance(e, Token))
        assert "return_logprob" not in server.state.generate_bodies[-1]

    with_server(body, incremental_output=incremental)


def test_abort_ignored_by_the_server_still_ends_the_stream() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        backend.abort_grace = 0.2
        events: list[WorkerEvent] = []
        async for event in backend.generate(GenerateRequest("ig-1", [3], SamplingParams(max_tokens=1000))):
            events.append(event)
            if isinstance(event, Token) and not server.state.aborted_rids:
                await backend.abort("ig-1")
        assert_well_formed(events)
        assert isinstance(events[-1], Done) and events[-1].finish_reason == FinishReason.ABORT
        assert server.state.aborted_rids == ["ig-1"]

    with_server(body, mode="slow", token_delay=0.02, ignore_aborts=True)


def test_idle_stream_times_out_and_is_aborted_on_the_server() -> None:
    async def body(server: FakeSGLangServer, backend: SGLangBackend) -> None:
        backend.stream_idle_timeout = 0.3
        events = await collect(backend, GenerateRequest("idle-1", [3], SamplingParams(max_tokens=5)))
        assert len(events) == 1 and isinstance(events[0], Error)
        assert events[0].kind == RuntimeErrorKind.BACKEND_UNAVAILABLE and "sent nothing" in events[0].message
        await backend.close()  # flushes the abort notice
        assert server.state.aborted_rids == ["idle-1"]

    with_server(body, mode="slow", token_delay=5.0, ignore_aborts=True)


def test_one_backend_used_from_two_event_loops() -> None:
    async def main_with(server_url: str, backend: SGLangBackend) -> bool:
        return await backend.health()

    async def serve_and_check() -> None:
        async with FakeSGLangServer() as server:
            backend = SGLangBackend(server.url, timeout=5.0)
            assert await backend.health()
            # A second loop in a thread (what a sync caller running asyncio.run twice does).
            ok = await asyncio.to_thread(asyncio.run, main_with(server.url, backend))
            assert ok
            await backend.close()

    run(serve_and_check())
