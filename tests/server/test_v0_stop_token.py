"""The ``ominix.worker.v0`` front over the fake step backend and the embedded model's tokenizer: a
stop_token_ids entry that is an ordinary word token ends the output without its text, as on the gRPC front
(both stream what the engine's output text releases)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from server_harness import SMOLLM2_VOCAB, RunningDaemon, start_daemon, stop_daemon

from ominix_runtime.config import V0FrontConfig
from ominix_runtime.testing.fake_backend import FakeConfig

TOKEN = "v0-stop-token"
PROMPT_IDS = [504, 2644, 2643, 335]  # "The cat sat on"


@pytest.fixture(scope="module")
def v0_daemon() -> Iterator[RunningDaemon]:
    running, thread = start_daemon(
        FakeConfig(vocab_size=SMOLLM2_VOCAB, eos_token_ids=(2,), max_model_len=2048, kv_num_blocks=64),
        v0=V0FrontConfig(port=0, token=TOKEN),
    )
    try:
        yield running
    finally:
        stop_daemon(running, thread)


def generate(daemon: RunningDaemon, sampling: dict[str, Any]) -> list[dict[str, Any]]:
    """The records of one greedy generation (the v0 default temperature is 0)."""
    front = daemon.daemon.v0_front
    assert front is not None
    request = {
        "protocol_version": "ominix.worker.v0",
        "message_type": "GenerateRequest",
        "input": {"kind": "tokens", "tokens": PROMPT_IDS},
        "sampling": sampling,
        "stream": True,
    }
    http = urllib.request.Request(
        f"http://127.0.0.1:{front.port}/generate",
        data=json.dumps(request).encode(),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(http, timeout=30) as resp:
        raw = resp.read()
    frames = [f.removeprefix(b"data: ") for f in raw.split(b"\n\n") if f]
    assert frames[-1] == b"[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def token_ids(records: list[dict[str, Any]]) -> list[int]:
    return [t for r in records if r["kind"] == "token" for t in r["token_ids"]]


def text(records: list[dict[str, Any]]) -> str:
    return "".join(r.get("text_delta", "") for r in records if r["kind"] == "token")


def test_a_stop_token_id_ends_the_output_without_its_text(v0_daemon: RunningDaemon) -> None:
    ids = token_ids(generate(v0_daemon, {"max_new_tokens": 40}))
    for k in range(3, len(ids)):
        if ids[k] in ids[:k]:
            continue  # it would stop earlier
        before = text(generate(v0_daemon, {"max_new_tokens": k}))
        through = text(generate(v0_daemon, {"max_new_tokens": k + 1}))
        if len(through) > len(before) and through.startswith(before) and "\ufffd" not in through:
            break  # ids[k] is a token with text of its own
    else:
        pytest.fail(f"no first-seen token with text of its own in {ids}")
    records = generate(v0_daemon, {"max_new_tokens": 40, "stop_token_ids": [ids[k]]})
    assert token_ids(records) == ids[: k + 1]  # the stop token is still an output token
    assert text(records) == before  # its text is not
    done = records[-1]
    assert done["kind"] == "done" and done["finish_reason"] == "stop" and "matched_stop" not in done
    (usage,) = [r for r in records if r["kind"] == "usage"]
    assert usage["usage"]["completion_tokens"] == k + 1
