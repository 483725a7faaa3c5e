"""One engine in front of a CPU worker (the embedded SmolLM2) and an SGLang server (fake) at once."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import grpc
import pytest
from e2e_procs import CLI, Proc, free_ports, start_proc, start_workers, stop_procs, wait_health

from ominix_runtime.models import DEFAULT_MODEL_NAME
from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc

SGLANG_MODEL = "fake/sglang-model"


@pytest.fixture(scope="module")
def mixed_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("logs-mixed")
    sglang_port, port = free_ports(2)
    procs: list[Proc] = []
    try:
        fake = [sys.executable, "-m", "ominix_runtime.testing.fake_sglang", "--port", str(sglang_port)]
        procs.append(start_proc("fake-sglang", [*fake, "--model-path", SGLANG_MODEL], logs))
        workers, addresses = start_workers("", 1, logs, "64MiB")
        procs += workers
        deadline = time.monotonic() + 60
        while "fake SGLang ready" not in procs[0].log_tail():
            assert procs[0].popen.poll() is None and time.monotonic() < deadline, procs[0].log_tail()
            time.sleep(0.05)
        serve = [*CLI, "serve", "--worker", addresses[0], "--sglang", f"http://127.0.0.1:{sglang_port}"]
        procs.append(start_proc("engine", [*serve, "--port", str(port), "--metrics-port", "0"], logs))
        address = f"127.0.0.1:{port}"
        wait_health(address, procs)
        yield address
    finally:
        stop_procs(procs[::-1])


def _generate(address: str, **fields: object) -> list[engine_pb2.GenerateEvent]:
    with grpc.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        return list(stub.Generate(engine_pb2.GenerateRequest(**fields), timeout=120))


def test_both_backends_are_listed(mixed_daemon: str) -> None:
    with grpc.insecure_channel(mixed_daemon) as channel:
        backends = engine_pb2_grpc.EngineStub(channel).ListBackends(engine_pb2.ListBackendsRequest()).backends
    kinds = {b.model.name: b.granularity for b in backends}
    assert kinds == {
        DEFAULT_MODEL_NAME: common_pb2.GRANULARITY_STEP,
        SGLANG_MODEL: common_pb2.GRANULARITY_REQUEST,
    }


def test_requests_are_served_by_each_backend(mixed_daemon: str) -> None:
    sampling = common_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    local = _generate(mixed_daemon, prompt="The capital of France is", sampling=sampling)
    remote = _generate(mixed_daemon, model=SGLANG_MODEL, prompt="The capital of France is", sampling=sampling)
    for events in (local, remote):
        kinds = [e.WhichOneof("event") for e in events]
        assert kinds[0] == "prefill_done" and kinds[-2:] == ["usage", "done"], kinds
        assert events[-1].done.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert events[-2].usage.completion_tokens == 6
    # The fake SGLang server's text is " w<id>" per token; the local model produces real words.
    remote_pieces = [e.token.text for e in remote if e.HasField("token")]
    assert remote_pieces and all(p.startswith(" w") for p in remote_pieces)
    assert remote[-1].done.text == "".join(remote_pieces)
    local_text = local[-1].done.text
    assert local_text and " w" not in local_text
    with grpc.insecure_channel(mixed_daemon) as channel:
        stats = engine_pb2_grpc.EngineStub(channel).GetStats(engine_pb2.GetStatsRequest())
    assert stats.requests_finished >= 2


def test_unknown_model_lists_what_is_served(mixed_daemon: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _generate(mixed_daemon, model="nope", prompt="hi")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert SGLANG_MODEL in info.value.details() and DEFAULT_MODEL_NAME in info.value.details()
