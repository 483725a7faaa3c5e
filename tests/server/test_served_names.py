"""Served model names (finding 7): the model's own name, --served-model-name aliases, `generate --model NAME`,
and the typed client (sync and asyncio) against a real daemon."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from server_harness import SMOLLM2_VOCAB, RunningDaemon, start_daemon, stop_daemon

from ominix_runtime.cli import main
from ominix_runtime.cli.generate import model_name
from ominix_runtime.client import AsyncEngineClient, ClientOptions, EngineClient, generate_request
from ominix_runtime.config import FrontConfig, ModelConfig
from ominix_runtime.models import DEFAULT_MODEL_NAME, embedded_model_path, resolve_model
from ominix_runtime.server.logging import configure_logging
from ominix_runtime.testing.fake_backend import FakeConfig


def _gguf_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _write_gguf_header(path: Path, name: str) -> None:
    """A GGUF header (version 3, no tensors) with an array before general.name, as real files have."""
    kvs = [
        _gguf_string("general.architecture") + struct.pack("<I", 8) + _gguf_string("llama"),
        _gguf_string("general.tags") + struct.pack("<IIQ", 9, 8, 2) + _gguf_string("a") + _gguf_string("b"),
        _gguf_string("llama.block_count") + struct.pack("<II", 4, 2),
        _gguf_string("general.name") + struct.pack("<I", 8) + _gguf_string(name),
    ]
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs))


def test_models_are_named_by_their_own_name(tmp_path: Path) -> None:
    gguf = tmp_path / "model.Q4_K_M.gguf"
    _write_gguf_header(gguf, "Tiny Llama 1B")
    assert resolve_model(str(gguf)).name == "Tiny Llama 1B"
    # dummy:CONFIG is named by the config's file stem, not its folder ("configs").
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "llama8b-config.json").write_text(json.dumps({"model_type": "llama"}))
    assert resolve_model(f"dummy:{configs / 'llama8b-config.json'}").name == "llama8b-config"
    # A hub cache snapshot is named by its repo, not its commit hash.
    snapshot = tmp_path / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    assert resolve_model(str(snapshot)).name == "SmolLM2-135M"
    plain = tmp_path / "my-model"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert resolve_model(str(plain)).name == "my-model"


def test_the_embedded_file_by_path_is_the_default_model() -> None:
    """`serve --model <embedded .gguf>` against a default worker exited on a name mismatch."""
    assert resolve_model(str(embedded_model_path())).name == DEFAULT_MODEL_NAME == resolve_model(None).name


def test_generate_sends_names_as_names(tmp_path: Path) -> None:
    assert model_name("my-alias") == "my-alias"  # was opened as a file: a 13-line traceback
    assert model_name(None) == ""
    folder = tmp_path / "qwen-tiny"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert model_name(str(folder)) == "qwen-tiny"


@pytest.fixture(scope="module")
def aliased_daemon() -> Iterator[RunningDaemon]:
    configure_logging("warning", json_output=True)
    running, thread = start_daemon(
        FakeConfig(vocab_size=SMOLLM2_VOCAB, eos_token_ids=(2,), kv_num_blocks=64),
        model=ModelConfig(served_model_names=("tiny", "chat")),
    )
    try:
        yield running
    finally:
        stop_daemon(running, thread)


def test_requests_may_name_any_served_name(aliased_daemon: RunningDaemon) -> None:
    with EngineClient(aliased_daemon.address, timeout=30) as client:
        assert client.health()
        for name in ("tiny", "chat", DEFAULT_MODEL_NAME, ""):
            events = list(client.generate(prompt="hello", model=name, max_tokens=3))
            assert events[-1].HasField("done"), (name, events[-1])
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate(prompt="hello", model="other", max_tokens=3))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "'chat'" in (info.value.details() or "") and "'tiny'" in (info.value.details() or "")
        assert client.get_load().total.running_requests == 0
        assert client.abort("no-such-request") is False


def test_generate_command_with_a_served_name(
    aliased_daemon: RunningDaemon, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "hi", "--model", "tiny", "--address", aliased_daemon.address, "--max-tokens", "2"]
    assert main(argv) == 0
    assert "[length]" in capsys.readouterr().err
    assert main([*argv[:3], "nope", *argv[4:]]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_async_client_streams_and_sends_the_api_key(aliased_daemon: RunningDaemon) -> None:
    seen: list[tuple[tuple[str, str], ...]] = []

    class Recorder(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc's base class is untyped
        async def intercept_service(self, continuation, details):  # noqa: ANN001, ANN201
            seen.append(tuple(details.invocation_metadata or ()))
            return await continuation(details)

    async def scenario() -> list[str]:
        # The key goes out as `authorization: Bearer KEY` on every call: a server that records metadata.
        server = grpc.aio.server(interceptors=[Recorder()])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with AsyncEngineClient(f"127.0.0.1:{port}", ClientOptions(api_key="k-1", timeout=5)) as c:
                with pytest.raises(grpc.aio.AioRpcError):
                    await c.get_load()
        finally:
            await server.stop(0)
        async with AsyncEngineClient(aliased_daemon.address, timeout=30) as client:
            assert await client.health()
            request = generate_request(prompt="hello", model="chat", max_tokens=3)
            return [e.WhichOneof("event") async for e in client.generate(request)]

    kinds = asyncio.run(scenario())
    assert kinds[0] == "prefill_done" and kinds[-1] == "done" and "token" in kinds
    assert ("authorization", "Bearer k-1") in seen[0]


def test_generate_and_the_client_send_the_api_key(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    running, thread = start_daemon(
        FakeConfig(vocab_size=SMOLLM2_VOCAB, eos_token_ids=(2,), kv_num_blocks=64),
        front=FrontConfig(api_keys=("k-1", "k-2")),
    )
    try:
        argv = ["generate", "hi", "--address", running.address, "--max-tokens", "2"]
        assert main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "UNAUTHENTICATED" in err[0]
        assert main([*argv, "--api-key", "k-2"]) == 0
        assert "[length]" in capsys.readouterr().err
        monkeypatch.setenv("OMINIX_API_KEY", "k-1")
        assert main(argv) == 0
        with EngineClient(running.address, api_key="k-1", timeout=30) as client:
            assert client.health() and client.get_load().total.running_requests == 0
        with EngineClient(running.address, timeout=30) as client:
            assert client.health()  # grpc.health.v1 stays open
            with pytest.raises(grpc.RpcError) as info:
                client.get_load()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        stop_daemon(running, thread)
