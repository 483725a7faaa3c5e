"""A real worker process (python -m ominix_worker) driven over gRPC on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ominix_runtime import wire
from ominix_runtime.bind_probe import free_port
from ominix_runtime.contract import (
    BackendKind,
    DecodeStep,
    NewRequestData,
    RunningRequestData,
    SamplingParams,
    StepResult,
)
from ominix_runtime.pb import worker_pb2, worker_pb2_grpc
from ominix_worker.devices import dtype_name, resolve_dtype
from ominix_worker.runner import build_runner

START_TIMEOUT_S = 90
WORKER_SERVICE = "ominix.runtime.v1.Worker"


def worker_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "ominix_worker", *args]


async def wait_serving(address: str, process: subprocess.Popen[bytes]) -> None:
    """Await the health service's SERVING status for the Worker service (a Watch stream, no polling)."""
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), START_TIMEOUT_S)
        stub = health_pb2_grpc.HealthStub(channel)
        call = stub.Watch(health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=START_TIMEOUT_S)
        async for status in call:
            if status.status == health_pb2.HealthCheckResponse.SERVING:
                call.cancel()
                return
    raise AssertionError(f"worker never became SERVING (exit code {process.poll()})")


@pytest.fixture(scope="module")
def worker(tiny_model_dir: Callable[[str], Path]) -> Iterator[tuple[str, Path]]:
    folder = tiny_model_dir("llama")
    port = free_port()
    process = subprocess.Popen(
        worker_command("--model", str(folder), "--port", str(port), "--kv-cache-memory", "8MiB"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    address = f"127.0.0.1:{port}"
    try:
        asyncio.run(wait_serving(address, process))
        yield address, folder
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=32)


def scripted_steps() -> list[DecodeStep]:
    """Two requests: prefill both, decode both, finish 'a' mid-way, keep decoding 'b'."""
    steps = [
        DecodeStep(
            1,
            new_requests=[
                NewRequestData("a", [5, 6, 7, 8, 9], greedy(), [3], 0, 5, 1),
                NewRequestData(
                    "b", list(range(20, 38)), SamplingParams(temperature=0.8, seed=5), [7, 2], 0, 18, 2
                ),
            ],
        )
    ]
    for step_id in range(2, 5):
        steps.append(
            DecodeStep(
                step_id, running_requests=[RunningRequestData("a", [], 1), RunningRequestData("b", [], 1)]
            )
        )
    for step_id in range(5, 8):
        finished = ["a"] if step_id == 5 else []
        steps.append(
            DecodeStep(
                step_id, running_requests=[RunningRequestData("b", [], 1)], finished_request_ids=finished
            )
        )
    return steps


async def drive(address: str, steps: list[DecodeStep], in_flight: int = 2) -> list[StepResult]:
    """Send steps keeping up to ``in_flight`` unanswered, as the engine does; collect step results."""
    sendable = asyncio.Semaphore(in_flight)
    results: list[StepResult] = []

    async def outgoing() -> AsyncIterator[worker_pb2.DecodeStep]:
        for step in steps:
            await sendable.acquire()
            yield wire.step_to_pb(step)

    async with grpc.aio.insecure_channel(address) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Run(outgoing(), timeout=60)
        async for message in call:
            kind = message.WhichOneof("kind")
            assert kind != "fatal_error", message.fatal_error.message
            if kind == "step_result":
                results.append(wire.step_result_from_pb(message.step_result))
                sendable.release()
        # The request stream ended after the last step, so the worker ended the call once it had answered.
        assert await call.code() == grpc.StatusCode.OK
    return results


def test_describe_states_a_consistent_cpu_capability(worker: tuple[str, Path]) -> None:
    address, folder = worker

    async def describe() -> worker_pb2.HealthResponse:
        async with grpc.aio.insecure_channel(address) as channel:
            return await worker_pb2_grpc.WorkerStub(channel).Describe(
                worker_pb2.DescribeRequest(), timeout=10
            )

    cap = wire.capability_from_pb(asyncio.run(describe()))
    config = json.loads((folder / "config.json").read_text())
    assert cap.problems() == []
    # No --dtype: the worker states what "auto" is on this CPU (bfloat16 with hardware bfloat16, else float32).
    auto = dtype_name(resolve_dtype("auto", torch.device("cpu")))
    assert cap.kind == BackendKind.CPU and cap.device == "cpu" and cap.dtype == auto
    assert cap.weight_dtype == auto and cap.kv_cache_dtype == auto
    assert cap.worker_id == f"cpu@{address}"
    assert cap.model.vocab_size == config["vocab_size"] and cap.model.eos_token_ids == (2,)
    assert cap.model.bos_token_id == 1 and cap.model.num_layers == config["num_hidden_layers"]
    assert cap.kv_block_size == 16
    assert cap.kv_num_blocks * cap.kv_bytes_per_block <= 8 * 2**20
    assert cap.kv_num_blocks * cap.kv_bytes_per_block > 7 * 2**20
    assert cap.attention_backend == "torch-sdpa"


def test_steps_over_grpc_match_the_in_process_runner(worker: tuple[str, Path]) -> None:
    address, folder = worker
    steps = scripted_steps()
    remote = asyncio.run(drive(address, steps))
    local_runner = build_runner(str(folder), num_blocks=16)
    local = [local_runner.execute_step(step) for step in steps]
    assert [r.step_id for r in remote] == [s.step_id for s in steps]
    for got, want in zip(remote, local, strict=True):
        assert [(o.request_id, o.sampled_token_id, o.error_kind) for o in got.outputs] == [
            (o.request_id, o.sampled_token_id, o.error_kind) for o in want.outputs
        ]
        assert got.num_tokens == want.num_tokens
    assert all(o.sampled_token_id is not None for r in remote for o in r.outputs)
    assert remote[0].num_tokens == 23 and remote[-1].num_tokens == 1


def test_stream_close_drops_state_and_only_one_stream_at_a_time(worker: tuple[str, Path]) -> None:
    address, _ = worker

    async def scenario() -> tuple[grpc.StatusCode, worker_pb2.HealthResponse, worker_pb2.HealthResponse]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            first_sent = asyncio.Event()
            release = asyncio.Event()

            async def held_open() -> AsyncIterator[worker_pb2.DecodeStep]:
                yield wire.step_to_pb(scripted_steps()[0])
                first_sent.set()
                await release.wait()

            first = stub.Run(held_open(), timeout=30)
            accepted = await first.read()  # the worker accepts a stream with a heartbeat at once
            assert accepted.WhichOneof("kind") == "heartbeat"
            message = await first.read()
            assert message.WhichOneof("kind") == "step_result"
            # Nothing else to say while the engine sends nothing: a heartbeat within about a second.
            idle = await asyncio.wait_for(first.read(), timeout=10)
            assert idle.WhichOneof("kind") == "heartbeat" and idle.heartbeat.worker_time > 0
            during = await stub.Health(worker_pb2.HealthRequest(), timeout=5)
            second = stub.Run(iter([]), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await second.read()
            release.set()
            while await first.read() is not grpc.aio.EOF:
                pass
            # The worker drops the stream's state before it ends the call.
            after = await stub.Health(worker_pb2.HealthRequest(), timeout=5)
            return refused.value.code(), during, after

    code, during, after = asyncio.run(scenario())
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert during.ready and during.num_requests == 2 and during.last_step_id == 1
    assert after.num_requests == 0


def test_a_failed_step_is_reported_and_the_worker_lives_on(worker: tuple[str, Path]) -> None:
    address, _ = worker

    async def scenario() -> list[worker_pb2.WorkerMessage]:
        steps = [
            DecodeStep(5, new_requests=[NewRequestData("s", [4, 5], greedy(), [0], 0, 2, 0)]),
            DecodeStep(3, running_requests=[RunningRequestData("s", [], 1)]),  # out of order
            DecodeStep(6, running_requests=[RunningRequestData("s", [], 1)]),
        ]
        messages = []
        async with grpc.aio.insecure_channel(address) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).Run(
                iter([wire.step_to_pb(s) for s in steps]), timeout=30
            )
            async for message in call:
                if message.WhichOneof("kind") != "heartbeat":
                    messages.append(message)
        return messages

    kinds = [m.WhichOneof("kind") for m in asyncio.run(scenario())]
    assert kinds == ["step_result", "fatal_error", "step_result"]


def test_reflection_lists_the_worker_service(worker: tuple[str, Path]) -> None:
    address, _ = worker

    async def services() -> list[str]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
            async for response in call:
                return [s.name for s in response.list_services_response.service]
        return []

    names = asyncio.run(services())
    assert WORKER_SERVICE in names and "grpc.health.v1.Health" in names


def run_failing(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(worker_command(*args), capture_output=True, text=True, timeout=120, env=env)


def test_port_taken_exits_with_a_clear_message(worker: tuple[str, Path]) -> None:
    address, folder = worker
    port = address.rsplit(":", 1)[1]
    proc = run_failing("--model", str(folder), "--port", port, "--kv-cache-memory", "8MiB")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot bind" in lines[0] and port in lines[0] and "--port" in lines[0], (
        proc.stderr
    )


def test_bad_model_exits_with_a_clear_message(tmp_path: Path) -> None:
    missing = run_failing("--model", str(tmp_path / "nowhere"), "--port", str(free_port()))
    assert missing.returncode != 0 and "not found" in missing.stderr
    unsupported = tmp_path / "gpt2"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    proc = run_failing("--model", str(unsupported), "--port", str(free_port()))
    assert proc.returncode == 1
    # Progress lines (JSON, "loading ...") may come first; the failure itself is one line, the last.
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if "error" in line]
    assert errors == lines[-1:] and "unsupported model_type 'gpt2'" in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_device_exits_with_a_clear_message(tmp_path: Path) -> None:
    proc = run_failing("--device", "cuda:7", "--port", str(free_port()))
    import torch

    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    assert proc.returncode != 0
    assert "cuda:7 not found" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from ominix_worker.server import main

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for flag, default in [
        ("--model", "SmolLM2-135M-Instruct"),
        ("--device", "cpu"),
        ("--host", "127.0.0.1"),
        ("--port", "50071"),
        ("--dtype", "auto"),
        ("--kv-cache-memory", "1GiB"),
        ("--gpu-memory-utilization", "0.9"),
        ("--block-size", "16"),
        ("--max-batch-tokens", None),
        ("--max-running-requests", None),
        ("--max-model-len", None),
        ("--worker-id", None),
    ]:
        assert flag in text
        if default is not None:
            assert default in text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dtype", "fp8"], "--dtype: 'fp8' is not one of"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory: bad byte size 'lots'"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: expected a fraction in (0, 1]"),
        (["--max-batch-tokens", "0"], "--max-batch-tokens: expected an integer >= 1"),
        (["--tp-size", "2"], "--tp-size > 1 needs --dist-init-addr"),
        (["--tp-size", "2", "--tp-rank", "2"], "--tp-rank 2 is not a rank of --tp-size 2"),
        (["--tp-size", "2", "--dist-init-addr", "nohost"], "--dist-init-addr: expected HOST:PORT"),
        (
            ["--tp-size", "2", "--tp-rank", "1", "--dist-init-addr", "127.0.0.1:1", "--dist-timeout", "1"],
            "cannot join",
        ),
    ],
)
def test_bad_flags_are_refused_before_loading(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str], tiny_model_dir: Callable[[str], Path]
) -> None:
    from ominix_worker.server import main

    folder = tiny_model_dir("llama")
    capsys.readouterr()  # drop what writing the model printed
    assert main(["--model", str(folder), "--port", str(free_port()), *flags]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    # The failure is one line, the last; info lines of the log stream (joining a group) may come first.
    assert [line for line in err if "error" in line] == err[-1:] and message in err[-1], err
