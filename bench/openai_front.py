"""The load generator's second transport: an OpenAI-compatible completions server (``vllm serve``) over HTTP
and server-sent events, so that one arrival schedule and one prompt set (``bench/serve.py``'s) drive both
systems. ``vllm bench serve`` draws its own schedule; with this, a gap between the two services at a rate is
the services', not the draws'.

A request is ``POST /v1/completions`` with the prompt as token ids, ``ignore_eos`` and streaming with usage; each
SSE chunk that carries text is one arrival (its time goes to ITL, as ``vllm bench serve`` counts them), and the
final usage chunk gives the token counts.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where a request is sent: the gRPC-only bench needs no aiohttp
    import aiohttp

SCHEME = "http://"


def is_openai(address: str) -> bool:
    """An ``http://host:port`` address names an OpenAI-compatible server; anything else is the engine's gRPC."""
    return address.startswith(SCHEME)


async def served_model(session: aiohttp.ClientSession, address: str) -> tuple[str, int]:
    """(model id, max_model_len) from ``GET /v1/models``: the first model listed."""
    async with session.get(f"{address}/v1/models") as response:
        response.raise_for_status()
        models = (await response.json())["data"]
    if not models:
        raise RuntimeError(f"{address} lists no models")
    return str(models[0]["id"]), int(models[0].get("max_model_len") or 0)


def vocabulary(config_path: str | Path) -> tuple[int, frozenset[int]]:
    """(vocab size, bos / eos ids) from the served model's ``config.json``: the server does not report them."""
    config = json.loads(Path(config_path).read_text())
    special = set()
    for key in ("bos_token_id", "eos_token_id"):
        value = config.get(key)
        if isinstance(value, int):
            special.add(value)
        elif isinstance(value, list):
            special.update(int(v) for v in value)
    return int(config["vocab_size"]), frozenset(special)


def completion_body(
    model: str, prompt_ids: list[int], max_tokens: int, temperature: float, ignore_eos: bool
) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_completion(
    session: aiohttp.ClientSession,
    address: str,
    body: dict[str, Any],
    result: Any,  # noqa: ANN401 - bench.serve.RequestResult (a cycle to import here)
    start: float,
    timeout_s: float,
) -> None:
    """Send one completion and fill ``result`` as ``bench.serve._send_one`` does for gRPC: times in seconds
    since ``start`` (perf_counter), a chunk per SSE event that carries text, counts from the usage chunk."""
    import aiohttp

    result.send_time = time.perf_counter() - start
    finish = ""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(f"{address}/v1/completions", json=body, timeout=timeout) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
            else:
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:") :].strip()
                    if payload == "[DONE]":
                        break
                    event = json.loads(payload)
                    now = time.perf_counter() - start
                    for choice in event.get("choices") or []:
                        if choice.get("text"):
                            if result.first_token_time is None:
                                result.first_token_time = now
                            result.chunk_times.append(now)
                            result.chunk_tokens.append(1)
                        finish = choice.get("finish_reason") or finish
                    usage = event.get("usage")
                    if usage:
                        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        result.output_tokens = int(usage.get("completion_tokens") or 0)
    # asyncio.TimeoutError: the total timeout (builtin TimeoutError only from Python 3.11).
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end_time = time.perf_counter() - start
    result.finish_reason = finish
    if not result.error:
        result.success = finish in ("length", "stop") and result.first_token_time is not None
        if not result.success:
            result.error = f"finished ({finish or 'no finish reason'}) without the expected tokens"
    if result.output_tokens == 0:
        result.output_tokens = sum(result.chunk_tokens)
