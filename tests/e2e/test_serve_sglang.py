"""``serve --sglang URL`` with no local model: text prompts go to SGLang as text (fake SGLang server)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import grpc
import pytest
from e2e_procs import CLI, Proc, free_ports, start_proc, stop_procs, wait_health

from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc


@pytest.fixture(scope="module")
def sglang_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("logs-sglang")
    sglang_port, port = free_ports(2)
    procs: list[Proc] = []
    try:
        procs.append(
            start_proc(
                "fake-sglang",
                [sys.executable, "-m", "ominix_runtime.testing.fake_sglang", "--port", str(sglang_port)],
                logs,
            )
        )
        # serve describes its backends at startup: start it once the fake server listens.
        deadline = time.monotonic() + 60
        while "fake SGLang ready" not in procs[0].log_tail():
            assert procs[0].popen.poll() is None and time.monotonic() < deadline, procs[0].log_tail()
            time.sleep(0.05)
        serve = [*CLI, "serve", "--sglang", f"http://127.0.0.1:{sglang_port}", "--port", str(port)]
        procs.append(start_proc("engine", [*serve, "--metrics-port", "0"], logs))
        address = f"127.0.0.1:{port}"
        wait_health(address, procs, timeout=60)
        yield address
    finally:
        stop_procs(procs[::-1])


def _generate(address: str, **fields) -> list[engine_pb2.GenerateEvent]:  # noqa: ANN003
    with grpc.insecure_channel(address) as channel:
        return list(
            engine_pb2_grpc.EngineStub(channel).Generate(engine_pb2.GenerateRequest(**fields), timeout=60)
        )


def test_text_prompt_streams_through_sglang(sglang_daemon: str) -> None:
    events = _generate(sglang_daemon, prompt="hello there", sampling=common_pb2.SamplingParams(max_tokens=6))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "prefill_done" and kinds[-2:] == ["usage", "done"]
    pieces = [e.token.text for e in events if e.HasField("token")]
    # Tokens that queue up while the stream is busy arrive as one chunk (the front coalesces them), so the
    # six tokens' words may come in fewer pieces.
    assert all(p.startswith(" w") for p in pieces) and "".join(pieces).count(" w") == 6
    assert events[-1].done.text == "".join(pieces)
    assert events[-1].done.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_stop_string_on_backend_text(sglang_daemon: str) -> None:
    sampling = common_pb2.SamplingParams(max_tokens=8, temperature=0.0)
    full = _generate(sglang_daemon, prompt="stop test", sampling=sampling)[-1].done.text
    words = full.split(" ")[1:]  # " wA wB ..." -> ["wA", "wB", ...]
    stop = f"{words[2][-1]} {words[3][:2]}"  # spans the boundary between the third and fourth token
    sampling.stop.append(stop)
    events = _generate(sglang_daemon, prompt="stop test", sampling=sampling)
    done = events[-1].done
    assert done.finish_reason == common_pb2.FINISH_REASON_STOP and done.matched_stop == stop
    assert done.text == full[: full.find(stop)]
    assert "".join(e.token.text for e in events if e.HasField("token")) == done.text


def test_chat_needs_a_local_tokenizer(sglang_daemon: str) -> None:
    messages = engine_pb2.ChatMessages(messages=[engine_pb2.ChatMessage(role="user", content="hi")])
    with pytest.raises(grpc.RpcError) as info:
        _generate(sglang_daemon, messages=messages)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
