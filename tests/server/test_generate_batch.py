"""GenerateBatch over real gRPC, served by the engine process and by front processes (conftest's fixture):
each request's events match its own Generate stream's, refusals are per request or per call as engine.proto
says, events share messages, and cancelling the call frees every request's KV."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import defaultdict

import grpc
import pytest
from server_harness import RunningDaemon
from test_front_api import generate, greedy, kinds, wait_kv_free

from ominix_runtime.client import EngineClient
from ominix_runtime.contract import InvalidArgument, RuntimeErrorKind
from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc
from ominix_runtime.server import batch_call
from ominix_runtime.wire import error_code_to_pb

TERMINAL = ("done", "error")


def _by_request(events: list[engine_pb2.GenerateEvent]) -> dict[str, list[engine_pb2.GenerateEvent]]:
    out: dict[str, list[engine_pb2.GenerateEvent]] = defaultdict(list)
    for event in events:
        out[event.request_id].append(event)
    return dict(out)


def _runs(event_kinds: list[str]) -> list[str]:
    """The event kinds with each run of repeated kinds (a stream's token events) as one."""
    return [k for i, k in enumerate(event_kinds) if i == 0 or k != event_kinds[i - 1]]


def _batch(
    daemon: RunningDaemon, requests: list[engine_pb2.GenerateRequest]
) -> list[engine_pb2.GenerateEvent]:
    with EngineClient(daemon.address, timeout=60) as client:
        return list(client.generate_batch(requests))


def _ids_request(rid: str, ids: list[int], max_tokens: int) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=rid, input_ids=engine_pb2.TokenIds(ids=ids), sampling=greedy(max_tokens, ignore_eos=True)
    )


def test_each_request_streams_as_its_own_generate_would(fake_daemon: RunningDaemon) -> None:
    requests = [_ids_request(f"b-ids-{i}", [20 + i, 21, 22, 23 + i], 3 + i % 5) for i in range(12)]
    requests.append(engine_pb2.GenerateRequest(request_id="b-text", prompt="Hello there", sampling=greedy(6)))
    chat = engine_pb2.ChatMessages(messages=[engine_pb2.ChatMessage(role="user", content="hi")])
    requests.append(engine_pb2.GenerateRequest(request_id="b-chat", messages=chat, sampling=greedy(4)))
    requests.append(
        engine_pb2.GenerateRequest(
            request_id="b-whole", prompt="Same prompt", sampling=greedy(5), stream=False
        )
    )
    per_request = _by_request(_batch(fake_daemon, requests))
    assert set(per_request) == {r.request_id for r in requests}
    for request in requests:
        alone = generate(
            fake_daemon,
            **{
                "request_id": request.request_id + "-alone",
                request.WhichOneof("input"): getattr(request, request.WhichOneof("input")),
                "sampling": request.sampling,
                "stream": request.stream if request.HasField("stream") else True,
            },
        )
        events = per_request[request.request_id]
        # A stream's tokens may come merged into fewer events when its reader lags (a loaded host), so the
        # events' shape is compared with each run of tokens as one, and the tokens themselves below.
        assert _runs(kinds(events)) == _runs(kinds(alone)), request.request_id
        assert [k for k in kinds(events) if k in TERMINAL] == ["done"]
        got = [t for e in events if e.HasField("token") for t in e.token.token_ids]
        assert got == [t for e in alone if e.HasField("token") for t in e.token.token_ids]
        assert events[-1].done.text == alone[-1].done.text
        assert events[-2].usage.completion_tokens == alone[-2].usage.completion_tokens
    wait_kv_free(fake_daemon)


def test_a_refused_request_ends_alone_and_the_rest_finish(fake_daemon: RunningDaemon) -> None:
    requests = [
        _ids_request("r-good-0", [11, 12, 13], 4),
        engine_pb2.GenerateRequest(
            request_id="r-temp", prompt="x", sampling=common_pb2.SamplingParams(temperature=-1)
        ),
        engine_pb2.GenerateRequest(request_id="r-model", prompt="x", model="no-such-model"),
        _ids_request("r-vocab", [10**6], 2),
        # Fits the context but not the KV cache even alone (64 blocks x 16 tokens).
        engine_pb2.GenerateRequest(request_id="r-kv", prompt="x", sampling=greedy(1500)),
        engine_pb2.GenerateRequest(request_id="r-empty"),
        _ids_request("r-good-1", [14, 15, 16], 6),
    ]
    per_request = _by_request(_batch(fake_daemon, requests))
    codes = {
        rid: events[-1].error.code for rid, events in per_request.items() if events[-1].HasField("error")
    }
    invalid = error_code_to_pb(RuntimeErrorKind.INVALID_ARGUMENT)
    assert codes == {
        "r-temp": invalid,
        "r-model": error_code_to_pb(RuntimeErrorKind.CAPABILITY_MISMATCH),
        "r-vocab": invalid,
        "r-kv": error_code_to_pb(RuntimeErrorKind.KV_CAPACITY_EXCEEDED),
        "r-empty": invalid,
    }
    for rid in codes:
        assert len(per_request[rid]) == 1 and per_request[rid][0].error.message, rid
    for rid, count in (("r-good-0", 4), ("r-good-1", 6)):
        events = per_request[rid]
        assert events[-1].done.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert sum(len(e.token.token_ids) for e in events if e.HasField("token")) == count
    wait_kv_free(fake_daemon)


def test_an_id_live_elsewhere_is_refused_for_that_request_only(fake_daemon: RunningDaemon) -> None:
    first = fake_daemon.stub.Generate(
        engine_pb2.GenerateRequest(request_id="held", prompt="x", sampling=greedy(800)), timeout=30
    )
    assert next(first).WhichOneof("event") == "prefill_done"
    per_request = _by_request(
        _batch(fake_daemon, [_ids_request("held", [11], 2), _ids_request("fresh", [11], 2)])
    )
    assert per_request["held"][-1].error.code == error_code_to_pb(RuntimeErrorKind.INVALID_ARGUMENT)
    assert "already live" in per_request["held"][-1].error.message
    assert per_request["fresh"][-1].HasField("done")
    assert fake_daemon.stub.Abort(engine_pb2.AbortRequest(request_id="held"), timeout=5).found
    assert kinds(list(first))[-1] == "done"
    wait_kv_free(fake_daemon)


@pytest.mark.parametrize(
    ("requests", "says"),
    [
        ([], "requests is empty"),
        (
            [_ids_request("same", [11], 1), _ids_request("other", [11], 1), _ids_request("same", [11], 1)],
            "requests[2]: request_id 'same' appears twice",
        ),
        ([_ids_request("ok", [11], 1), _ids_request("bad\nid", [11], 1)], "requests[1]"),
        # The engine queues 1,024 requests (--max-queue-len): a larger call could only be refused in part.
        ([_ids_request("", [11], 1)] * 1025, "at most 1024 (the engine queues no more: --max-queue-len)"),
    ],
    ids=["empty", "repeated id", "bad id", "more than the queue holds"],
)
def test_a_malformed_call_is_refused_whole(
    fake_daemon: RunningDaemon, requests: list[engine_pb2.GenerateRequest], says: str
) -> None:
    before = fake_daemon.stub.GetStats(engine_pb2.GetStatsRequest(), timeout=5)
    with pytest.raises(grpc.RpcError) as info:
        _batch(fake_daemon, requests)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert says in info.value.details()  # type: ignore[attr-defined]
    after = fake_daemon.stub.GetStats(engine_pb2.GetStatsRequest(), timeout=5)
    assert after.requests_accepted == before.requests_accepted  # nothing was admitted


def test_events_of_one_step_share_a_message(fake_daemon: RunningDaemon) -> None:
    requests = [_ids_request(f"m-{i}", [30 + i, 31, 32], 16) for i in range(32)]
    call = fake_daemon.stub.GenerateBatch(engine_pb2.GenerateBatchRequest(requests=requests), timeout=60)
    messages = list(call)
    events = [e for m in messages for e in m.events]
    per_request = _by_request(events)
    assert [kinds(v).count("done") for v in per_request.values()] == [1] * 32
    tokens = [sum(len(e.token.token_ids) for e in v if e.HasField("token")) for v in per_request.values()]
    assert tokens == [16] * 32
    # 32 requests x (prefill_done, 16 tokens, usage, done) is over 600 events, fewer when a lagging stream
    # merges its tokens (a loaded host): one message per event would be hundreds, one per step about 16 - 20.
    assert len(messages) <= 32 * 16 // 8, (len(messages), len(events))
    wait_kv_free(fake_daemon)


def test_cancelling_the_call_frees_every_request(fake_daemon: RunningDaemon) -> None:
    requests = [_ids_request(f"c-{i}", [40 + i, 41], 800) for i in range(6)]
    call = fake_daemon.stub.GenerateBatch(engine_pb2.GenerateBatchRequest(requests=requests), timeout=30)
    started: set[str] = set()
    for message in call:
        started.update(e.request_id for e in message.events if e.HasField("token"))
        if len(started) == len(requests):
            break
    load = fake_daemon.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
    assert load.total.running_requests == len(requests)
    call.cancel()
    wait_kv_free(fake_daemon, timeout=5.0)
    # The ids are free again: the requests were aborted, not left running.
    assert not fake_daemon.stub.Abort(engine_pb2.AbortRequest(request_id="c-0"), timeout=5).found


def test_a_batch_does_not_stall_another_stream(fake_daemon: RunningDaemon) -> None:
    alone: list[engine_pb2.GenerateEvent] = []
    first_token = threading.Event()

    def stream_alone() -> None:
        for event in fake_daemon.stub.Generate(
            engine_pb2.GenerateRequest(prompt="beside", sampling=greedy(120)), timeout=60
        ):
            alone.append(event)
            if event.HasField("token"):
                first_token.set()

    thread = threading.Thread(target=stream_alone)
    thread.start()
    assert first_token.wait(30)
    per_request = _by_request(_batch(fake_daemon, [_ids_request(f"s-{i}", [50 + i], 20) for i in range(16)]))
    thread.join(60)
    assert kinds(alone)[-1] == "done" and alone[-2].usage.completion_tokens == 120
    assert all(kinds(events)[-1] == "done" for events in per_request.values()) and len(per_request) == 16
    wait_kv_free(fake_daemon)


def test_text_batches_share_the_tokenizer_pool(fake_daemon: RunningDaemon) -> None:
    """Three calls of 100 text prompts at once, against a pool that refuses more than 64 pending: batch
    admissions wait for the pool together (half of it at most), so none is refused."""
    results: dict[int, dict[str, list[engine_pb2.GenerateEvent]]] = {}

    def one(k: int) -> None:
        requests = [
            engine_pb2.GenerateRequest(
                request_id=f"t{k}-{i}", prompt=f"prompt {k} number {i}", sampling=greedy(2)
            )
            for i in range(100)
        ]
        results[k] = _by_request(_batch(fake_daemon, requests))

    threads = [threading.Thread(target=one, args=(k,)) for k in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    errors = [e[-1].error.message for r in results.values() for e in r.values() if e[-1].HasField("error")]
    assert not errors, errors[:3]
    assert [len(r) for r in results.values()] == [100, 100, 100]
    wait_kv_free(fake_daemon)


def test_cancelling_during_admission_frees_every_request(fake_daemon: RunningDaemon) -> None:
    requests = [
        engine_pb2.GenerateRequest(
            request_id=f"ca-{i}", prompt=f"a longer prompt {i} " * 8, sampling=greedy(400)
        )
        for i in range(100)
    ]
    call = fake_daemon.stub.GenerateBatch(engine_pb2.GenerateBatchRequest(requests=requests), timeout=30)
    next(call)  # admissions are under way: the first event is out
    call.cancel()
    wait_kv_free(fake_daemon, timeout=5.0)
    assert not any(
        fake_daemon.stub.Abort(engine_pb2.AbortRequest(request_id=r.request_id), timeout=5).found
        for r in requests
    )
    again = generate(fake_daemon, request_id="ca-0", prompt="x", sampling=greedy(2))  # the id is free
    assert kinds(again)[-1] == "done"


def test_aborting_one_request_ends_it_alone(fake_daemon: RunningDaemon) -> None:
    requests = [_ids_request("ab-long", [60, 61], 800), _ids_request("ab-short-0", [62], 30)]
    requests.append(_ids_request("ab-short-1", [63], 30))
    call = fake_daemon.stub.GenerateBatch(engine_pb2.GenerateBatchRequest(requests=requests), timeout=30)
    events: list[engine_pb2.GenerateEvent] = []
    for message in call:
        events.extend(message.events)
        if any(e.request_id == "ab-long" and e.HasField("token") for e in message.events):
            break
    assert fake_daemon.stub.Abort(engine_pb2.AbortRequest(request_id="ab-long"), timeout=5).found
    for message in call:
        events.extend(message.events)
    per_request = _by_request(events)
    assert per_request["ab-long"][-1].done.finish_reason == common_pb2.FINISH_REASON_ABORT
    for rid in ("ab-short-0", "ab-short-1"):
        assert per_request[rid][-1].done.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert sum(len(e.token.token_ids) for e in per_request[rid] if e.HasField("token")) == 30
    assert [kinds(v).count("done") + kinds(v).count("error") for v in per_request.values()] == [1, 1, 1]
    wait_kv_free(fake_daemon)


def test_empty_ids_are_generated_and_distinct(fake_daemon: RunningDaemon) -> None:
    per_request = _by_request(_batch(fake_daemon, [_ids_request("", [70 + i], 3) for i in range(5)]))
    assert len(per_request) == 5 and all(per_request)
    assert all(kinds(events)[-1] == "done" for events in per_request.values())


def test_the_message_cap_splits_messages_and_keeps_order(
    fake_daemon: RunningDaemon, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    if "front-procs" in request.node.callspec.id:
        pytest.skip("the cap is patched in this process; front processes run their own copy")
    monkeypatch.setattr(batch_call, "MAX_MESSAGE_BYTES", 1)
    requests = [_ids_request(f"cap-{i}", [80 + i, 81], 6) for i in range(8)]
    call = fake_daemon.stub.GenerateBatch(engine_pb2.GenerateBatchRequest(requests=requests), timeout=60)
    messages = list(call)
    assert all(len(m.events) == 1 for m in messages)
    per_request = _by_request([e for m in messages for e in m.events])
    for events in per_request.values():
        assert kinds(events)[0] == "prefill_done" and kinds(events)[-2:] == ["usage", "done"]
        assert sum(len(e.token.token_ids) for e in events if e.HasField("token")) == 6
    assert len(per_request) == 8


def test_a_slow_reader_gets_merged_tokens_not_a_growing_queue(
    fake_daemon: RunningDaemon, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """Past the queue's limit the requests stop taking their events: a reader that pauses finds each request's
    later tokens merged into few events (every token still there, in order), not one event per token."""
    if "front-procs" in request.node.callspec.id:
        pytest.skip("the limit is patched in this process; front processes run their own copy")
    monkeypatch.setattr(batch_call, "MAX_QUEUED_EVENTS", 4)
    requests = [_ids_request(f"slow-{i}", [90 + i, 91], 100) for i in range(4)]
    # A small HTTP/2 window that does not grow: the server's sends stop as soon as the client stops reading,
    # and the call's queue fills behind them.
    options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(fake_daemon.address, options=options) as channel:
        call = engine_pb2_grpc.EngineStub(channel).GenerateBatch(
            engine_pb2.GenerateBatchRequest(requests=requests), timeout=60
        )
        events = list(next(call).events)
        time.sleep(1.0)  # about 500 fake steps: every request finishes meanwhile
        for message in call:
            events.extend(message.events)
    per_request = _by_request(events)
    alone = generate(fake_daemon, input_ids=requests[0].input_ids, sampling=requests[0].sampling)
    expected = [t for e in alone if e.HasField("token") for t in e.token.token_ids]
    for rid, got in per_request.items():
        chunks = [list(e.token.token_ids) for e in got if e.HasField("token")]
        assert sum(len(c) for c in chunks) == 100 and kinds(got)[-1] == "done", rid
        assert len(chunks) < 50, (rid, len(chunks))  # merged while the reader slept
    assert [t for e in per_request["slow-0"] if e.HasField("token") for t in e.token.token_ids] == expected
    wait_kv_free(fake_daemon)


def test_a_request_waiting_for_the_tokenizer_gate_is_live(fake_daemon: RunningDaemon) -> None:
    """300 text prompts in one call: most wait for the tokenizer gate (32 at a time) once the first streams.
    The last one's id is live already: Abort finds it and ends it with ABORT, and a Generate of that id is
    refused as a duplicate, while the others run to their length."""
    requests = [
        engine_pb2.GenerateRequest(
            request_id=f"gate-{i}", prompt=f"gated prompt {i} " * 4, sampling=greedy(20)
        )
        for i in range(300)
    ]
    call = fake_daemon.stub.GenerateBatch(engine_pb2.GenerateBatchRequest(requests=requests), timeout=60)
    events = list(next(call).events)
    assert fake_daemon.stub.Abort(engine_pb2.AbortRequest(request_id="gate-299"), timeout=10).found
    with pytest.raises(grpc.RpcError) as duplicate:
        generate(fake_daemon, request_id="gate-298", prompt="x", sampling=greedy(2))
    assert duplicate.value.code() == grpc.StatusCode.ALREADY_EXISTS  # type: ignore[attr-defined]
    for message in call:
        events.extend(message.events)
    per_request = _by_request(events)
    assert [kinds(v).count("done") + kinds(v).count("error") for v in per_request.values()] == [1] * 300
    assert per_request["gate-299"][-1].done.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert per_request["gate-298"][-1].done.finish_reason == common_pb2.FINISH_REASON_LENGTH
    wait_kv_free(fake_daemon, timeout=10.0)


class _GatedService:
    """Stands in for the service: records reservations and withdrawals; admissions wait on ``opened``."""

    def __init__(self) -> None:
        self.reserved: list[str] = []
        self.withdrawn: list[str] = []
        self.opened = asyncio.Event()

    def reserve(self, rid: str, caller: str, traceparent: str, model: str) -> object:
        self.reserved.append(rid)
        return object()

    def withdraw(self, rid: str, span: object, model: str) -> None:
        self.withdrawn.append(rid)

    async def admit_reserved(
        self, pb: engine_pb2.GenerateRequest, rid: str, caller: str, span: object
    ) -> None:
        await self.opened.wait()
        raise InvalidArgument("not admitted in this test")


def test_requests_that_never_reach_admission_give_their_ids_back() -> None:
    """A call of text prompts behind a gate of one, left at its first event: every id was reserved when the
    call started; the one in admission ends there, and each request still waiting for the gate (or whose task
    never ran) gives its id back."""
    ids = [f"w{i}" for i in range(6)]
    requests = [engine_pb2.GenerateRequest(request_id=rid, prompt="p", sampling=greedy(2)) for rid in ids]
    service = _GatedService()

    async def run() -> None:
        call = batch_call.BatchCall(service, "", "", asyncio.Semaphore(1))  # type: ignore[arg-type]
        events = call.events(requests, ids)
        first = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(0.05)
        assert service.reserved == ids  # before any admission ended
        assert not first.done()
        first.cancel()  # the client leaves
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await events.aclose()

    asyncio.run(asyncio.wait_for(run(), timeout=10))
    assert sorted(service.withdrawn) == ids[1:]  # w0 held the gate: admission answers for it


class _RefusingService:
    """Stands in for the service: every admission fails, one of them by cancellation (as a tokenizer pool
    closing at shutdown cancels its pending work) and one by a bug."""

    def reserve(self, rid: str, caller: str, traceparent: str, model: str) -> object:
        return object()

    def __init__(self) -> None:
        self.withdrawn: list[str] = []

    def withdraw(self, rid: str, span: object, model: str) -> None:
        self.withdrawn.append(rid)  # none may be: every request reached admission

    async def admit_reserved(
        self, pb: engine_pb2.GenerateRequest, rid: str, caller: str, span: object
    ) -> None:
        if rid == "cancelled":
            raise asyncio.CancelledError
        if rid == "bug":
            raise KeyError("a bug")
        raise InvalidArgument("refused")


def test_a_request_that_ends_without_a_terminal_gets_one() -> None:
    ids = ["cancelled", "bug", "refused"]
    requests = [_ids_request(rid, [11], 1) for rid in ids]

    service = _RefusingService()

    async def run() -> list[engine_pb2.GenerateEvent]:
        call = batch_call.BatchCall(service, "", "", asyncio.Semaphore(4))  # type: ignore[arg-type]
        return [e async for batch in call.events(requests, ids) for e in batch.events]

    events = asyncio.run(asyncio.wait_for(run(), timeout=10))
    assert service.withdrawn == []
    assert sorted(e.request_id for e in events) == sorted(ids)  # one terminal each, and the call ended
    by_id = {e.request_id: e.error for e in events}
    assert by_id["cancelled"].code == error_code_to_pb(RuntimeErrorKind.INTERNAL)
    assert "cancelled" in by_id["cancelled"].message
    assert by_id["bug"].code == error_code_to_pb(RuntimeErrorKind.INTERNAL)
    assert by_id["refused"].code == error_code_to_pb(RuntimeErrorKind.INVALID_ARGUMENT)


def test_a_call_is_bounded_by_the_engine_queue() -> None:
    assert batch_call.max_batch_requests(0) == batch_call.MAX_BATCH_REQUESTS  # no queue limit
    assert batch_call.max_batch_requests(100_000) == batch_call.MAX_BATCH_REQUESTS
    assert batch_call.max_batch_requests(300) == 300
    assert batch_call.tokenizing_admissions(64) == 32 and batch_call.tokenizing_admissions(8) == 4
    assert batch_call.tokenizing_admissions(1) == 1
