"""The engine over SGLang when SGLang's figures are odd or incomplete: a negative load figure, a prompt that
went as text (SGLang alone counts its tokens), a chunk whose logprob cannot be read."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from aiohttp import web

from ominix_runtime import wire
from ominix_runtime.backends.sglang import SGLangBackend, parse_load
from ominix_runtime.contract import (
    Done,
    GenerateRequest,
    PrefillDone,
    SamplingParams,
    Token,
    Usage,
    WorkerEvent,
)
from ominix_runtime.engine import EngineCore, RunReport
from ominix_runtime.testing import fake_sglang
from ominix_runtime.testing.fake_sglang import FakeSGLangServer, FakeSGLangState

T = TypeVar("T")


def with_engine(body: Callable[[EngineCore], Awaitable[T]]) -> T:
    async def main() -> T:
        async with FakeSGLangServer(FakeSGLangState()) as server:
            core = EngineCore([SGLangBackend(server.url, timeout=5.0)])
            await core.start()  # polls the load report once
            try:
                return await body(core)
            finally:
                await core.stop()

    return asyncio.run(asyncio.wait_for(main(), 20.0))


def _loads_with(**overrides: Any) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A ``/v1/loads`` handler answering one idle DP rank with ``overrides`` applied."""

    async def handle_loads(request: web.Request) -> web.Response:
        load: dict[str, Any] = {
            "dp_rank": 0,
            "num_running_reqs": 0,
            "num_waiting_reqs": 0,
            "num_used_tokens": 0,
            "max_total_num_tokens": 65536,
            "gen_throughput": 0.0,
            "memory": {"kv_cache_gb": 0.25, "token_capacity": 65536},
        }
        load.update(overrides)
        return web.json_response({"loads": [load]})

    return handle_loads


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_waiting_reqs": -1},  # a transiently negative counter
        {"num_used_tokens": -128},  # used = capacity - free - evictable, below zero for a moment
    ],
    ids=["negative_waiting", "negative_used_tokens"],
)
def test_get_load_survives_a_negative_sglang_load_figure(
    monkeypatch: pytest.MonkeyPatch, overrides: dict[str, int]
) -> None:
    """The negative figure reads as 0: the group's load has no negative count and converts to GetLoad's
    message (unsigned fields) without raising."""
    monkeypatch.setattr(fake_sglang, "handle_loads", _loads_with(**overrides))

    async def body(core: EngineCore) -> None:
        (load,) = core.load()
        assert (load.queued_requests, load.running_requests, load.kv_bytes_used) == (0, 0, 0)
        pb = wire.backend_load_to_pb(load)
        assert pb.kv_bytes_capacity == 1 << 28

    with_engine(body)


def test_parse_load_reads_negative_and_non_finite_figures_as_zero() -> None:
    """Below zero, NaN, infinities, integers past any float and booleans are no load figures."""
    out = parse_load(
        {
            "loads": [
                {
                    "num_running_reqs": 2,
                    "num_waiting_reqs": -3,
                    "num_used_tokens": math.nan,
                    "max_total_num_tokens": 1000,
                    "gen_throughput": -math.inf,
                    "memory": {"kv_cache_gb": 10**400, "token_capacity": 1000},
                },
                {"num_running_reqs": True, "num_waiting_reqs": math.inf, "num_used_tokens": -7},
            ]
        }
    )
    assert out == {
        "queued_requests": 0.0,
        "running_requests": 2.0,
        "kv_tokens_used": 0.0,
        "kv_tokens_capacity": 1000.0,
    }


def test_usage_of_a_text_prompt_is_the_count_sglang_reports() -> None:
    """A prompt forwarded as text has no token ids here: the final Usage, the group's prompt token counter
    and the run report take SGLang's count (4 words, one token each in the fake)."""
    reports: list[RunReport] = []

    async def body(core: EngineCore) -> tuple[list[WorkerEvent], int]:
        core.add_listener(reports.append)
        request = GenerateRequest("txt", [], SamplingParams(max_tokens=3), prompt_text="one two three four")
        events = [e async for e in core.submit(request)]
        return events, core.groups[0].counters.prompt_tokens

    events, counted = with_engine(body)
    assert isinstance(events[-1], Done)
    prefill = next(e for e in events if isinstance(e, PrefillDone))
    usage = next(e for e in events if isinstance(e, Usage))
    assert prefill.prompt_tokens == 4
    assert (usage.prompt_tokens, usage.completion_tokens) == (4, 3)
    assert counted == 4
    assert [r.prompt_tokens for r in reports] == [4]


LOGPROB_IDS = [10, 11, 12]
LOGPROBS = [-0.1, None, -0.3]  # the middle one: -inf on the server, null once orjson wrote it


async def _generate_with_an_unreadable_logprob(request: web.Request) -> web.StreamResponse:
    """``/generate`` streaming LOGPROB_IDS cumulatively, the second token's logprob written as null."""
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for n in range(1, len(LOGPROB_IDS) + 1):
        chunk = {
            "text": "".join(f" w{t}" for t in LOGPROB_IDS[:n]),
            "output_ids": LOGPROB_IDS[:n],
            "meta_info": {
                "id": body["rid"],
                "prompt_tokens": 2,
                "completion_tokens": n,
                "cached_tokens": 0,
                "output_token_logprobs": [
                    [lp, t, None] for lp, t in zip(LOGPROBS[:n], LOGPROB_IDS[:n], strict=True)
                ],
                "output_top_logprobs": [None] * n,
                "finish_reason": {"type": "length", "length": n} if n == len(LOGPROB_IDS) else None,
            },
        }
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await asyncio.sleep(0.01)
    await resp.write(b"data: [DONE]\n\n")
    return resp


def test_merged_tokens_keep_their_logprobs_aligned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that fell behind gets queued tokens merged; the chunk without readable logprobs must not shift
    the others' logprobs onto the wrong tokens: each Token event has none or one per id, naming that id."""
    monkeypatch.setattr(fake_sglang, "handle_generate", _generate_with_an_unreadable_logprob)

    async def body(core: EngineCore) -> list[WorkerEvent]:
        handle = core.submit(GenerateRequest("lp", [3, 4], SamplingParams(max_tokens=3, logprobs=0)))
        await asyncio.sleep(0.5)  # the reader is busy: the three chunks' tokens wait in its inbox
        return [e async for e in handle]

    events = with_engine(body)
    assert isinstance(events[-1], Done)
    tokens = [e for e in events if isinstance(e, Token)]
    assert [t for e in tokens for t in e.token_ids] == LOGPROB_IDS
    for event in tokens:
        assert not event.logprobs or [lp.sampled.token_id for lp in event.logprobs] == event.token_ids, event
    logprobs = {lp.sampled.token_id: lp.sampled.logprob for e in tokens for lp in e.logprobs}
    assert logprobs == {10: pytest.approx(-0.1), 12: pytest.approx(-0.3)}
