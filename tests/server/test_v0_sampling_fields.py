"""The v0 front refuses a sampling value its wire type cannot hold, or a sampling field it does not implement,
with a 400 naming the request's field, and reads seed -1 as "no seed" (vLLM's and SGLang's spelling)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from server_harness import SMOLLM2_VOCAB, RunningDaemon, start_daemon, stop_daemon

from ominix_runtime.config import FrontConfig, V0FrontConfig
from ominix_runtime.testing.fake_backend import FakeConfig

TOKEN = "v0-sampling-fields"


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    running, thread = start_daemon(
        FakeConfig(vocab_size=SMOLLM2_VOCAB, eos_token_ids=(2,), max_model_len=2048, kv_num_blocks=64),
        front=FrontConfig(procs=0),
        v0=V0FrontConfig(port=0, token=TOKEN),
    )
    try:
        yield running
    finally:
        stop_daemon(running, thread)


def _v0(daemon: RunningDaemon, sampling: dict[str, object]) -> tuple[int, bytes]:
    body = json.dumps(
        {"input": {"kind": "tokens", "tokens": [11, 12]}, "sampling": {"max_new_tokens": 2, **sampling}}
    )
    req = urllib.request.Request(
        f"http://127.0.0.1:{daemon.daemon.v0_front.port}/generate",
        data=body.encode(),
        method="POST",
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_tokens": -1}, "sampling.min_tokens"),
        ({"max_new_tokens": None, "max_tokens": 0}, "sampling.max_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"top_k": 2**40}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"n": 2}, "sampling.n"),
        ({"logit_bias": {"11": 100}}, "logit_bias"),
    ],
)
def test_out_of_range_value_names_its_field(
    daemon: RunningDaemon, sampling: dict[str, object], field: str
) -> None:
    status, body = _v0(daemon, sampling)
    message = json.loads(body)["error"]["message"]
    assert status == 400 and field in message, (status, message)


def test_seed_minus_one_means_unseeded_as_in_vllm(daemon: RunningDaemon) -> None:
    status, body = _v0(daemon, {"seed": -1, "temperature": 1.0})
    assert status == 200, (status, body[:200])


def test_vllms_min_tokens_reaches_the_engine_as_min_new_tokens(daemon: RunningDaemon) -> None:
    """The engine checks it: more than max_new_tokens is refused there, naming min_tokens."""
    status, body = _v0(daemon, {"min_tokens": 5, "max_new_tokens": 2})
    message = json.loads(body)["error"]["message"]
    assert status == 400 and "min_tokens must be in [0, max_tokens]" in message, (status, message)
    assert _v0(daemon, {"min_tokens": 2, "max_new_tokens": 2})[0] == 200
