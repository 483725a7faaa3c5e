"""SIGTERM under load: health NOT_SERVING, new requests UNAVAILABLE (the listener stays open while draining),
in-flight ones finish within the drain timeout, the rest end with one error event, and every process exits 0.
A second signal cuts the drain short: every stream still ends with one terminal error event."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from fault_procs import Engine, Outcome, start_engine, start_fake_engine, stop_procs, stream_one
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ominix_runtime.contract import RuntimeErrorKind
from ominix_runtime.pb import common_pb2, engine_pb2

DRAIN_S = 3.0


def _req(rid: str, max_tokens: int, i: int = 0) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=rid,
        input_ids=engine_pb2.TokenIds(ids=[5 + (i + k) % 200 for k in range(10)]),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def _start_streams(
    engine: Engine, requests: list[engine_pb2.GenerateRequest]
) -> tuple[list[Outcome], list[threading.Thread]]:
    outs = [Outcome(r.request_id) for r in requests]
    threads = [
        threading.Thread(target=stream_one, args=(engine.stub, r, 60, o))
        for r, o in zip(requests, outs, strict=True)
    ]
    for t in threads:
        t.start()
    for o in outs:
        assert o.first_token.wait(30), engine.logs()
    return outs, threads


class _BatchOutcome:
    """One GenerateBatch call read in a thread: every event, and the call's status if it failed."""

    def __init__(self, engine: Engine, requests: list[engine_pb2.GenerateRequest]) -> None:
        self.events: list[engine_pb2.GenerateEvent] = []
        self.status: grpc.StatusCode | None = None
        self.first_token = threading.Event()
        self._call = engine.stub.GenerateBatch(engine_pb2.GenerateBatchRequest(requests=requests), timeout=60)
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def _read(self) -> None:
        try:
            for message in self._call:
                self.events.extend(message.events)
                if any(e.HasField("token") for e in message.events):
                    self.first_token.set()
        except grpc.RpcError as exc:
            self.status = exc.code()  # type: ignore[attr-defined]  # a failed call's RpcError is a grpc.Call

    def terminals(self) -> dict[str, list[engine_pb2.GenerateEvent]]:
        out: dict[str, list[engine_pb2.GenerateEvent]] = {}
        for event in self.events:
            if event.WhichOneof("event") in ("done", "error"):
                out.setdefault(event.request_id, []).append(event)
        return out


def _health(address: str) -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            return (
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
            )
        except grpc.RpcError:
            return None  # the server is gone: not serving either


def _refused_while_draining(engine: Engine) -> grpc.StatusCode | None:
    """The status of a new request while draining: the engine's own UNAVAILABLE, not a refused connection."""
    try:
        list(engine.stub.Generate(_req("late", 4), timeout=10))
    except grpc.RpcError as exc:
        assert "not serving" in (exc.details() or ""), exc.details()  # type: ignore[attr-defined]
        return exc.code()  # type: ignore[attr-defined]
    return None


def _wait_not_serving(engine: Engine) -> None:
    """Health answers NOT_SERVING soon after the signal (an answer: the listener is still open)."""
    deadline = time.monotonic() + 5
    while (status := _health(engine.address)) != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert status is not None, "the listener closed while draining"
        assert time.monotonic() < deadline, "still SERVING after SIGTERM"
        time.sleep(0.02)


def test_sigterm_drains_in_flight_then_ends_the_rest(tmp_path: Path) -> None:
    # 20 ms per step: the short requests finish within the drain timeout, the long ones cannot.
    args = ("--workers", "2", "--step-latency", "0.02", "--drain-timeout", str(DRAIN_S))
    with start_fake_engine(tmp_path, *args) as engine:
        requests = [_req(f"short{i}", 40, i) for i in range(8)] + [
            _req(f"long{i}", 1000, i) for i in range(4)
        ]
        outs, threads = _start_streams(engine, requests)
        # The same mix in one GenerateBatch call: the drain waits for it as for the streams.
        batch = _BatchOutcome(engine, [_req(f"b-short{i}", 40, i) for i in range(3)] + [_req("b-long", 1000)])
        assert batch.first_token.wait(30), engine.logs()
        proc = engine.engine.popen
        proc.send_signal(signal.SIGTERM)
        sent_at = time.monotonic()
        _wait_not_serving(engine)
        assert _refused_while_draining(engine) == grpc.StatusCode.UNAVAILABLE
        for t in [*threads, batch.thread]:
            t.join(30)
        assert proc.wait(timeout=DRAIN_S + 15) == 0, engine.logs()
        ends = batch.terminals()
        assert batch.status is None and sorted(ends) == ["b-long", "b-short0", "b-short1", "b-short2"]
        assert all(len(v) == 1 for v in ends.values())
        assert all(ends[f"b-short{i}"][0].HasField("done") for i in range(3))
        assert ends["b-long"][0].error.code == int(RuntimeErrorKind.BACKEND_UNAVAILABLE)
        assert time.monotonic() - sent_at < DRAIN_S + 10
        for o in outs:
            assert o.status is None and o.num_terminal == 1, (o.request_id, o.status)
            if o.request_id.startswith("short"):
                assert o.done is not None and len(o.tokens) == 40, o.request_id
            else:
                assert o.error is not None and o.error.code == int(RuntimeErrorKind.BACKEND_UNAVAILABLE)
                assert "shutting down" in o.error.message


def test_second_signal_ends_every_stream_with_a_terminal_error(tmp_path: Path) -> None:
    """Ctrl-C twice: the drain is cut short, yet no stream ends with CANCELLED or without a terminal event."""
    args = ("--workers", "2", "--step-latency", "0.02", "--drain-timeout", "60")
    with start_fake_engine(tmp_path, *args) as engine:
        outs, threads = _start_streams(engine, [_req(f"c{i}", 1000, i) for i in range(6)])
        proc = engine.engine.popen
        proc.send_signal(signal.SIGINT)
        _wait_not_serving(engine)
        proc.send_signal(signal.SIGINT)
        cut_at = time.monotonic()
        for t in threads:
            t.join(30)
        assert proc.wait(timeout=15) == 0, engine.logs()
        assert time.monotonic() - cut_at < 10  # not the 60 s drain timeout
        for o in outs:
            assert o.status is None and o.num_terminal == 1, (o.request_id, o.status)
            assert o.error is not None and o.error.code == int(RuntimeErrorKind.BACKEND_UNAVAILABLE)
            assert len(o.tokens) < 1000
        assert "Traceback" not in engine.logs()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ominix_worker.testing import write_tiny_hf_model

    return write_tiny_hf_model(
        tmp_path_factory.mktemp("sigterm-model") / "tiny", arch="llama", vocab_size=320
    )


def test_sigterm_real_engine_and_workers_exit_0(tiny_model: Path, tmp_path: Path) -> None:
    with start_engine(str(tiny_model), tmp_path, serve_args=("--drain-timeout", "20")) as engine:
        outs, threads = _start_streams(engine, [_req(f"r{i}", 150, i) for i in range(10)])
        engine.engine.popen.send_signal(signal.SIGTERM)
        _wait_not_serving(engine)
        assert _refused_while_draining(engine) == grpc.StatusCode.UNAVAILABLE
        for t in threads:
            t.join(60)
        assert engine.engine.popen.wait(timeout=30) == 0, engine.logs()
        for o in outs:
            assert o.done is not None and len(o.tokens) == 150, (o.request_id, o.status, o.error)
        codes = stop_procs(engine.workers)
        assert set(codes.values()) == {0}, (codes, engine.logs())
