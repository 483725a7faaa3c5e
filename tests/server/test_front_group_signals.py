"""``--front-procs``: a signal to the whole process group (Ctrl-C, ``kill -- -PGID``, ``systemctl stop`` with
KillMode=control-group) reaches the front processes as well as the engine process. The engine process leads
the shutdown: a front ignores SIGTERM and SIGINT and serves its streams until the engine says stop, so the
streams get the drain (--drain-timeout) and one terminal event each, never a cut connection.

The engine runs in this process (server_harness.py: its SIGTERM handler is ``EngineDaemon.on_signal``); the
fronts are real processes that get real signals.
"""

from __future__ import annotations

import os
import signal
import time

from server_harness import (
    SMOLLM2_VOCAB,
    RunningDaemon,
    StreamReader,
    start_daemon,
    stop_daemon,
    token_request,
)

from ominix_runtime.config import FrontConfig
from ominix_runtime.pb import common_pb2
from ominix_runtime.server.logging import configure_logging
from ominix_runtime.testing.fake_backend import FakeConfig

STEP_S = 0.004  # one token per request per step: 3000 tokens take ~12 s, longer than the harness's drain


def _fake() -> FakeConfig:
    return FakeConfig(
        vocab_size=SMOLLM2_VOCAB,
        eos_token_ids=(2,),
        max_model_len=4096,
        kv_num_blocks=512,
        step_latency=STEP_S,
    )


def _front_pids(daemon: RunningDaemon) -> list[int]:
    return list(daemon.call(daemon.daemon.front_pids))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie child of this process counts as gone
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _signal_all(pids: list[int], *signals: signal.Signals) -> None:
    for pid in pids:
        for sig in signals:
            os.kill(pid, sig)


def _signals_alone_stop_no_front(running: RunningDaemon, pids: list[int]) -> None:
    """SIGTERM and SIGINT that reach the fronts but not the engine process: the fronts serve on."""
    _signal_all(pids, signal.SIGTERM, signal.SIGINT)
    time.sleep(2.0)  # an idle front that acted on SIGTERM was gone well within this
    assert all(_alive(pid) for pid in pids), "a front stopped on a signal the engine process did not get"
    assert _front_pids(running) == pids  # the same processes: none exited and was started again
    events = list(running.stub.Generate(token_request("after-signals", 8), timeout=30))
    assert events[-1].HasField("done")


def _group_sigterm_drains_the_streams(running: RunningDaemon, pids: list[int]) -> None:
    """SIGTERM to the fronts and the engine process at once: every stream gets the drain, then one terminal
    event; the engine stops its fronts when the drain is over."""
    drain = running.daemon.config.server.drain_timeout
    streams = [StreamReader(running.address, f"group-term-{i}", 3000) for i in range(6)]
    for s in streams:
        assert s.first_token.wait(30)
    signalled = time.monotonic()
    _signal_all(pids, signal.SIGTERM)
    running.loop.call_soon_threadsafe(running.daemon.on_signal)  # the engine process's SIGTERM handler
    for s in streams:
        s.join()
    for s in streams:
        # Cut by a front that stopped on its own: UNAVAILABLE after ~4 s and no terminal event.
        assert s.error is None, s.error
        assert s.terminals() == ["error"]
        assert s.events[-1].error.code == common_pb2.ERROR_CODE_BACKEND_UNAVAILABLE
        assert s.ended_at - signalled >= drain - 0.5, "the stream did not get the drain"


def test_a_group_signal_reaches_the_fronts_and_the_engine_process_leads_the_shutdown() -> None:
    configure_logging("warning", json_output=True)
    running, thread = start_daemon(_fake(), front=FrontConfig(procs=2))
    try:
        pids = _front_pids(running)
        assert len(pids) == 2
        _signals_alone_stop_no_front(running, pids)
        _group_sigterm_drains_the_streams(running, pids)
        thread.join(30)
        assert not thread.is_alive(), "the engine did not stop"
    finally:
        stop_daemon(running, thread)
    assert not any(_alive(pid) for pid in pids), "a front outlived the engine's shutdown"
