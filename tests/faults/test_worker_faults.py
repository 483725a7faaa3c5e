"""kill -9 and SIGSTOP of a real CPU worker while requests stream through a real `serve` engine."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fault_procs import Engine, Outcome, start_engine, stream_one
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ominix_runtime.contract import RuntimeErrorKind
from ominix_runtime.pb import common_pb2, engine_pb2

DETECT_WITHIN_S = 5.0  # the default --worker-heartbeat-timeout (3 s) plus a margin for a loaded machine
NUM_STREAMS = 20
MAX_TOKENS = 300
DEADLINE_MS = 60_000


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ominix_worker.testing import write_tiny_hf_model

    return write_tiny_hf_model(tmp_path_factory.mktemp("faults-model") / "tiny", arch="llama", vocab_size=320)


def _request(rid: str, i: int, max_tokens: int = MAX_TOKENS) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=rid,
        input_ids=engine_pb2.TokenIds(ids=[3 + (i * 11 + k) % 250 for k in range(12 + i % 7)]),
        sampling=common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.8, seed=1000 + i, ignore_eos=True
        ),
        deadline_ms=DEADLINE_MS,
    )


def _wait_for(predicate, timeout: float, what: str, engine: Engine) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"{what} not reached within {timeout:.0f}s\n{engine.logs()}")
        time.sleep(0.05)


def _backend(engine: Engine, i: int) -> engine_pb2.BackendLoad:
    address = engine.worker_addresses[i]
    return next(b for b in engine.load().backends if b.worker_id.endswith(address))


def _health(engine: Engine) -> int:
    return health_pb2_grpc.HealthStub(engine.channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _check_outcomes(outcomes: list, engine: Engine) -> tuple[int, int]:
    completed = failed = 0
    for out in outcomes:
        assert out.status is None, f"{out.request_id}: RPC failed with {out.status}\n{engine.logs()}"
        assert out.num_terminal == 1, f"{out.request_id}: {out.num_terminal} terminal events"
        assert out.seconds < DEADLINE_MS / 1000
        if out.done is not None:
            assert len(out.tokens) == MAX_TOKENS
            completed += 1
        else:
            assert out.error.code == int(RuntimeErrorKind.BACKEND_UNAVAILABLE), out.error
            failed += 1
    return completed, failed


def test_kill_9_one_of_two_workers_while_20_requests_stream(tiny_model: Path, tmp_path: Path) -> None:
    with start_engine(str(tiny_model), tmp_path) as engine:
        # Reference: the same seeded requests on a healthy pair, to compare the resumed streams with.
        with ThreadPoolExecutor(NUM_STREAMS) as pool:
            reference = list(
                pool.map(lambda i: stream_one(engine.stub, _request(f"ref{i}", i), 60), range(NUM_STREAMS))
            )
        assert all(r.done is not None for r in reference), engine.logs()
        with ThreadPoolExecutor(NUM_STREAMS) as pool:
            live = [Outcome(f"k{i}") for i in range(NUM_STREAMS)]
            futures = [
                pool.submit(stream_one, engine.stub, _request(f"k{i}", i), 90, live[i])
                for i in range(NUM_STREAMS)
            ]
            # Kill once the victim is computing requests and streams have tokens (those must resume).
            _wait_for(
                lambda: (
                    sum(o.first_token.is_set() for o in live) >= 5
                    and _backend(engine, 0).running_requests > 0
                ),
                30,
                "victim busy",
                engine,
            )
            os.kill(engine.workers[0].popen.pid, signal.SIGKILL)
            outcomes = [f.result(timeout=120) for f in futures]
        completed, failed = _check_outcomes(outcomes, engine)
        # With a survivor every request completes, and a resumed stream equals its undisturbed reference.
        assert failed == 0 and completed == NUM_STREAMS
        for ref, out in zip(reference, outcomes, strict=True):
            assert out.tokens == ref.tokens, out.request_id
        _wait_for(lambda: _backend(engine, 1).kv_bytes_used == 0, 10, "survivor KV freed", engine)
        assert _health(engine) == health_pb2.HealthCheckResponse.SERVING  # one worker still serves
        assert not _backend(engine, 0).healthy, engine.logs()
        after = stream_one(engine.stub, _request("after", 3, max_tokens=8), 60)
        assert after.done is not None and len(after.tokens) == 8


def test_sigstopped_worker_of_two_is_detected_within_5s(tiny_model: Path, tmp_path: Path) -> None:
    """A stopped process sends no heartbeats: with default flags the engine marks it unhealthy within 5 s,
    its streams resume on the other worker, and new requests complete there while it stays stopped."""
    with start_engine(str(tiny_model), tmp_path) as engine:
        victim = engine.workers[1].popen.pid
        with ThreadPoolExecutor(8) as pool:
            live = [Outcome(f"s{i}") for i in range(8)]
            futures = [
                pool.submit(stream_one, engine.stub, _request(f"s{i}", i), 90, live[i]) for i in range(8)
            ]
            _wait_for(
                lambda: (
                    any(o.first_token.is_set() for o in live) and _backend(engine, 1).running_requests > 0
                ),
                30,
                "victim busy",
                engine,
            )
            os.kill(victim, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                _wait_for(
                    lambda: not _backend(engine, 1).healthy, DETECT_WITHIN_S + 5, "hang detected", engine
                )
                detected_after = time.monotonic() - stopped_at
                outcomes = [f.result(timeout=90) for f in futures]
                # Still stopped: new requests are routed to the other worker and complete.
                fresh = [stream_one(engine.stub, _request(f"n{i}", i, max_tokens=16), 60) for i in range(4)]
                assert not _backend(engine, 1).healthy
            finally:
                os.kill(victim, signal.SIGCONT)
        assert detected_after < DETECT_WITHIN_S, f"detected after {detected_after:.1f}s"
        completed, failed = _check_outcomes(outcomes, engine)
        assert completed == 8 and failed == 0
        assert all(f.done is not None and len(f.tokens) == 16 for f in fresh), [f.status for f in fresh]
        # The worker lives on after SIGCONT: the engine reconnects to it.
        _wait_for(lambda: _backend(engine, 1).healthy, 30, "reconnect", engine)
        after = stream_one(engine.stub, _request("after", 5, max_tokens=8), 60)
        assert after.done is not None
        assert _backend(engine, 0).kv_bytes_used == _backend(engine, 1).kv_bytes_used == 0
