"""The daemon refuses, at startup, backends that cannot serve the configured model together."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
from server_harness import SMOLLM2_VOCAB

from ominix_runtime.bind_probe import free_port
from ominix_runtime.config import LogConfig, RuntimeConfig, ServerConfig
from ominix_runtime.contract import OminixError, RuntimeErrorKind
from ominix_runtime.models import DEFAULT_MODEL_NAME
from ominix_runtime.server.app import EngineDaemon
from ominix_runtime.testing.fake_backend import FakeConfig, FakeStepBackend


def _start(*fakes: FakeConfig) -> OminixError | None:
    backends = [FakeStepBackend(f) for f in fakes]
    daemon = EngineDaemon(
        RuntimeConfig(
            server=ServerConfig(port=free_port(), metrics_port=0, drain_timeout=1.0),
            log=LogConfig(format="json"),
        ),
        backends=backends,
    )

    async def main() -> OminixError | None:
        try:
            await daemon.start()
        except OminixError as exc:
            return exc
        finally:
            await daemon.shutdown()
        return None

    error = asyncio.run(asyncio.wait_for(main(), 60))
    if error is not None:  # refused before any worker's Run stream was opened
        assert [b.num_streams_opened for b in backends] == [0] * len(backends)
    return error


def _fake(worker_id: str, **overrides: Any) -> FakeConfig:
    config = FakeConfig(worker_id=worker_id, vocab_size=SMOLLM2_VOCAB, model_name=DEFAULT_MODEL_NAME)
    return replace(config, **overrides)


def test_matching_workers_start() -> None:
    assert _start(_fake("a"), _fake("b")) is None


@pytest.mark.parametrize(
    ("second", "needle"),
    [
        (_fake("b", model_name="another-model"), "model mismatch"),
        (_fake("b", kv_block_size=32), "kv_block_size mismatch"),
    ],
)
def test_mismatched_workers_are_refused(second: FakeConfig, needle: str) -> None:
    error = _start(_fake("a"), second)
    assert error is not None and error.kind == RuntimeErrorKind.CAPABILITY_MISMATCH
    assert needle in error.message


def test_a_worker_with_a_smaller_vocabulary_than_the_tokenizer_is_refused() -> None:
    error = _start(_fake("a", vocab_size=1000))
    assert error is not None and error.kind == RuntimeErrorKind.CAPABILITY_MISMATCH
    assert "vocabulary" in error.message
