"""Fixtures: one fake-backed engine daemon per module (see server_harness.py), serving its clients itself and
again through two front processes (``--front-procs 2``): the front API must not tell the two apart."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_harness import SMOLLM2_VOCAB, RunningDaemon, start_daemon, stop_daemon

from ominix_runtime.config import FrontConfig
from ominix_runtime.server.logging import configure_logging
from ominix_runtime.testing.fake_backend import FakeConfig


@pytest.fixture(scope="module", params=[0, 2], ids=["in-process", "front-procs"])
def fake_daemon(request: pytest.FixtureRequest) -> Iterator[RunningDaemon]:
    configure_logging("warning", json_output=True)
    running, thread = start_daemon(
        FakeConfig(
            vocab_size=SMOLLM2_VOCAB,
            eos_token_ids=(2,),
            max_model_len=2048,
            kv_num_blocks=64,
            step_latency=0.002,
        ),
        front=FrontConfig(procs=request.param),
    )
    try:
        yield running
    finally:
        stop_daemon(running, thread)
