"""Logprobs on the ``ominix.worker.v0`` front: asked for with ``sampling.logprobs`` (+ ``top_logprobs``), they
reach the client on the token records in the protocol's shape (``logprobs{token_logprob,
top_logprobs[{logprob, token_id}]}``, one token per record), instead of being computed and dropped."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import pytest

from ominix_runtime.backends.sglang import SGLangBackend
from ominix_runtime.bind_probe import free_ports
from ominix_runtime.config import LogConfig, RuntimeConfig, ServerConfig, V0FrontConfig
from ominix_runtime.models import DEFAULT_MODEL_NAME
from ominix_runtime.pb import common_pb2, engine_pb2
from ominix_runtime.server.app import EngineDaemon
from ominix_runtime.server.v0_http import _records
from ominix_runtime.server.v0_protocol import (
    V0EventWriter,
    V0ProtocolError,
    parse_generate_request,
    sse_frame,
    token_logprobs,
)
from ominix_runtime.testing.fake_sglang import FakeSGLangServer, FakeSGLangState, fake_logprob

T = TypeVar("T")
TOKEN = "v0-logprobs-token"
SMOLLM2_VOCAB = 49152


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def strict_json(data: bytes) -> Any:
    """What a strict client (OminiX-API's serde) reads: no NaN or Infinity."""

    def refuse(name: str) -> float:
        raise ValueError(f"{name} is not JSON")

    return json.loads(data, parse_constant=refuse)


# ---- request ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sampling", "count"),
    [
        ({}, None),
        ({"logprobs": False}, None),
        ({"logprobs": True}, 0),
        ({"logprobs": True, "top_logprobs": 3}, 3),
        ({"logprobs": 2}, 2),
        ({"logprobs": 0}, 0),
    ],
)
def test_the_engine_gets_the_logprobs_count_the_request_asked_for(
    sampling: dict[str, Any], count: int | None
) -> None:
    req = parse_generate_request(body(prompt="a", sampling=sampling))
    assert req.sampling.logprobs == count


@pytest.mark.parametrize(
    ("sampling", "needle"),
    [
        ({"top_logprobs": 2}, "sampling.top_logprobs needs sampling.logprobs"),
        ({"logprobs": False, "top_logprobs": 2}, "sampling.top_logprobs needs sampling.logprobs"),
        ({"logprobs": 2, "top_logprobs": 2}, "sampling.top_logprobs must be absent"),
        ({"logprobs": "yes"}, "sampling.logprobs must be an integer"),
        ({"logprobs": True, "top_logprobs": 1.5}, "sampling.top_logprobs must be an integer"),
    ],
)
def test_contradictory_logprobs_fields_are_refused_by_name(sampling: dict[str, Any], needle: str) -> None:
    with pytest.raises(V0ProtocolError, match=needle):
        parse_generate_request(body(prompt="a", sampling=sampling))


# ---- records ------------------------------------------------------------------------------------------------


def _chunk_event(ids: list[int], text: str, logprobs: list[tuple[float, list[tuple[int, float]]]]) -> Any:
    event = engine_pb2.GenerateEvent(request_id="r-1")
    event.token.token_ids.extend(ids)
    event.token.text = text
    for (sampled, top), token_id in zip(logprobs, ids, strict=False):
        event.token.logprobs.append(
            common_pb2.SampledLogprobs(
                sampled=common_pb2.TokenLogprob(token_id=token_id, logprob=sampled),
                top=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in top],
            )
        )
    return event


def test_a_chunk_with_logprobs_becomes_one_record_per_token() -> None:
    writer = V0EventWriter("r-1")
    event = _chunk_event([7, 8, 9], "abc", [(-0.5, [(7, -0.5), (3, -1.25)]), (-1.0, []), (-2.0, [(9, -2.0)])])
    records = _records(event, writer)
    assert [r["token_ids"] for r in records] == [[7], [8], [9]]
    assert [r["token_id"] for r in records] == [7, 8, 9]
    assert records[0]["logprobs"] == {
        "token_logprob": -0.5,
        "top_logprobs": [{"logprob": -0.5, "token_id": 7}, {"logprob": -1.25, "token_id": 3}],
    }
    assert records[1]["logprobs"] == {"token_logprob": -1.0}  # no alternatives asked for: none listed
    assert records[2]["logprobs"] == {
        "token_logprob": -2.0,
        "top_logprobs": [{"logprob": -2.0, "token_id": 9}],
    }
    # The chunk's text is released with its last token.
    assert [r.get("text_delta") for r in records] == [None, None, "abc"]
    assert writer.tokens_sent == 3


def test_a_chunk_without_logprobs_stays_one_record() -> None:
    writer = V0EventWriter("r-2")
    (record,) = _records(_chunk_event([4, 5], "de", []), writer)
    assert record["token_ids"] == [4, 5] and record["token_id"] == 5 and record["text_delta"] == "de"
    assert "logprobs" not in record


def test_an_infinite_logprob_is_null_so_the_frame_stays_json() -> None:
    writer = V0EventWriter("r-3")
    record = writer.token([1], "x", token_logprobs(-math.inf, [(1, -math.inf), (2, -0.25)]))
    frame = sse_frame(record)
    parsed = strict_json(frame.removeprefix(b"data: ").strip())
    assert parsed["logprobs"] == {
        "token_logprob": None,
        "top_logprobs": [{"logprob": None, "token_id": 1}, {"logprob": -0.25, "token_id": 2}],
    }
    with pytest.raises(ValueError, match="one token"):
        writer.token([1, 2], "", token_logprobs(-0.1))


# ---- end to end: engine over a fake SGLang, v0 front over the engine ----------------------------------------


def with_v0_front(test: Callable[[FakeSGLangState, aiohttp.ClientSession, str], Awaitable[T]]) -> T:
    """Run ``test`` against a live v0 front whose engine drives the in-process fake SGLang (which answers
    logprobs when asked, as SGLang does)."""

    async def main() -> T:
        state = FakeSGLangState(
            vocab_size=SMOLLM2_VOCAB, model_path=DEFAULT_MODEL_NAME, token_delay=0.0, context_length=2048
        )
        async with FakeSGLangServer(state) as server:
            (port,) = free_ports(1)
            config = RuntimeConfig(
                server=ServerConfig(port=port, metrics_port=0, drain_timeout=1.0),
                log=LogConfig(format="json"),
                v0=V0FrontConfig(port=0, token=TOKEN),
            )
            daemon = EngineDaemon(config, backends=[SGLangBackend(server.url, timeout=5.0)])
            await daemon.start()
            try:
                assert daemon.v0_front is not None
                url = f"http://127.0.0.1:{daemon.v0_front.port}"
                async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session:
                    return await test(state, session, url)
            finally:
                await daemon.shutdown()

    return asyncio.run(asyncio.wait_for(main(), 60.0))


async def generate(
    session: aiohttp.ClientSession, url: str, sampling: dict[str, Any]
) -> list[dict[str, Any]]:
    request = {
        "protocol_version": "ominix.worker.v0",
        "message_type": "GenerateRequest",
        "request_id": "ominix-" + "0" * 32,
        "input": {"kind": "tokens", "tokens": [5, 6, 7, 8]},
        "sampling": sampling,
        "stream": True,
    }
    async with session.post(f"{url}/generate", json=request) as resp:
        assert resp.status == 200, await resp.text()
        raw = await resp.read()
    frames = [f.removeprefix(b"data: ") for f in raw.split(b"\n\n") if f]
    assert frames[-1] == b"[DONE]"
    return [strict_json(f) for f in frames[:-1]]


def _assert_records_carry_logprobs(records: list[dict[str, Any]]) -> None:
    tokens = [r for r in records if r["kind"] == "token" and r["token_ids"]]
    assert sum(len(r["token_ids"]) for r in tokens) == 4
    for r in tokens:
        (token_id,) = r["token_ids"]
        lp = r["logprobs"]
        assert lp["token_logprob"] == pytest.approx(fake_logprob(token_id), abs=1e-6)
        # The fake's alternatives: the token itself, then the next id one nat less likely.
        assert [t["token_id"] for t in lp["top_logprobs"]] == [token_id, (token_id + 1) % SMOLLM2_VOCAB]
        assert [t["logprob"] for t in lp["top_logprobs"]] == pytest.approx(
            [fake_logprob(token_id), fake_logprob(token_id) - 1], abs=1e-6
        )
    assert records[-1]["kind"] == "done" and "logprobs" not in records[-1]


def test_logprobs_reach_the_token_records_only_when_asked() -> None:
    """Both request forms (the protocol's ``logprobs: true`` with ``top_logprobs``, and a count) ask the
    backend for logprobs and put them on every token record; a request that asks for none gets none, and
    nothing is computed for it. One daemon for the three requests (each start loads the tokenizer)."""

    async def test(
        state: FakeSGLangState, session: aiohttp.ClientSession, url: str
    ) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
        asked = []
        for form in ({"logprobs": True, "top_logprobs": 2}, {"logprobs": 2}):
            asked.append(await generate(session, url, {"max_new_tokens": 4, **form}))
            assert state.generate_bodies[-1]["return_logprob"] is True
            assert state.generate_bodies[-1]["top_logprobs_num"] == 2
        plain = await generate(session, url, {"max_new_tokens": 3})
        assert "return_logprob" not in state.generate_bodies[-1]
        return asked, plain

    asked, plain = with_v0_front(test)
    for records in asked:
        _assert_records_carry_logprobs(records)
    assert sum(len(r.get("token_ids", [])) for r in plain if r["kind"] == "token") == 3
    assert not any("logprobs" in r for r in plain)
