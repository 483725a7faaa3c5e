"""An admin call a front process forwards to the engine process reaches the client with the engine's answer:
refused there, its status, message and trailing metadata; taken, its effect on the fronts before the answer.
The same as from an engine serving its clients itself (the fixture runs both, see conftest.py)."""

from __future__ import annotations

import time

import grpc
import pytest
from server_harness import RunningDaemon
from test_front_api import generate, greedy, kinds

from ominix_runtime.pb import engine_pb2
from ominix_runtime.server.call_errors import ERROR_KIND_METADATA_KEY, RETRYABLE_METADATA_KEY

TOKENS = engine_pb2.TokenIds(ids=[5, 6, 7])


@pytest.mark.parametrize("call", ["Drain", "Undrain"])
def test_drain_of_an_unknown_worker_is_not_found_with_its_error_kind(
    fake_daemon: RunningDaemon, call: str
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        getattr(fake_daemon.stub, call)(engine_pb2.DrainRequest(worker_id="no-such-worker"), timeout=10)
    error = refused.value
    # Through a front this was UNKNOWN: the forwarded trailing metadata made context.abort raise a TypeError.
    assert error.code() == grpc.StatusCode.NOT_FOUND, error.details()
    assert "no-such-worker" in (error.details() or "")
    metadata = dict(error.trailing_metadata() or ())
    # The kind is the engine's to choose (the contract has no NOT_FOUND kind); it must arrive, and a call
    # naming no worker is never worth a retry.
    assert metadata.get(ERROR_KIND_METADATA_KEY), metadata
    assert metadata.get(RETRYABLE_METADATA_KEY) == "false", metadata


def test_a_request_sent_once_undrain_answered_is_taken(fake_daemon: RunningDaemon) -> None:
    """Undrain's answer means new requests are routed again: through a front process the readiness it
    changed reaches every front before the answer, not at their next poll (every such request was refused
    UNAVAILABLE for up to 0.25 s)."""
    for attempt in range(5):
        fake_daemon.stub.Drain(engine_pb2.DrainRequest(), timeout=10)
        time.sleep(0.3)  # a poll or more: every front has seen the drain
        fake_daemon.stub.Undrain(engine_pb2.DrainRequest(), timeout=10)
        events = generate(
            fake_daemon, request_id=f"after-undrain-{attempt}", input_ids=TOKENS, sampling=greedy(2)
        )
        assert kinds(events)[-1] == "done", events[-1]


class _Refused(Exception):
    pass


class _Context:
    """The servicer context of a forwarded call: what the front aborts the call with."""

    def __init__(self) -> None:
        self.aborted: tuple[object, str, tuple[tuple[str, str], ...]] | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def abort(self, code: object, details: str, trailing_metadata: tuple[tuple[str, str], ...]) -> None:
        self.aborted = (code, details, trailing_metadata)
        raise _Refused


@pytest.mark.parametrize(
    ("code", "kind", "retryable"),
    [
        (grpc.StatusCode.UNAVAILABLE, "BACKEND_UNAVAILABLE", "true"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "TIMEOUT", "false"),
    ],
)
def test_a_forwarded_call_the_engine_process_never_answered_carries_an_error_kind(
    code: grpc.StatusCode, kind: str, retryable: str
) -> None:
    """The engine process gone, or past the forward timeout: no trailers came back, so the front adds the
    kind its status stands for (every refused call carries one)."""
    import asyncio

    from ominix_runtime.server.front_process import FrontService

    async def unanswered(request: object, metadata: object, timeout: float) -> object:
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="no answer")

    context = _Context()
    with pytest.raises(_Refused):
        asyncio.run(FrontService._forward(None, unanswered, engine_pb2.GetLoadRequest(), context))  # type: ignore[arg-type]
    assert context.aborted is not None
    status, _, trailers = context.aborted
    assert status == code
    assert dict(trailers) == {ERROR_KIND_METADATA_KEY: kind, RETRYABLE_METADATA_KEY: retryable}
