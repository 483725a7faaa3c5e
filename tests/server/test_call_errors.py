"""Every refused call of the front API carries the contract's error kind and retry flag in its trailing
metadata (engine.proto, "Errors"), whatever refused it: the guard, a handler, a forwarded call. And an error
event's retry flag says whether the user saw a token, not whether the engine made one."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest
from server_harness import FAKE, RunningDaemon, running_daemon
from test_front_api import greedy

from ominix_runtime.contract import RuntimeErrorKind
from ominix_runtime.pb import engine_pb2
from ominix_runtime.server.call_errors import ERROR_KIND_METADATA_KEY, RETRYABLE_METADATA_KEY
from ominix_runtime.wire import error_code_to_pb

GENERATE = "/ominix.runtime.v1.Engine/Generate"


def _refusal(call: grpc.RpcError) -> tuple[grpc.StatusCode, dict[str, str]]:
    return call.code(), dict(call.trailing_metadata() or ())  # type: ignore[attr-defined]


def test_an_abort_naming_a_malformed_id_carries_the_error_kind(fake_daemon: RunningDaemon) -> None:
    for rid in ("x" * 300, "é"):
        with pytest.raises(grpc.RpcError) as refused:
            fake_daemon.stub.Abort(engine_pb2.AbortRequest(request_id=rid), timeout=10)
        code, metadata = _refusal(refused.value)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert metadata.get(ERROR_KIND_METADATA_KEY) == "INVALID_ARGUMENT", metadata
        assert metadata.get(RETRYABLE_METADATA_KEY) == "false", metadata


def test_a_request_that_does_not_decode_carries_the_error_kind(fake_daemon: RunningDaemon) -> None:
    raw = fake_daemon.channel.unary_stream(GENERATE)  # bytes in, bytes out: no stubs to refuse the junk
    with pytest.raises(grpc.RpcError) as refused:
        list(raw(b"\x0a\xff\xff\xff", timeout=10))  # field 1 (request_id) claims more bytes than follow
    code, metadata = _refusal(refused.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()  # type: ignore[attr-defined]
    assert metadata.get(ERROR_KIND_METADATA_KEY) == "INVALID_ARGUMENT", metadata
    assert metadata.get(RETRYABLE_METADATA_KEY) == "false", metadata


@pytest.fixture(params=[0, 2], ids=["in-process", "front-procs"])
def dying_daemon(request: pytest.FixtureRequest) -> Iterator[RunningDaemon]:
    """One fake worker whose stream breaks after its third step: every live request fails BACKEND_UNAVAILABLE."""
    yield from running_daemon(replace(FAKE, step_latency=0.05, die_after_steps=3), request.param)


def test_a_request_that_does_not_stream_fails_retryable_though_the_engine_made_tokens(
    dying_daemon: RunningDaemon,
) -> None:
    """Two requests in the same steps when the worker goes: the streaming one had tokens on the wire, so a
    retry would repeat them; the other's tokens never left the engine, so the router may send it again."""

    def call(rid: str, stream: bool) -> Iterator[engine_pb2.GenerateEvent]:
        request = engine_pb2.GenerateRequest(
            request_id=rid, input_ids=engine_pb2.TokenIds(ids=[5, 6]), sampling=greedy(50), stream=stream
        )
        return dying_daemon.stub.Generate(request, timeout=30)  # sent now, read below

    seen_call, unseen_call = call("seen", stream=True), call("unseen", stream=False)
    seen, unseen = list(seen_call), list(unseen_call)
    assert any(e.HasField("token") for e in seen) and not any(e.HasField("token") for e in unseen)
    unavailable = error_code_to_pb(RuntimeErrorKind.BACKEND_UNAVAILABLE)
    assert seen[-1].error.code == unavailable and not seen[-1].error.retryable, seen[-1]
    assert unseen[-1].error.code == unavailable and unseen[-1].error.retryable, unseen[-1]
