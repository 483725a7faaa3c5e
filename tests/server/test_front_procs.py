"""``--front-procs``: front processes on one port in front of the engine process, and their failures.

The front API itself runs against front processes in test_front_api.py (its fixture is parametrized); here:
streams spread over many connections, Abort and API keys across fronts, a front killed mid-stream (its
requests' KV freed, the front started again), the link to the engine lost (open streams end with one
UNAVAILABLE error each, the fronts exit), and shutdown (no front left behind).
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import (
    SMOLLM2_VOCAB,
    RunningDaemon,
    StreamReader,
    start_daemon,
    stop_daemon,
    token_request,
)

from ominix_runtime.config import FrontConfig
from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc
from ominix_runtime.server.logging import configure_logging
from ominix_runtime.testing.fake_backend import FakeConfig

KEYS = ("key-one", "key-two")


def _fake() -> FakeConfig:
    return FakeConfig(
        vocab_size=SMOLLM2_VOCAB,
        eos_token_ids=(2,),
        max_model_len=4096,
        kv_num_blocks=512,
        step_latency=0.004,
    )


@pytest.fixture(scope="module")
def fronts() -> Iterator[RunningDaemon]:
    configure_logging("warning", json_output=True)
    running, thread = start_daemon(_fake(), front=FrontConfig(procs=2, api_keys=KEYS))
    try:
        yield running
    finally:
        stop_daemon(running, thread)


def _auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def _load(daemon: RunningDaemon) -> engine_pb2.GetLoadResponse:
    return daemon.stub.GetLoad(engine_pb2.GetLoadRequest(), metadata=_auth(KEYS[0]), timeout=10)


def _wait_idle(daemon: RunningDaemon, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        total = _load(daemon).total
        if total.kv_bytes_used == 0 and total.running_requests == 0 and total.queued_requests == 0:
            return
        assert time.monotonic() < deadline, f"KV not freed: {total}"
        time.sleep(0.05)


def _front_pids(daemon: RunningDaemon) -> list[int]:
    return list(daemon.call(daemon.daemon.front_pids))


def _wait_fronts(daemon: RunningDaemon, old: set[int], timeout: float = 60.0) -> list[int]:
    """The front pids once two run and none of ``old`` is among them."""
    deadline = time.monotonic() + timeout
    while True:
        pids = _front_pids(daemon)
        if len(pids) == 2 and not old & set(pids):
            return pids
        assert time.monotonic() < deadline, f"fronts not back: {pids} (old {old})"
        time.sleep(0.1)


def _scrape(daemon: RunningDaemon) -> dict[str, float]:
    with urllib.request.urlopen(daemon.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of this process counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_streams_over_many_connections_end_once_with_every_token(fronts: RunningDaemon) -> None:
    streams = [StreamReader(fronts.address, f"many-{i}", 24 + i, _auth(KEYS[0])) for i in range(24)]
    for s in streams:
        s.join()
    for i, s in enumerate(streams):
        assert s.error is None, s.error
        assert s.terminals() == ["done"]
        assert s.tokens() == 24 + i
    _wait_idle(fronts)


def test_abort_reaches_requests_of_any_front_and_checks_the_key(fronts: RunningDaemon) -> None:
    # Twelve connections: the kernel spreads them over both fronts, so the aborting connection's front
    # streams only some of them and forwards the other Aborts to the engine process.
    streams = [StreamReader(fronts.address, f"abort-{i}", 3000, _auth(KEYS[0])) for i in range(12)]
    for s in streams:
        assert s.first_token.wait(30)
    with grpc.insecure_channel(fronts.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        with pytest.raises(grpc.RpcError) as refused:  # another key's request does not exist for it
            stub.Abort(engine_pb2.AbortRequest(request_id="abort-0"), metadata=_auth(KEYS[1]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        for i in range(12):
            reply = stub.Abort(
                engine_pb2.AbortRequest(request_id=f"abort-{i}"), metadata=_auth(KEYS[0]), timeout=10
            )
            assert reply.found, i
        with pytest.raises(grpc.RpcError) as unknown:  # with API keys an unknown id answers as another key's
            stub.Abort(engine_pb2.AbortRequest(request_id="never-was"), metadata=_auth(KEYS[0]), timeout=10)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    for s in streams:
        s.join()
        assert s.error is None, s.error
        assert s.terminals() == ["done"]
        assert s.events[-1].done.finish_reason == common_pb2.FINISH_REASON_ABORT
        assert s.tokens() < 3000
    _wait_idle(fronts)


def test_admin_calls_are_forwarded_with_the_callers_key(fronts: RunningDaemon) -> None:
    with grpc.insecure_channel(fronts.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        with pytest.raises(grpc.RpcError) as denied:
            stub.GetStats(engine_pb2.GetStatsRequest(), metadata=_auth("not-a-key"), timeout=10)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        backends = stub.ListBackends(engine_pb2.ListBackendsRequest(), metadata=_auth(KEYS[1]), timeout=10)
        assert [b.worker_id for b in backends.backends] == ["fake-0"]
        before = stub.GetStats(engine_pb2.GetStatsRequest(), metadata=_auth(KEYS[1]), timeout=10)
        with pytest.raises(grpc.RpcError) as bad:
            bad_ids = token_request("bad-ids", 4)
            bad_ids.input_ids.ids.append(SMOLLM2_VOCAB)  # one past the vocabulary
            list(stub.Generate(bad_ids, metadata=_auth(KEYS[1]), timeout=10))
            pytest.fail("an out-of-vocabulary prompt was accepted")
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = fronts.stub.GetStats(engine_pb2.GetStatsRequest(), metadata=_auth(KEYS[0]), timeout=10)
    # The refusal happened in a front process; the engine process's GetStats counts it.
    assert after.requests_rejected == before.requests_rejected + 1


def test_a_front_killed_mid_stream_frees_its_requests_and_comes_back(fronts: RunningDaemon) -> None:
    old = _front_pids(fronts)
    streams = [StreamReader(fronts.address, f"kill-{i}", 800, _auth(KEYS[0])) for i in range(10)]
    for s in streams:
        assert s.first_token.wait(30)
    os.kill(old[0], signal.SIGKILL)
    for s in streams:
        s.join()
    broken = [s for s in streams if s.error is not None]
    finished = [s for s in streams if s.error is None]
    # The killed front's clients lose their connection; the other front's streams run to the end.
    assert all(s.error.code() == grpc.StatusCode.UNAVAILABLE for s in broken if s.error is not None)
    assert all(s.terminals() == ["done"] and s.tokens() == 800 for s in finished)
    _wait_idle(fronts)  # the dead front's requests were aborted: no KV left behind
    pids = _wait_fronts(fronts, {old[0]})
    assert old[1] in pids
    metrics = _scrape(fronts)
    assert metrics["ominix_front_restarts_total"] >= 1
    assert metrics["ominix_front_processes"] == 2
    events = list(fronts.stub.Generate(token_request("after-kill", 6), metadata=_auth(KEYS[0]), timeout=30))
    assert events[-1].HasField("done")


def test_losing_the_engine_link_ends_open_streams_with_one_error_and_the_fronts_exit(
    fronts: RunningDaemon,
) -> None:
    old = _front_pids(fronts)
    streams = [StreamReader(fronts.address, f"link-{i}", 3000, _auth(KEYS[0])) for i in range(8)]
    for s in streams:
        assert s.first_token.wait(30)
    hub = fronts.daemon._hub
    assert hub is not None

    def cut_links() -> None:
        for front in list(hub._links):
            front.frames.close()

    fronts.call(cut_links)
    for s in streams:
        s.join()
        assert s.error is None, s.error
        assert s.terminals() == ["error"]
        assert s.events[-1].error.code == common_pb2.ERROR_CODE_BACKEND_UNAVAILABLE
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in old):
        assert time.monotonic() < deadline, "a front outlived its link"
        time.sleep(0.1)
    _wait_fronts(fronts, set(old))  # the engine started the fronts again
    _wait_idle(fronts)  # and aborted the requests of the lost links


def test_shutdown_stops_every_front() -> None:
    running, thread = start_daemon(_fake(), front=FrontConfig(procs=2))
    pids = _front_pids(running)
    assert len(pids) == 2
    stop_daemon(running, thread)
    assert not any(_alive(pid) for pid in pids)
