"""``launch --devices cpu --v0-port``: OminiX-API's client drives a real CPU worker serving SmolLM2."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest
from e2e_procs import CLI, free_ports, start_proc, stop_procs, wait_health
from ominix_api_client import OminixApiClient
from v0_daemons import TOKEN, V0Daemon

from ominix_runtime.models import DEFAULT_MODEL_NAME, embedded_model_path
from ominix_runtime.text import Tokenizer


@pytest.fixture(scope="module")
def cpu_v0_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[V0Daemon]:
    logs = tmp_path_factory.mktemp("logs-v0-cpu")
    port, v0_port, worker_port = free_ports(3)
    launch = start_proc(
        "launch",
        [
            *CLI,
            "launch",
            "--devices",
            "cpu",
            "--port",
            str(port),
            "--metrics-port",
            "0",
            "--worker-base-port",
            str(worker_port),
            "--kv-cache-memory",
            "32MiB",
            "--v0-port",
            str(v0_port),
            "--v0-token",
            TOKEN,
        ],
        logs,
    )
    try:
        wait_health(f"127.0.0.1:{port}", [launch])
        yield V0Daemon(f"http://127.0.0.1:{v0_port}", f"127.0.0.1:{port}", [launch])
    finally:
        stop_procs([launch])


def test_greedy_chat_over_a_cpu_worker_matches_the_model(cpu_v0_daemon: V0Daemon) -> None:
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]

    async def body() -> tuple[str, str, dict[str, int], list[str]]:
        async with aiohttp.ClientSession() as session:
            api = OminixApiClient(session, cpu_v0_daemon.base_url, TOKEN, DEFAULT_MODEL_NAME)
            whole = await api.chat(messages, max_tokens=8, temperature=0.0)
            pieces = [
                c["choices"][0]["delta"].get("content", "")
                async for c in api.chat_stream(messages, max_tokens=8, temperature=0.0)
            ]
            return whole.content, whole.finish_reason, whole.usage, pieces

    content, finish, usage, pieces = asyncio.run(asyncio.wait_for(body(), 120))
    assert finish in ("stop", "length") and content
    assert "".join(pieces) == content  # greedy: the stream says what the non-stream reply said
    tokenizer = Tokenizer.from_gguf(embedded_model_path())
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert usage["prompt_tokens"] == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert 1 <= usage["completion_tokens"] <= 8
    assert "Paris" in content
