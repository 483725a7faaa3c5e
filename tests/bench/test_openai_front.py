"""bench/online.py driving an OpenAI-compatible completions server (bench/openai_front.py) with the schedule and
token-id prompts it gives our service: a fake `vllm serve` (aiohttp, SSE) in a thread records what arrives."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import online  # noqa: E402
from bench.serve import BenchConfig, ModelFacts, RequestSpec, build_random_requests, run_benchmark  # noqa: E402

REFUSED_FIRST_ID = 7  # a prompt starting with this id gets HTTP 400
STALLED_FIRST_ID = 6  # ... and with this one, a stream that stalls after its first token


class FakeCompletions:
    """/v1/models and streaming /v1/completions: one SSE chunk per token of text, then usage, then [DONE]."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "max_model_len": 2048}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if body["prompt"][0] == REFUSED_FIRST_ID:
            return web.json_response({"error": {"message": "prompt refused"}}, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        n = body["max_tokens"]
        for i in range(n):
            await asyncio.sleep(2 if i == 1 and body["prompt"][0] == STALLED_FIRST_ID else 0.002)
            choice = {"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response


@pytest.fixture
def fake_server() -> Iterator[tuple[str, FakeCompletions]]:
    fake = FakeCompletions()
    app = web.Application()
    app.router.add_get("/v1/models", fake.models)
    app.router.add_post("/v1/completions", fake.completions)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(10)
    yield f"http://127.0.0.1:{port}", fake
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_online_run_sends_the_same_prompts_to_an_openai_server(
    fake_server: tuple[str, FakeCompletions], tmp_path: Path
) -> None:
    address, fake = fake_server
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"vocab_size": 500, "bos_token_id": 1, "eos_token_id": [2, 3]}))
    out = tmp_path / "results.json"
    argv = [
        "run",
        "--address",
        address,
        "--model-config",
        str(config),
        "--rates",
        "40,inf",
        "--seconds",
        "0.1",
    ]
    argv += ["--inf-prompts", "5", "--min-prompts", "4", "--input-len", "9", "--output-len", "6"]
    argv += ["--warmup-requests", "2", "--warmup-output-len", "2", "--out-json", str(out), "--no-progress"]
    assert online.main(argv) == 0
    results = json.loads(out.read_text())
    assert [r["request_rate"] for r in results] == [40.0, "inf"]
    for result in results:
        assert result["backend"] == "openai" and result["failed"] == 0
        assert result["total_output_tokens"] == 6 * result["completed"]
        assert result["total_input_tokens"] == 9 * result["completed"]
    assert [r["completed"] for r in results] == [4, 5]
    sent = fake.bodies[2:]  # after the warm-up's two
    assert len(sent) == 9
    for body in sent:
        assert body["model"] == "fake-model" and body["ignore_eos"] is True and body["stream"] is True
        assert len(body["prompt"]) == 9 and not {1, 2, 3} & set(body["prompt"])  # no bos / eos drawn
    # The prompts are the ones the gRPC run draws for the same seed: rate i uses seed + i.
    facts = ModelFacts("fake-model", 500, frozenset({1, 2, 3}), 2048)
    want = build_random_requests(BenchConfig(num_requests=4, input_len=9, output_len=6, seed=0), facts)
    assert sorted(body["prompt"] for body in sent[:4]) == sorted(spec.prompt_ids for spec in want)


def test_a_refused_request_fails_with_the_servers_message(fake_server: tuple[str, FakeCompletions]) -> None:
    address, _ = fake_server
    requests = [
        RequestSpec(max_tokens=3, prompt_ids=[REFUSED_FIRST_ID, 9]),
        RequestSpec(3, prompt_ids=[8, 9]),
    ]
    result = asyncio.run(run_benchmark(address, BenchConfig(num_requests=2, progress=False), requests))
    assert result.metrics.completed == 1 and result.metrics.failed == 1
    refused = result.requests[0]
    assert not refused.success and refused.error.startswith("HTTP 400") and "prompt refused" in refused.error
    ok = result.requests[1]
    assert ok.success and ok.output_tokens == 3 and len(ok.itls_s) == 2 and ok.ttft_s is not None


def test_a_stalled_stream_fails_at_its_timeout_and_the_run_goes_on(
    fake_server: tuple[str, FakeCompletions],
) -> None:
    address, _ = fake_server
    requests = [
        RequestSpec(max_tokens=3, prompt_ids=[STALLED_FIRST_ID, 9]),
        RequestSpec(3, prompt_ids=[8, 9]),
    ]
    config = BenchConfig(num_requests=2, progress=False, request_timeout_s=0.5)
    result = asyncio.run(run_benchmark(address, config, requests))
    stalled, ok = result.requests
    assert not stalled.success and "TimeoutError" in stalled.error and stalled.first_token_time is not None
    assert ok.success and result.metrics.completed == 1
