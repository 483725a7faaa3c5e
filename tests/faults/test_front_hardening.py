"""A hostile client against the front API of a real engine process (fake workers, the embedded model's
tokenizer): huge prompts neither stall other streams nor bloat the engine, request ids stay small, bytes that
do not decode are INVALID_ARGUMENT, and every refusal has a status and a message.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from fault_procs import CLI, Engine, Outcome, free_ports, rss_bytes, start_fake_engine, stream_one
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ominix_runtime.pb import common_pb2, engine_pb2

MAX_MODEL_LEN = 8192
INVALID = grpc.StatusCode.INVALID_ARGUMENT
HUGE_PROMPT_BYTES = 3_900_000  # just under the 4 MiB message limit
# Text the tokenizer needs a while for but the cheap check lets through (the embedded vocabulary's longest
# token has 81 characters: 8192 x 81 characters could still fit in the context).
NEAR_LIMIT_TEXT = "The quick brown fox jumps over the lazy dog; 12 + 30 = 42. " * 10_000  # 590k characters
GENERATE = "/ominix.runtime.v1.Engine/Generate"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    logs = tmp_path_factory.mktemp("front-hardening")
    args = ("--workers", "1", "--kv-blocks", "1024", "--max-model-len", str(MAX_MODEL_LEN))
    with start_fake_engine(logs, *args, "--step-latency", "0.005") as running:
        yield running


@dataclass
class TimedStream:
    """A streamed request with the arrival time of each token event."""

    request_id: str
    token_times: list[float] = field(default_factory=list)
    outcome: Outcome | None = None
    first_token: threading.Event = field(default_factory=threading.Event)

    def largest_gap(self) -> float:
        times = self.token_times
        return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


def _stream_timed(engine: Engine, out: TimedStream, max_tokens: int) -> None:
    request = engine_pb2.GenerateRequest(
        request_id=out.request_id,
        input_ids=engine_pb2.TokenIds(ids=list(range(100, 120))),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    result = Outcome(out.request_id)
    try:
        for ev in engine.stub.Generate(request, timeout=120):
            kind = ev.WhichOneof("event")
            if kind == "token":
                out.token_times.append(time.monotonic())
                result.tokens += list(ev.token.token_ids)
                out.first_token.set()
            elif kind in ("done", "error"):
                result.num_terminal += 1
                result.done = ev.done if kind == "done" else None
    except grpc.RpcError as exc:
        result.status = exc.code()  # type: ignore[attr-defined]  # a failed call's RpcError is a grpc.Call
    out.outcome = result


def _prompt(text: str, rid: str = "") -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=rid, prompt=text, sampling=common_pb2.SamplingParams(max_tokens=4)
    )


def _chat(content: str) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        messages=engine_pb2.ChatMessages(messages=[engine_pb2.ChatMessage(role="user", content=content)]),
        sampling=common_pb2.SamplingParams(max_tokens=4),
    )


def test_huge_prompts_leave_a_live_stream_flowing(engine: Engine) -> None:
    """A 3.9 MB prompt, and prompts the tokenizer takes a while for, arrive during a stream: its largest
    gap between tokens stays under 0.5 s, and each of them gets INVALID_ARGUMENT naming the limit."""
    live = TimedStream("live-during-huge")
    thread = threading.Thread(target=_stream_timed, args=(engine, live, 1200))
    thread.start()
    assert live.first_token.wait(30), engine.logs()
    time.sleep(0.2)
    huge = stream_one(engine.stub, _prompt("x" * HUGE_PROMPT_BYTES), 30)
    long_prompt = stream_one(engine.stub, _prompt(NEAR_LIMIT_TEXT), 30)
    long_chat = stream_one(engine.stub, _chat(NEAR_LIMIT_TEXT), 30)
    huge_chat = stream_one(engine.stub, _chat("y" * HUGE_PROMPT_BYTES), 30)
    thread.join(120)
    assert (huge.status, long_prompt.status, long_chat.status, huge_chat.status) == (INVALID,) * 4
    assert live.outcome is not None and live.outcome.status is None and live.outcome.num_terminal == 1
    assert len(live.outcome.tokens) == 1200
    assert live.largest_gap() < 0.5, f"largest inter-token gap {live.largest_gap():.3f} s"


def settled_rss(pid: int, seconds: float = 2.0) -> int:
    """The lowest RSS over ``seconds``: the engine hands a large request's memory back (malloc_trim) in an
    executor after the call has ended, so a reading taken as the call returns can still hold it."""
    lowest = rss_bytes(pid)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.1)
        lowest = min(lowest, rss_bytes(pid))
    return lowest


def test_oversized_prompts_leave_engine_memory_bounded(engine: Engine) -> None:
    """Three rounds of 50 prompts of 3.9 MB and 10 the tokenizer must read end to end, each round 234 MB
    through the engine. Its RSS after a round moves between +40 and +180 MiB with no trend (the allocators
    keep some of it for a while and hand it back later; measured on the 2-core box), so the check is that of
    a leak of the prompts: every reading stays within 256 MiB of the start (one round's prompts kept would
    pass it), and one comes back within 128 MiB."""
    pid = engine.engine.popen.pid
    for text in ("hello", "x" * HUGE_PROMPT_BYTES, NEAR_LIMIT_TEXT):  # warm every path once
        stream_one(engine.stub, _prompt(text), 30)
    baseline = settled_rss(pid)
    grown = []
    for _ in range(3):
        for i in range(50):
            out = stream_one(engine.stub, _prompt(chr(ord("a") + i % 26) * HUGE_PROMPT_BYTES), 30)
            assert out.status == INVALID, out.status
        for _ in range(10):
            assert stream_one(engine.stub, _prompt(NEAR_LIMIT_TEXT), 30).status == INVALID
        grown.append((settled_rss(pid) - baseline) / 2**20)
    assert max(grown) < 256, f"engine RSS grew by {grown} MiB after each round"
    assert min(grown) < 128, f"engine RSS grew by {grown} MiB after each round"
    ok = stream_one(engine.stub, _prompt("Still serving?"), 30)
    assert ok.num_terminal == 1


@pytest.mark.parametrize(
    "request_id",
    ["r" * 257, "x" * 2_000_000, "tab\there", "new\nline", "café", "\x00"],
    ids=["257 bytes", "2 MB", "tab", "newline", "non-ASCII", "NUL"],
)
def test_request_id_must_be_short_printable_ascii(engine: Engine, request_id: str) -> None:
    out = stream_one(engine.stub, engine_pb2.GenerateRequest(request_id=request_id, prompt="hi"), 30)
    assert out.status == INVALID and out.num_terminal == 0
    with pytest.raises(grpc.RpcError) as err:
        engine.stub.Abort(engine_pb2.AbortRequest(request_id=request_id), timeout=10)
    assert err.value.code() == INVALID  # type: ignore[attr-defined]  # a failed call's RpcError is a grpc.Call


def test_request_id_of_256_printable_bytes_is_fine(engine: Engine) -> None:
    rid = "".join(chr(32 + i % 95) for i in range(256))
    out = stream_one(engine.stub, _prompt("Hello", rid), 30)
    assert out.status is None and out.num_terminal == 1


def _raw_generate(
    engine: Engine, data: bytes, timeout: float = 30
) -> tuple[grpc.StatusCode | None, str, int]:
    """Send raw bytes as a GenerateRequest: (status or None, details, terminal events seen)."""
    call = engine.channel.unary_stream(GENERATE, response_deserializer=engine_pb2.GenerateEvent.FromString)
    terminal = 0
    try:
        for ev in call(data, timeout=timeout):
            terminal += ev.WhichOneof("event") in ("done", "error")
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", terminal  # type: ignore[attr-defined]  # a failed call's RpcError is a grpc.Call
    return None, "", terminal


def test_invalid_utf8_and_corrupt_bytes_are_invalid_argument(engine: Engine) -> None:
    invalid_utf8 = b"\x1a\x02\xff\xfe"  # field 3 (prompt), 2 bytes that are not UTF-8
    truncated = _prompt("hello").SerializeToString()[:-2]
    bad_id = b"\x0a\x03\xc3\x28\x41" + _prompt("hi").SerializeToString()  # request_id: invalid UTF-8
    for data in (invalid_utf8, truncated, bad_id, b"\xff\xff\xff\xff"):
        status, details, terminal = _raw_generate(engine, data)
        assert status == INVALID, (data, status, details)
        assert "does not decode" in details and terminal == 0


# A valid request the fuzzed bytes are spliced into; a trailing sampling message keeps accepted requests short
# (protobuf merges repeated sub-messages, the last max_tokens wins).
_PREFIX = engine_pb2.GenerateRequest(input_ids=engine_pb2.TokenIds(ids=[5, 6, 7])).SerializeToString()
_SUFFIX = engine_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=3)).SerializeToString()
_ALLOWED = {
    INVALID,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
}


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)
@given(
    noise=st.binary(max_size=64),
    where=st.sampled_from(["alone", "after", "inside"]),
    cut=st.integers(0, len(_PREFIX)),
)
def test_fuzz_raw_generate_request_bytes(engine: Engine, noise: bytes, where: str, cut: int) -> None:
    """Any bytes: a refusal with a status and a message, or a stream with exactly one terminal event."""
    data = {
        "alone": noise,
        "after": _PREFIX + noise + _SUFFIX,
        "inside": _PREFIX[:cut] + noise + _PREFIX[cut:] + _SUFFIX,
    }[where]
    status, details, terminal = _raw_generate(engine, data)
    if status is None:
        assert terminal == 1, data
    else:
        assert status in _ALLOWED, (data, status, details)
        assert details and terminal == 0


def test_max_message_bytes_zero_is_refused_at_startup(tmp_path: Path) -> None:
    port, metrics = free_ports(2)
    argv = [*CLI, "serve", "--worker", "127.0.0.1:1", "--port", str(port), "--metrics-port", str(metrics)]
    result = subprocess.run(
        [*argv, "--max-message-bytes", "0"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 1, result.stderr
    assert "--max-message-bytes" in result.stderr and "Traceback" not in result.stderr


_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "system\n", "\ue000", "\ue0000\ue001"]
_chat_text = st.lists(st.one_of(st.sampled_from(_SPECIALS), st.text(max_size=10)), max_size=6).map("".join)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)
@given(
    turns=st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant", "tool", "", "root"]), _chat_text),
        max_size=4,
    )
)
def test_fuzz_chat_messages_with_special_tokens(engine: Engine, turns: list[tuple[str, str]]) -> None:
    """Chat turns full of special-token strings: a refusal with a status and a message, or one terminal."""
    request = engine_pb2.GenerateRequest(
        messages=engine_pb2.ChatMessages(
            messages=[engine_pb2.ChatMessage(role=r, content=c) for r, c in turns]
        ),
        sampling=common_pb2.SamplingParams(max_tokens=2),
    )
    out = stream_one(engine.stub, request, 30)
    if out.status is not None:
        assert out.status in _ALLOWED and out.num_terminal == 0, out.status
    else:
        assert out.num_terminal == 1
