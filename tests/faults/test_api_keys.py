"""--api-key on a real engine process: the Engine API needs `authorization: Bearer KEY`, health and
reflection stay open, and a request belongs to the key that created it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
from fault_procs import Engine, Outcome, start_fake_engine
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ominix_runtime.pb import common_pb2, engine_pb2

KEY_A, KEY_B = "key-a-1f4e", "key-b-93c2"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    logs = tmp_path_factory.mktemp("api-keys")
    args = ("--workers", "1", "--step-latency", "0.01", "--api-key", KEY_A, "--api-key", KEY_B)
    with start_fake_engine(logs, *args) as running:
        yield running


def _auth(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def _request(rid: str, max_tokens: int = 4) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=rid,
        input_ids=engine_pb2.TokenIds(ids=[10, 11, 12]),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def _stream(engine: Engine, request: engine_pb2.GenerateRequest, metadata: list, out: Outcome) -> Outcome:
    try:
        for ev in engine.stub.Generate(request, metadata=metadata, timeout=60):
            kind = ev.WhichOneof("event")
            if kind == "token":
                out.tokens += list(ev.token.token_ids)
                out.first_token.set()
            elif kind in ("done", "error"):
                out.num_terminal += 1
                out.done = ev.done if kind == "done" else None
                out.error = ev.error if kind == "error" else None
    except grpc.RpcError as exc:
        out.status = exc.code()  # type: ignore[attr-defined]  # a failed call's RpcError is a grpc.Call
    return out


@pytest.mark.parametrize(
    "metadata",
    [[], _auth("wrong"), [("authorization", KEY_A)], [("authorization", "Basic " + KEY_A)]],
    ids=["none", "unknown key", "no Bearer", "Basic"],
)
def test_engine_api_refuses_calls_without_a_known_key(engine: Engine, metadata: list) -> None:
    out = _stream(engine, _request("anon"), metadata, Outcome("anon"))
    assert out.status == grpc.StatusCode.UNAUTHENTICATED and out.num_terminal == 0
    for call, request in (
        (engine.stub.GetLoad, engine_pb2.GetLoadRequest()),
        (engine.stub.GetStats, engine_pb2.GetStatsRequest()),
        (engine.stub.Abort, engine_pb2.AbortRequest(request_id="x")),
        (engine.stub.ListBackends, engine_pb2.ListBackendsRequest()),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call(request, metadata=metadata, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]  # a failed call's RpcError is a grpc.Call
    batch = engine_pb2.GenerateBatchRequest(requests=[_request("anon-batch")])
    with pytest.raises(grpc.RpcError) as err:
        list(engine.stub.GenerateBatch(batch, metadata=metadata, timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]  # a failed call's RpcError is a grpc.Call


def test_each_configured_key_works(engine: Engine) -> None:
    for key in (KEY_A, KEY_B):
        out = _stream(engine, _request(f"ok-{key}"), _auth(key), Outcome(key))
        assert out.status is None and out.num_terminal == 1 and len(out.tokens) == 4
        assert engine.stub.GetLoad(engine_pb2.GetLoadRequest(), metadata=_auth(key), timeout=10).total.healthy


def test_health_and_reflection_stay_open(engine: Engine) -> None:
    health = health_pb2_grpc.HealthStub(engine.channel)
    resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(engine.channel)
    answers = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert "ominix.runtime.v1.Engine" in names


def test_a_request_belongs_to_its_key(engine: Engine) -> None:
    out = Outcome("owned")
    thread = threading.Thread(target=_stream, args=(engine, _request("owned", 2000), _auth(KEY_A), out))
    thread.start()
    assert out.first_token.wait(30), engine.logs()
    with pytest.raises(grpc.RpcError) as err:
        engine.stub.Abort(engine_pb2.AbortRequest(request_id="owned"), metadata=_auth(KEY_B), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]  # a failed call's RpcError is a grpc.Call
    with pytest.raises(grpc.RpcError) as unknown:  # the same answer as for an id nobody uses
        engine.stub.Abort(engine_pb2.AbortRequest(request_id="nobody"), metadata=_auth(KEY_B), timeout=10)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]  # a failed call's RpcError is a grpc.Call
    assert thread.is_alive()  # still streaming
    resp = engine.stub.Abort(engine_pb2.AbortRequest(request_id="owned"), metadata=_auth(KEY_A), timeout=10)
    assert resp.found
    thread.join(30)
    assert out.num_terminal == 1 and out.done is not None
    assert out.done.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert len(out.tokens) < 2000
