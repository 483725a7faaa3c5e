"""min_tokens holds stop strings back, as vLLM does: a stop string in the text of the first min_tokens
tokens does not end the request; the same string after them does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_harness import SMOLLM2_VOCAB, RunningDaemon, start_daemon, stop_daemon

from ominix_runtime.config import FrontConfig
from ominix_runtime.pb import common_pb2, engine_pb2
from ominix_runtime.testing.fake_backend import FakeConfig


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    running, thread = start_daemon(
        FakeConfig(vocab_size=SMOLLM2_VOCAB, eos_token_ids=(2,), max_model_len=2048, kv_num_blocks=64),
        front=FrontConfig(procs=0),
    )
    try:
        yield running
    finally:
        stop_daemon(running, thread)


def _generate(daemon: RunningDaemon, **sampling: object) -> tuple[str, int, str, str]:
    pb = engine_pb2.GenerateRequest(
        input_ids=engine_pb2.TokenIds(ids=[11, 12, 13]),
        sampling=common_pb2.SamplingParams(temperature=0.0, ignore_eos=True, **sampling),
    )
    events = list(daemon.stub.Generate(pb, timeout=30))
    usage = next(e.usage for e in events if e.HasField("usage"))
    done = events[-1].done
    text = "".join(e.token.text for e in events if e.HasField("token"))
    return text, usage.completion_tokens, done.matched_stop, common_pb2.FinishReason.Name(done.finish_reason)


def test_stop_string_waits_for_min_tokens(daemon: RunningDaemon) -> None:
    full, n, _, _ = _generate(daemon, max_tokens=12)
    assert n == 12 and full
    stop = next(ch for ch in full if not ch.isspace())  # a character of the first token(s)' text
    min_tokens = 8
    text, n, matched, reason = _generate(daemon, max_tokens=12, min_tokens=min_tokens, stop=[stop])
    assert n >= min_tokens, (
        f"min_tokens={min_tokens} but the request ended after {n} token(s) on stop string {matched!r} "
        f"({reason}); text {text!r}; unstopped text {full!r}"
    )
