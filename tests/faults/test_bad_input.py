"""Bad input through real gRPC: each gets its status code and a message, a concurrent good stream is untouched.

One engine process (real front server and engine core, fake workers with 64 KV blocks of 16 tokens, context
2048) serves the whole module; a hypothesis fuzz over GenerateRequest fields runs against it too.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fault_procs import Engine, Outcome, metric_value, start_fake_engine, stream_one
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ominix_runtime.contract import RuntimeErrorKind
from ominix_runtime.pb import common_pb2, engine_pb2

VOCAB = 49152
MAX_MODEL_LEN = 2048
KV_TOKENS = 64 * 16
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
_good_ids = itertools.count()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    logs = tmp_path_factory.mktemp("bad-input")
    args = (
        "--workers",
        "1",
        "--kv-blocks",
        "64",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--step-latency",
        "0.005",
    )
    with start_fake_engine(logs, *args) as running:
        yield running


@pytest.fixture
def good_stream(engine: Engine) -> Iterator[Outcome]:
    """A long request streaming while the bad ones arrive; it must end normally with all its tokens."""
    out = Outcome(f"good-{next(_good_ids)}")
    request = engine_pb2.GenerateRequest(
        request_id=out.request_id,
        input_ids=engine_pb2.TokenIds(ids=list(range(10, 40))),
        sampling=common_pb2.SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
    )
    thread = threading.Thread(target=stream_one, args=(engine.stub, request, 60, out))
    thread.start()
    assert out.first_token.wait(30), engine.logs()
    yield out
    thread.join(60)
    assert not thread.is_alive()
    assert out.status is None and out.num_terminal == 1 and out.done is not None, (out.status, out.error)
    assert len(out.tokens) == 60


def _ids(n: int, value: int = 11) -> engine_pb2.TokenIds:
    return engine_pb2.TokenIds(ids=[value] * n)


def _sp(**fields: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**fields)  # type: ignore[arg-type]  # bad values on purpose


def _chat(*pairs: tuple[str, str]) -> engine_pb2.ChatMessages:
    return engine_pb2.ChatMessages(messages=[engine_pb2.ChatMessage(role=r, content=c) for r, c in pairs])


NAN = math.nan
BAD_INPUTS: list[tuple[str, dict, grpc.StatusCode]] = [
    ("empty prompt", {"prompt": ""}, INVALID),
    ("empty input_ids", {"input_ids": _ids(0)}, INVALID),
    ("no input at all", {}, INVALID),
    ("token id = vocab", {"input_ids": engine_pb2.TokenIds(ids=[5, VOCAB])}, INVALID),
    ("token id far above vocab", {"input_ids": engine_pb2.TokenIds(ids=[2**32 - 1])}, INVALID),
    ("prompt longer than max_model_len", {"input_ids": _ids(MAX_MODEL_LEN + 1)}, INVALID),
    (
        "prompt + max_tokens over max_model_len",
        {"input_ids": _ids(100), "sampling": _sp(max_tokens=2000)},
        INVALID,
    ),
    (
        "prompt + max_tokens over KV capacity",
        {"input_ids": _ids(500), "sampling": _sp(max_tokens=600)},
        EXHAUSTED,
    ),
    ("absurd max_tokens", {"input_ids": _ids(4), "sampling": _sp(max_tokens=2**31)}, INVALID),
    ("negative temperature", {"input_ids": _ids(4), "sampling": _sp(temperature=-0.5)}, INVALID),
    ("NaN temperature", {"input_ids": _ids(4), "sampling": _sp(temperature=NAN)}, INVALID),
    ("infinite temperature", {"input_ids": _ids(4), "sampling": _sp(temperature=math.inf)}, INVALID),
    ("top_p 0", {"input_ids": _ids(4), "sampling": _sp(top_p=0.0)}, INVALID),
    ("top_p above 1", {"input_ids": _ids(4), "sampling": _sp(top_p=1.01)}, INVALID),
    ("NaN top_p", {"input_ids": _ids(4), "sampling": _sp(top_p=NAN)}, INVALID),
    ("negative top_k", {"input_ids": _ids(4), "sampling": _sp(top_k=-5)}, INVALID),
    ("min_p above 1", {"input_ids": _ids(4), "sampling": _sp(min_p=1.5)}, INVALID),
    ("repetition_penalty 0", {"input_ids": _ids(4), "sampling": _sp(repetition_penalty=0.0)}, INVALID),
    ("NaN repetition_penalty", {"input_ids": _ids(4), "sampling": _sp(repetition_penalty=NAN)}, INVALID),
    ("frequency_penalty 3", {"input_ids": _ids(4), "sampling": _sp(frequency_penalty=3.0)}, INVALID),
    ("NaN presence_penalty", {"input_ids": _ids(4), "sampling": _sp(presence_penalty=NAN)}, INVALID),
    ("too many logprobs", {"input_ids": _ids(4), "sampling": _sp(logprobs=10_000)}, INVALID),
    (
        "stop token id outside vocab",
        {"input_ids": _ids(4), "sampling": _sp(stop_token_ids=[VOCAB + 1])},
        INVALID,
    ),
    ("unknown model", {"input_ids": _ids(4), "model": "no-such-model"}, grpc.StatusCode.NOT_FOUND),
    ("empty chat", {"messages": _chat()}, INVALID),
    ("unknown chat role", {"messages": _chat(("wizard", "hi"))}, INVALID),
    ("chat role missing", {"messages": _chat(("", "hi"))}, INVALID),
    ("bad priority", {"input_ids": _ids(4), "priority": 42}, INVALID),
    ("oversized message", {"prompt": "x" * (MAX_MESSAGE_BYTES + 1024)}, EXHAUSTED),
]


@pytest.mark.parametrize(("name", "fields", "code"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_refused_and_a_concurrent_request_is_unaffected(
    engine: Engine, good_stream: Outcome, name: str, fields: dict, code: grpc.StatusCode
) -> None:
    out = stream_one(engine.stub, engine_pb2.GenerateRequest(request_id=f"bad-{name}", **fields), 20)
    assert out.status == code, f"{name}: got {out.status}, error event {out.error}"
    assert out.num_terminal == 0 and not out.tokens


def test_duplicate_request_id_while_live(engine: Engine, good_stream: Outcome) -> None:
    request = engine_pb2.GenerateRequest(request_id=good_stream.request_id, input_ids=_ids(3))
    dup = stream_one(engine.stub, request, 20)
    assert dup.status == grpc.StatusCode.ALREADY_EXISTS


def test_deadline_ends_a_long_request_with_timeout_and_frees_kv(engine: Engine, good_stream: Outcome) -> None:
    request = engine_pb2.GenerateRequest(
        request_id="short-deadline",
        input_ids=_ids(20, 30),
        sampling=_sp(max_tokens=900, ignore_eos=True),
        deadline_ms=300,
    )
    out = stream_one(engine.stub, request, 20)
    assert out.status is None and out.num_terminal == 1
    assert out.error is not None and out.error.code == int(RuntimeErrorKind.TIMEOUT), out.error
    assert 0.25 < out.seconds < 3.0
    assert len(out.tokens) < 900


def test_full_admission_queue_answers_resource_exhausted(tmp_path: Path) -> None:
    """--max-queue-len 4 with one running slot busy: extra requests are refused, never queued."""
    args = ("--workers", "1", "--max-queue-len", "4", "--step-latency", "0.02")
    with start_fake_engine(tmp_path, *args) as small:
        outs = [Outcome(f"q{i}") for i in range(40)]
        threads = [
            threading.Thread(
                target=stream_one,
                args=(
                    small.stub,
                    engine_pb2.GenerateRequest(
                        request_id=f"q{i}",
                        input_ids=_ids(8, 20 + i),
                        sampling=_sp(max_tokens=20, ignore_eos=True),
                    ),
                    60,
                    outs[i],
                ),
            )
            for i in range(40)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        refused = [o for o in outs if o.status == EXHAUSTED]
        served = [o for o in outs if o.done is not None]
        assert len(refused) + len(served) == 40, [(o.status, o.error) for o in outs]
        assert served and refused


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)
@given(
    ids=st.lists(st.integers(0, 2**32 - 1), max_size=8)
    | st.lists(st.integers(0, 300), min_size=1, max_size=8),
    max_tokens=st.integers(0, 2**32 - 1) | st.integers(0, 16),
    temperature=st.none() | st.floats(allow_nan=True, allow_infinity=True, width=32),
    top_p=st.none() | st.floats(allow_nan=True, allow_infinity=True, width=32),
    top_k=st.integers(-(2**31), 2**31 - 1) | st.integers(-2, 50),
    min_p=st.floats(allow_nan=True, allow_infinity=True, width=32),
    penalty=st.none() | st.floats(allow_nan=True, allow_infinity=True, width=32),
    frequency=st.floats(allow_nan=True, allow_infinity=True, width=32),
    logprobs=st.none() | st.integers(0, 2**32 - 1),
    stop=st.lists(st.text(max_size=8), max_size=3),
    priority=st.integers(0, 5),
    deadline_ms=st.integers(0, 2**32 - 1) | st.just(1),
)
def test_fuzz_generate_request_fields(
    engine: Engine,
    ids: list[int],
    max_tokens: int,
    temperature: float | None,
    top_p: float | None,
    top_k: int,
    min_p: float,
    penalty: float | None,
    frequency: float,
    logprobs: int | None,
    stop: list[str],
    priority: int,
    deadline_ms: int,
) -> None:
    """Any field values: either a refusal with a status and a message, or a stream with exactly one end."""
    sampling = _sp(max_tokens=max_tokens, top_k=top_k, min_p=min_p, frequency_penalty=frequency, stop=stop)
    for name, value in (("temperature", temperature), ("top_p", top_p), ("repetition_penalty", penalty)):
        if value is not None:
            setattr(sampling, name, value)
    if logprobs is not None:
        sampling.logprobs = logprobs
    request = engine_pb2.GenerateRequest(
        input_ids=engine_pb2.TokenIds(ids=ids), sampling=sampling, priority=priority, deadline_ms=deadline_ms
    )
    out = stream_one(engine.stub, request, 30)
    if out.status is not None:
        assert out.status in (INVALID, EXHAUSTED, grpc.StatusCode.NOT_FOUND), (out.status, request)
        assert out.num_terminal == 0
    else:
        assert out.num_terminal == 1, request
    assert engine.load().total.kv_bytes_used >= 0


def test_after_everything_the_engine_is_idle_and_consistent(engine: Engine) -> None:
    end = time.monotonic() + 10
    while engine.load().total.kv_bytes_used or engine.load().total.running_requests:
        assert time.monotonic() < end, engine.load()
        time.sleep(0.05)
    assert metric_value(engine.metrics_url, "ominix_integrity_violations_total") == 0
    ok = stream_one(
        engine.stub, engine_pb2.GenerateRequest(input_ids=_ids(5), sampling=_sp(max_tokens=3)), 20
    )
    assert ok.done is not None
