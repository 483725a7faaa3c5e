"""Only the engine drives a worker: on plaintext loopback a real worker process opens Run only for the shared
secret, and a second Run while one is active is refused without disturbing the active one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_procs import Proc, free_ports, start_proc_env, stop_procs, worker_argv

from ominix_runtime.backends.grpc_worker import GrpcStepStream, GrpcWorkerBackend
from ominix_runtime.contract import (
    DecodeStep,
    NewRequestData,
    OminixError,
    RunningRequestData,
    SamplingParams,
)

SECRET = "s3cret-for-tests-only"


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ominix_worker.testing import write_tiny_hf_model

    folder = tmp_path_factory.mktemp("worker-access")
    model = write_tiny_hf_model(folder / "tiny", arch="llama", vocab_size=320)
    secret_file = folder / "engine.secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    (port,) = free_ports(1)
    extra = ["--engine-secret-file", str(secret_file)]
    proc: Proc = start_proc_env("worker", worker_argv(str(model), port, extra=extra), folder, {})
    address = f"127.0.0.1:{port}"
    try:
        end = time.monotonic() + 120
        while not asyncio.run(GrpcWorkerBackend(address, rpc_timeout=2).health()):
            assert proc.popen.poll() is None and time.monotonic() < end, proc.log_tail()
            time.sleep(0.2)
        yield address
    finally:
        stop_procs([proc])


def _first_step(request_id: str) -> DecodeStep:
    data = NewRequestData(request_id, [5, 6, 7], SamplingParams(max_tokens=8), [0], 0, 3, effective_seed=1)
    return DecodeStep(1, new_requests=[data])


async def _open(address: str, secret: str | None) -> tuple[GrpcWorkerBackend, GrpcStepStream]:
    backend = GrpcWorkerBackend(address, engine_secret=secret, rpc_timeout=5)
    try:
        return backend, await backend.open()
    except BaseException:
        await backend.close()
        raise


@pytest.mark.parametrize("secret", [None, "wrong", SECRET + "x"], ids=["none", "wrong", "longer"])
def test_run_needs_the_engine_secret(worker: str, secret: str | None) -> None:
    async def attempt() -> str:
        with pytest.raises(OminixError) as info:
            backend, _ = await _open(worker, secret)
            await backend.close()
        return info.value.message

    message = asyncio.run(attempt())
    assert "PERMISSION_DENIED" in message and "engine secret" in message


def test_second_run_is_refused_and_the_active_one_keeps_working(worker: str) -> None:
    async def run() -> None:
        backend, stream = await _open(worker, SECRET)
        try:
            await stream.send(_first_step("held"))
            first = await stream.recv()
            assert first.step_id == 1 and first.outputs[0].sampled_token_id is not None
            # A second driver, even with the right secret, is refused while this stream is active...
            with pytest.raises(OminixError) as info:
                other, _ = await _open(worker, SECRET)
                await other.close()
            assert "FAILED_PRECONDITION" in info.value.message
            # ...and the active stream goes on with the same request, its state intact.
            await stream.send(DecodeStep(2, running_requests=[RunningRequestData("held", [], 1)]))
            second = await stream.recv()
            assert second.step_id == 2 and second.outputs[0].request_id == "held"
            assert second.outputs[0].error_kind is None and second.outputs[0].sampled_token_id is not None
        finally:
            await stream.close()
            await backend.close()
        # Once it ends, a new engine stream is accepted.
        again, stream2 = await _open(worker, SECRET)
        await stream2.close()
        await again.close()

    asyncio.run(run())


def test_secret_file_must_not_be_empty(tmp_path: Path) -> None:
    import subprocess

    from fault_procs import CLI

    empty = tmp_path / "empty.secret"
    empty.write_text("\n")
    (port,) = free_ports(1)
    argv = [*CLI, "worker", "--device", "cpu", "--port", str(port), "--engine-secret-file", str(empty)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1 and "is empty" in result.stderr and "Traceback" not in result.stderr


def test_the_conformance_suite_reaches_a_worker_that_wants_the_secret(
    worker: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`conformance --worker` with the worker's --engine-secret-file runs its checks (without it, every
    check failed on PERMISSION_DENIED: the suite could not check the deployments TLS.md recommends)."""
    from ominix_runtime.conformance.cli import main

    secret_file = tmp_path / "engine.secret"
    secret_file.write_text(SECRET + "\n")
    check = ["--check", "exactly_one_terminal_event"]
    assert (
        main(["--worker", worker, "--engine-secret-file", str(secret_file), *check], configure_logs=False)
        == 0
    )
    assert "PASS" in capsys.readouterr().out
    assert main(["--worker", worker, *check], configure_logs=False) == 1  # no secret: refused, as it was
    assert "PERMISSION_DENIED" in capsys.readouterr().out
