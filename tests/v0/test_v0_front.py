"""OminiX-API's v0 client against a real engine daemon (``serve --sglang`` over a fake SGLang process)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import grpc
import pytest
from ominix_api_client import OminixApiClient, RemoteFinish, SseDecoder, WorkerRejected, validate_event
from v0_daemons import FAKE_KV_TOKENS, SERVED_ALIAS, TOKEN, V0Daemon

from ominix_runtime.models import DEFAULT_MODEL_NAME
from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc

T = TypeVar("T")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "say pong"}]


def run(body: Callable[[aiohttp.ClientSession], Awaitable[T]], timeout: float = 90.0) -> T:
    async def main() -> T:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            return await asyncio.wait_for(body(session), timeout)

    return asyncio.run(main())


def client(session: aiohttp.ClientSession, daemon: V0Daemon, token: str = TOKEN) -> OminixApiClient:
    return OminixApiClient(session, daemon.base_url, token, SERVED_ALIAS, {"enable_thinking": False})


def test_streamed_chat(sglang_v0_daemon: V0Daemon) -> None:
    async def body(session: aiohttp.ClientSession) -> list[dict[str, Any]]:
        return [c async for c in client(session, sglang_v0_daemon).chat_stream(MESSAGES, max_tokens=6)]

    chunks = run(body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    content = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert len(content) >= 2 and all(content)
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 6 and final["usage"]["prompt_tokens"] > 5
    assert final["usage"]["total_tokens"] == final["usage"]["prompt_tokens"] + 6


def test_non_stream_chat_is_sse_with_the_kind_order_of_the_shim(sglang_v0_daemon: V0Daemon) -> None:
    result = run(lambda s: client(s, sglang_v0_daemon).chat(MESSAGES, max_tokens=5, temperature=0.7))
    kinds = [e["kind"] for e in result.events]
    assert kinds[0] == "prefill_done" and kinds[-2:] == ["usage", "done"]
    assert set(kinds[1:-2]) == {"token"} and sum(len(e.get("token_ids", [])) for e in result.events) == 5
    assert result.finish_reason == "length" and result.content
    assert result.content == "".join(e.get("text_delta", "") for e in result.events)
    assert result.usage["completion_tokens"] == 5
    stamps = [e["created_at_ms"] for e in result.events]
    assert stamps == sorted(stamps) and abs(stamps[-1] - time.time() * 1000) < 60_000


def test_abort_mid_stream_ends_the_stream_promptly(sglang_v0_daemon: V0Daemon) -> None:
    async def body(session: aiohttp.ClientSession) -> tuple[list[str], float, dict[str, Any]]:
        api = client(session, sglang_v0_daemon)
        req = api.worker_request(MESSAGES, 2000, None, None, stream=True)
        resp = await api.open_generate(req)
        decoder = SseDecoder()
        events: list[dict[str, Any]] = []
        frames: list[str] = []
        aborted_at = 0.0
        async for piece in resp.content.iter_any():
            for data in decoder.feed(piece):
                frames.append(data)
                if data != "[DONE]":
                    events.append(validate_event(data, req["request_id"]))
                if sum(e["kind"] == "token" for e in events) == 3 and not aborted_at:
                    aborted_at = time.monotonic()
                    async with session.post(
                        api.base + "/abort_request", json={"rid": req["request_id"]}, headers=api.headers
                    ) as r:
                        answer = await r.json()
        resp.release()
        decoder.finish()
        return frames, time.monotonic() - aborted_at, answer

    frames, seconds, answer = run(body)
    assert answer == {"ok": True, "aborted": answer["aborted"], "found": True}
    assert frames[-1] == "[DONE]"
    last = json.loads(frames[-2])
    assert last["kind"] == "done" and last["finish_reason"] == "abort"
    assert sum(json.loads(f)["kind"] in ("done", "error") for f in frames[:-1]) == 1
    assert seconds < 2.0  # one token interval, not the 2000 tokens asked for


def test_abort_of_unknown_or_finished_ids_is_harmless(sglang_v0_daemon: V0Daemon) -> None:
    async def body(session: aiohttp.ClientSession) -> list[tuple[int, Any]]:
        api = client(session, sglang_v0_daemon)
        out = []
        for payload in ({"request_id": "ominix-never-seen"}, {"rid": "ominix-never-seen"}, {"nope": 1}):
            async with session.post(api.base + "/abort_request", json=payload, headers=api.headers) as r:
                out.append((r.status, await r.json()))
        return out

    (s1, a1), (s2, a2), (s3, a3) = run(body)
    assert s1 == s2 == 200 and a1["found"] is False and a2["found"] is False
    assert s3 == 400 and "request_id" in a3["error"]["message"]


def test_every_route_wants_the_bearer_token(sglang_v0_daemon: V0Daemon) -> None:
    async def body(session: aiohttp.ClientSession) -> list[tuple[int, Any]]:
        out = []
        for method, path in (
            ("GET", "/server_info"),
            ("GET", "/get_model_info"),
            ("POST", "/generate"),
            ("POST", "/abort_request"),
            ("GET", "/health_generate"),
            ("GET", "/get_loads"),
            ("POST", "/flush_cache"),
            ("GET", "/no/such/route"),
        ):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                async with session.request(method, sglang_v0_daemon.base_url + path, headers=headers) as r:
                    out.append((r.status, await r.json()))
        return out

    for status, answer in run(body):
        assert status == 401 and answer == {"error": {"message": "missing or invalid scheduler bearer token"}}


def test_bad_json_and_wrong_envelope_are_400_with_a_json_error(sglang_v0_daemon: V0Daemon) -> None:
    async def body(session: aiohttp.ClientSession) -> list[tuple[int, Any]]:
        api = client(session, sglang_v0_daemon)
        good = api.worker_request(MESSAGES, 4, None, None, stream=True)
        bodies: list[bytes] = [
            b"{not json",
            b"",
            b"[1, 2]",
            json.dumps({**good, "protocol_version": "ominix.worker.v1"}).encode(),
            json.dumps({**good, "message_type": "TokenizedGenerate"}).encode(),
            json.dumps({**good, "input": {"kind": "image"}}).encode(),
            json.dumps({**good, "model": "some-other-model"}).encode(),
            json.dumps({**good, "sampling": {"max_new_tokens": 4, "temperature": -1.0}}).encode(),
            json.dumps({**good, "sampling": {"max_new_tokens": 0}}).encode(),
            json.dumps({**good, "sampling": {"max_new_tokens": float("nan")}}).encode(),  # NaN
            json.dumps({**good, "trace_id": "\ud800"}).encode(),  # escaped as \\ud800, a lone surrogate
            json.dumps({**good, "input": {**good["input"], "chat_template_kwargs": {"x": 10**400}}}).encode(),
        ]
        out = []
        for raw in bodies:
            headers = {**api.headers, "Content-Type": "application/json"}
            async with session.post(api.base + "/generate", data=raw, headers=headers) as r:
                out.append((r.status, await r.json()))
        return out

    answers = run(body)
    messages = [a["error"]["message"] for _, a in answers]
    assert [s for s, _ in answers] == [400] * len(answers), answers
    assert "not valid JSON" in messages[0] and "empty" in messages[1] and "JSON object" in messages[2]
    assert "protocol_version" in messages[3] and "message_type" in messages[4] and "input.kind" in messages[5]
    assert "some-other-model" in messages[6] and answers[6][1]["error"]["code"] == "capability_mismatch"
    assert "temperature" in messages[7] and "max_new_tokens" in messages[8]
    assert "NaN" in messages[9] and "lone surrogate" in messages[10] and "out of range" in messages[11]


def test_refusals_before_streaming_map_to_the_statuses_ominix_api_reads(sglang_v0_daemon: V0Daemon) -> None:
    async def body(session: aiohttp.ClientSession) -> int:
        api = client(session, sglang_v0_daemon)
        try:
            await api.open_generate(
                api.worker_request(MESSAGES, FAKE_KV_TOKENS * 2, None, None, stream=False)
            )
        except WorkerRejected as exc:
            return exc.status
        raise AssertionError("a request larger than the KV cache was accepted")

    assert run(body) == 400  # KV capacity exceeded: "the model does not support this request"


def test_control_routes(sglang_v0_daemon: V0Daemon) -> None:
    async def body(session: aiohttp.ClientSession) -> dict[str, Any]:
        api = client(session, sglang_v0_daemon)
        out = {}
        for name, method, path in (
            ("health", "GET", "/health_generate"),
            ("loads", "GET", "/get_loads"),
            ("flush", "POST", "/flush_cache"),
            ("model", "GET", "/get_model_info"),
        ):
            async with session.request(method, api.base + path, headers=api.headers, json={}) as r:
                assert r.status == 200, (path, r.status)
                out[name] = await r.json()
        async with session.get(sglang_v0_daemon.sglang_url + "/_fake/stats") as r:
            out["fake"] = await r.json()
        return out

    out = run(body)
    assert out["health"]["status"] == "ok"
    (worker,) = out["loads"]["workers"]
    assert worker["backend"] == "Sglang" and worker["health"] == "available"
    assert worker["kv_bytes_capacity"] == FAKE_KV_TOKENS * 4096
    assert out["flush"]["ok"] is True and out["flush"]["flushed"] is True and out["fake"]["flushes"] >= 1
    model = out["model"]
    assert model["served_model_name"] == SERVED_ALIAS and model["model_path"] == DEFAULT_MODEL_NAME
    assert model["is_generation"] is True and model["architectures"] == ["LlamaForCausalLM"]


def test_readiness_probes_stay_fast_while_64_streams_run(sglang_v0_daemon: V0Daemon) -> None:
    async def body(session: aiohttp.ClientSession) -> tuple[list[float], int]:
        api = client(session, sglang_v0_daemon)
        requests = [api.worker_request(MESSAGES, 400, None, None, stream=True) for _ in range(64)]
        responses = await asyncio.gather(*(api.open_generate(r) for r in requests))
        tokens_seen = [0] * 64

        async def drain(i: int, resp: aiohttp.ClientResponse) -> None:
            decoder = SseDecoder()
            async for piece in resp.content.iter_any():
                for data in decoder.feed(piece):
                    if (
                        data != "[DONE]"
                        and validate_event(data, requests[i]["request_id"])["kind"] == "token"
                    ):
                        tokens_seen[i] += 1

        readers = [asyncio.create_task(drain(i, r)) for i, r in enumerate(responses)]
        while min(tokens_seen) < 2:  # every stream is generating
            await asyncio.sleep(0.05)
        latencies = []
        for _ in range(40):
            for path in ("/server_info", "/get_model_info"):
                start = time.perf_counter()
                async with session.get(api.base + path, headers=api.headers) as r:
                    assert r.status == 200
                    await r.read()
                latencies.append(time.perf_counter() - start)
            await api.ready()
            await asyncio.sleep(0.01)
        running_during = sum(1 for r in readers if not r.done())
        for r in requests:
            await api.abort(r["request_id"])
        await asyncio.gather(*readers)
        for resp in responses:
            resp.release()
        return latencies, running_during

    latencies, running = run(body, timeout=120)
    assert running == 64
    latencies.sort()
    p90 = latencies[int(0.9 * len(latencies))]
    median = statistics.median(latencies)
    print(
        f"v0 probes under 64 streams: median {median * 1000:.1f} ms, p90 {p90 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms"
    )
    assert p90 < 0.100, f"p90 {p90 * 1000:.1f} ms, median {statistics.median(latencies) * 1000:.1f} ms"
    assert latencies[-1] < 3.0  # OminiX-API's probe timeout


def test_grpc_get_load_with_an_sglang_backend(sglang_v0_daemon: V0Daemon) -> None:
    with grpc.insecure_channel(sglang_v0_daemon.grpc_address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
        (backend,) = load.backends
        assert backend.health == engine_pb2.BACKEND_HEALTH_AVAILABLE and backend.healthy
        assert abs(backend.timestamp_ms - time.time() * 1000) < 10_000
        assert list(backend.model_ids) == [DEFAULT_MODEL_NAME] and list(backend.served_aliases) == [
            SERVED_ALIAS
        ]
        assert backend.backend_kind == "Sglang"
        assert {"sglang", "cuda", "tp1", "prefill", "decode", "prefix_cache"} <= set(backend.capabilities)
        # SGLang's own pool (200,000 tokens x 4096 bytes), not 0 (which a router reads as full).
        assert backend.kv_bytes_capacity == FAKE_KV_TOKENS * 4096
        assert load.total.kv_bytes_capacity == backend.kv_bytes_capacity
        assert load.total.health == engine_pb2.BACKEND_HEALTH_AVAILABLE

        # KV in use shows up while a request runs (the load is polled every second).
        stream = stub.Generate(
            engine_pb2.GenerateRequest(
                request_id="grpc-load-1",
                prompt="w5 w6 w7 w8",
                sampling=common_pb2.SamplingParams(max_tokens=500),
            ),
            timeout=60,
        )
        next(stream)
        deadline = time.monotonic() + 5
        used = 0
        while time.monotonic() < deadline and not used:
            used = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10).backends[0].kv_bytes_used
            time.sleep(0.2)
        assert used >= 4 * 4096
        stub.Abort(engine_pb2.AbortRequest(request_id="grpc-load-1"), timeout=10)
        events = list(stream)
        assert events[-1].done.finish_reason == common_pb2.FINISH_REASON_ABORT


def test_drain_undrain_and_error_kinds_in_trailing_metadata(sglang_v0_daemon: V0Daemon) -> None:
    with grpc.insecure_channel(sglang_v0_daemon.grpc_address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        too_big = engine_pb2.GenerateRequest(
            prompt="w5 w6", sampling=common_pb2.SamplingParams(max_tokens=FAKE_KV_TOKENS + 100)
        )
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(too_big, timeout=10))
        meta = dict(info.value.trailing_metadata() or ())
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert meta == {"ominix-error-kind": "KV_CAPACITY_EXCEEDED", "ominix-retryable": "false"}

        drained = stub.Drain(engine_pb2.DrainRequest(), timeout=10)
        assert [b.health for b in drained.backends] == [engine_pb2.BACKEND_HEALTH_DRAINING]
        ok = engine_pb2.GenerateRequest(prompt="w5 w6", sampling=common_pb2.SamplingParams(max_tokens=2))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(ok, timeout=10))
        meta = dict(info.value.trailing_metadata() or ())
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert meta == {"ominix-error-kind": "BACKEND_UNAVAILABLE", "ominix-retryable": "true"}
        undrained = stub.Undrain(engine_pb2.DrainRequest(), timeout=10)
        assert [b.health for b in undrained.backends] == [engine_pb2.BACKEND_HEALTH_AVAILABLE]
        events = list(stub.Generate(ok, timeout=30))
        assert events[-1].done.finish_reason == common_pb2.FINISH_REASON_LENGTH
        with pytest.raises(grpc.RpcError) as info:
            stub.Drain(engine_pb2.DrainRequest(worker_id="no-such-worker"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_remote_abort_is_a_failure_for_ominix_api(sglang_v0_daemon: V0Daemon) -> None:
    """A stream OminiX-API keeps reading after another party aborted it ends with done+abort, which it
    reports as an upstream failure (RemoteFinish), never as a hang."""

    async def body(session: aiohttp.ClientSession) -> str:
        api = client(session, sglang_v0_daemon)
        rid = "ominix-remote-abort-1"
        chunks = 0
        try:
            async for _chunk in api.chat_stream(MESSAGES, max_tokens=2000, request_id=rid):
                chunks += 1
                if chunks == 3:
                    async with session.post(
                        api.base + "/abort_request", json={"request_id": rid}, headers=api.headers
                    ) as r:
                        await r.read()
        except RemoteFinish as exc:
            return exc.reason
        raise AssertionError("the aborted stream did not end with done+abort")

    assert run(body) == "abort"


def test_client_disconnect_aborts_the_request_on_the_backend(sglang_v0_daemon: V0Daemon) -> None:
    async def body(session: aiohttp.ClientSession) -> list[str]:
        api = client(session, sglang_v0_daemon)
        req = api.worker_request(MESSAGES, 2000, None, None, stream=True)
        resp = await api.open_generate(req)
        decoder = SseDecoder()
        tokens = 0
        async for piece in resp.content.iter_any():
            tokens += sum('"kind":"token"' in d for d in decoder.feed(piece))
            if tokens >= 2:
                break
        resp.close()  # the client goes away mid-stream, sending no abort of its own
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            async with session.get(sglang_v0_daemon.sglang_url + "/_fake/stats") as r:
                stats = await r.json()
            if req["request_id"] in stats["aborted_rids"] + stats["disconnected_rids"]:
                return [req["request_id"]]
            await asyncio.sleep(0.1)
        raise AssertionError(f"SGLang still runs {req['request_id']}: {stats}")

    assert run(body)
