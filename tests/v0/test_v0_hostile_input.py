"""The v0 front against input meant to hurt it, on an engine daemon whose gRPC front has API keys (a fake
step worker; the embedded model's tokenizer): nesting past Python's recursion limit is a 400 with the
error shape, a body over the limit too, megabytes of token ids do not hold the event loop for seconds, and
POST /abort_request cannot abort a gRPC key holder's request."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "server"))  # the in-thread daemon harness
from server_harness import SMOLLM2_VOCAB, RunningDaemon, start_daemon, stop_daemon  # noqa: E402

from ominix_runtime.config import FrontConfig, V0FrontConfig  # noqa: E402
from ominix_runtime.pb import common_pb2, engine_pb2  # noqa: E402
from ominix_runtime.server.logging import configure_logging  # noqa: E402
from ominix_runtime.server.v0_http import MAX_BODY_BYTES  # noqa: E402
from ominix_runtime.testing.fake_backend import FakeConfig  # noqa: E402

V0_TOKEN = "v0-secret"
API_KEY = "grpc-key"
CHAT = {"kind": "chat", "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Daemon:
    running: RunningDaemon
    base: str
    headers: dict[str, str]


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    configure_logging("warning", json_output=True)
    running, thread = start_daemon(
        FakeConfig(vocab_size=SMOLLM2_VOCAB, eos_token_ids=(2,), max_model_len=2048, step_latency=0.01),
        front=FrontConfig(api_keys=(API_KEY,)),
        v0=V0FrontConfig(port=0, token=V0_TOKEN),
    )
    front = running.daemon.v0_front
    assert front is not None
    headers = {"Authorization": f"Bearer {V0_TOKEN}", "Content-Type": "application/json"}
    try:
        yield Daemon(running, f"http://127.0.0.1:{front.port}", headers)
    finally:
        stop_daemon(running, thread)


def _post_all(d: Daemon, posts: list[tuple[str, bytes]]) -> list[tuple[int, str, object]]:
    """Each (path, body) posted in turn: (status, content type, body as JSON where it is JSON)."""

    async def main() -> list[tuple[int, str, object]]:
        out = []
        async with aiohttp.ClientSession() as session:
            for path, body in posts:
                async with session.post(d.base + path, data=body, headers=d.headers) as r:
                    text = await r.text()
                    parsed = json.loads(text) if r.content_type == "application/json" else text
                    out.append((r.status, r.content_type, parsed))
        return out

    return asyncio.run(asyncio.wait_for(main(), 60))


def test_nesting_past_the_recursion_limit_is_a_400_with_the_error_shape(daemon: Daemon) -> None:
    deep_body = b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"

    def chat_with_kwargs(depth: int) -> bytes:
        # Built by hand: json.dumps itself stops at Python's recursion limit.
        kwargs = '{"a":' * depth + "{}" + "}" * depth
        return ('{"input": {"kind": "chat", "messages": [{"role": "user", "content": "hi"}], '
                f'"chat_template_kwargs": {kwargs}}}, "sampling": {{"max_new_tokens": 2}}}}').encode()  # fmt: skip

    posts = [("/generate", deep_body), ("/abort_request", deep_body), ("/flush_cache", deep_body)]
    posts += [("/generate", chat_with_kwargs(depth)) for depth in (250, 900)]
    answers = _post_all(daemon, posts)
    for status, content_type, body in answers:
        assert (status, content_type) == (400, "application/json"), (status, body)
        assert isinstance(body, dict) and "nested too deeply" in body["error"]["message"], body


def test_a_body_over_the_limit_is_a_413_with_the_error_shape(daemon: Daemon) -> None:
    big = json.dumps({"input": {"kind": "text", "prompt": "x" * (MAX_BODY_BYTES + 1)}}).encode()
    [(status, content_type, body)] = _post_all(daemon, [("/generate", big)])
    assert (status, content_type) == (413, "application/json"), (status, body)
    assert isinstance(body, dict) and body["error"]["message"], body


def test_megabytes_of_token_ids_leave_the_probes_answering(daemon: Daemon) -> None:
    """15 million token ids (30 MB of JSON, under the body limit): refused for the context length, while
    /server_info, probed every 50 ms meanwhile, answers within OminiX-API's 3 s probe timeout (it waited
    ~10 s for such a body when the ids were checked one Python call each on the event loop)."""
    tokens = {"input": {"kind": "tokens", "tokens": [7] * 15_000_000}, "sampling": {}}
    body = json.dumps(tokens, separators=(",", ":")).encode()
    assert len(body) < MAX_BODY_BYTES

    async def main() -> tuple[int, list[float]]:
        latencies: list[float] = []
        async with aiohttp.ClientSession() as session:

            async def big() -> int:
                async with session.post(daemon.base + "/generate", data=body, headers=daemon.headers) as r:
                    await r.read()
                    return r.status

            task = asyncio.create_task(big())
            while not task.done():
                start = time.perf_counter()
                async with session.get(daemon.base + "/server_info", headers=daemon.headers) as r:
                    assert r.status == 200
                    await r.read()
                latencies.append(time.perf_counter() - start)
                await asyncio.sleep(0.05)
            return await task, latencies

    status, latencies = asyncio.run(asyncio.wait_for(main(), 120))
    assert status == 400
    print(f"probes during the body: {len(latencies)}, slowest {max(latencies):.2f} s")
    assert max(latencies) < 3.0, f"slowest probe {max(latencies):.2f} s of {len(latencies)}"


def test_the_v0_front_cannot_abort_a_grpc_key_holders_request(daemon: Daemon) -> None:
    stub = daemon.running.stub
    auth = (("authorization", f"Bearer {API_KEY}"),)
    request = engine_pb2.GenerateRequest(
        request_id="keyed",
        input_ids=engine_pb2.TokenIds(ids=[5, 6]),
        sampling=common_pb2.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True),
    )
    stream = stub.Generate(request, metadata=auth, timeout=60)
    first = next(stream)
    assert first.request_id == "keyed"
    [(status, _, answer)] = _post_all(daemon, [("/abort_request", b'{"request_id": "keyed"}')])
    assert status == 200 and isinstance(answer, dict) and answer["found"] is False, answer
    assert stub.Abort(engine_pb2.AbortRequest(request_id="keyed"), metadata=auth, timeout=10).found
    events = [first, *stream]
    assert events[-1].done.finish_reason == common_pb2.FINISH_REASON_ABORT
    tokens = sum(len(e.token.token_ids) for e in events if e.HasField("token"))
    assert 0 < tokens < 200


def test_grpc_chat_template_kwargs_nested_past_the_limit_is_invalid_argument(daemon: Daemon) -> None:
    """The gRPC side of the same nesting: protobuf's own decoder stops such a Struct at 100 levels, so what
    reaches the engine is refused as a decode error or by the engine, never UNKNOWN."""
    kwargs = '{"a":' * 150 + "{}" + "}" * 150
    request = engine_pb2.GenerateRequest(request_id="deep", sampling=common_pb2.SamplingParams(max_tokens=2))
    request.messages.messages.add(role="user", content="hi")
    request.messages.chat_template_kwargs.update(json.loads(kwargs))
    auth = (("authorization", f"Bearer {API_KEY}"),)
    with pytest.raises(grpc.RpcError) as refused:
        list(daemon.running.stub.Generate(request, metadata=auth, timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()  # type: ignore[attr-defined]
