"""The upstream contract's gates (unsupported model, idempotent abort, deadline) and capacity checks sized
from what the backend reports, against the fake step backend, the SGLang stand-in and a real CPU worker.
A check that cannot apply reports SKIP, never PASS."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from ominix_runtime.backends.grpc_worker import GrpcWorkerBackend
from ominix_runtime.backends.sglang import SGLangBackend
from ominix_runtime.conformance import CheckSkipped, all_passed, format_table, run_checks
from ominix_runtime.conformance.checks import Harness
from ominix_runtime.conformance.runner import run_check
from ominix_runtime.testing.fake_backend import FakeStepBackend
from ominix_runtime.testing.fake_sglang import FakeSGLangServer, FakeSGLangState

NEW_GATES = ["unsupported_model_rejected", "abort_is_idempotent", "deadline_enforced"]
SIZED = ["capacity_overflow_rejected", "survives_kv_exhaustion"]


def statuses(results: list) -> dict[str, str]:  # type: ignore[type-arg]
    return {r.name: r.status for r in results}


def test_gates_pass_on_the_fake_step_backend() -> None:
    results = asyncio.run(run_checks(lambda: [FakeStepBackend()], NEW_GATES + SIZED, timeout=30))
    assert statuses(results) == dict.fromkeys(NEW_GATES + SIZED, "PASS"), format_table(results)
    by_name = {r.name: r for r in results}
    assert "CAPABILITY_MISMATCH" not in by_name["unsupported_model_rejected"].message  # the reason is shown
    assert "no-such-model" in by_name["unsupported_model_rejected"].message
    assert "Error(TIMEOUT)" in by_name["deadline_enforced"].message


def test_sglang_stand_in_with_a_pool_smaller_than_its_context_really_runs_the_kv_gates() -> None:
    async def main() -> list:  # type: ignore[type-arg]
        state = FakeSGLangState(
            mode="slow", token_delay=0.002, max_total_num_tokens=2048, context_length=4096
        )
        async with FakeSGLangServer(state) as server:
            results = await run_checks(lambda: [SGLangBackend(server.url, timeout=5.0)], None, timeout=60)
            assert server.state.aborted_rids  # the abort gates reached the server
            return results

    results = asyncio.run(asyncio.wait_for(main(), 300))
    table = format_table(results)
    assert all(r.status == "PASS" for r in results), table
    by_name = {r.name: r for r in results}
    assert "backend-reported pool of 2048 tokens" in by_name["capacity_overflow_rejected"].message
    assert "2048-token pool" in by_name["survives_kv_exhaustion"].message


def test_sglang_stand_in_whose_pool_holds_any_request_skips_the_overflow_gate() -> None:
    async def main() -> list:  # type: ignore[type-arg]
        async with FakeSGLangServer(FakeSGLangState(max_total_num_tokens=65536)) as server:
            return await run_checks(lambda: [SGLangBackend(server.url, timeout=5.0)], SIZED, timeout=60)

    results = asyncio.run(main())
    assert statuses(results)["capacity_overflow_rejected"] == "SKIP"
    assert "no admissible request can exceed it" in results[0].message
    # 25 requests of 4095 tokens (the context's worth) ask for 1.5x the 65536-token pool.
    assert statuses(results)["survives_kv_exhaustion"] == "PASS"
    assert "1.6x the backend's 65536-token pool" in results[1].message
    table = format_table(results)
    assert "SKIP" in table and "1/2 checks passed, 1 skipped" in table
    assert all_passed(results)
    assert not all_passed(results[:1])  # a run where nothing applied did not pass


def test_a_skip_is_never_a_pass() -> None:
    async def not_applicable(h: Harness) -> str:
        raise CheckSkipped("does not apply here")

    result = asyncio.run(run_check("n/a", not_applicable, lambda: [FakeStepBackend()], 5))
    assert result.status == "SKIP" and not result.passed and not result.failed
    assert result.message == "does not apply here"


@pytest.fixture(scope="module")
def cpu_worker(tmp_path_factory: pytest.TempPathFactory) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
    from e2e_procs import start_workers, stop_procs

    from ominix_worker.testing import write_tiny_hf_model

    model = write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", arch="llama", vocab_size=320)
    procs, (address,) = start_workers(str(model), 1, tmp_path_factory.mktemp("logs"), "4MiB")
    try:
        asyncio.run(GrpcWorkerBackend(address).wait_ready(120))
        yield address
    finally:
        stop_procs(procs)


def test_gates_pass_on_a_real_cpu_worker(cpu_worker: str) -> None:
    make = lambda: [GrpcWorkerBackend(cpu_worker)]  # noqa: E731
    results = asyncio.run(run_checks(make, NEW_GATES + SIZED, timeout=120))
    table = format_table(results)
    assert statuses(results) == dict.fromkeys(NEW_GATES + SIZED, "PASS"), table


def test_cli_reaches_an_sglang_server_that_wants_an_api_key(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
    from e2e_procs import free_ports, start_proc, stop_procs

    from ominix_runtime.conformance.cli import main

    (port,) = free_ports(1)
    fake = [
        sys.executable,
        "-m",
        "ominix_runtime.testing.fake_sglang",
        "--port",
        str(port),
        "--api-key",
        "k1",
    ]
    proc = start_proc("fake-sglang", fake, tmp_path)
    try:
        for _ in range(600):
            if "fake SGLang ready" in proc.log_tail():
                break
            assert proc.popen.poll() is None, proc.log_tail()
            asyncio.run(asyncio.sleep(0.05))
        url = f"http://127.0.0.1:{port}"
        checks = ["--check", "unsupported_model_rejected", "--check", "capacity_overflow_rejected"]
        assert main(["--backend", "sglang", "--url", url, "--sglang-api-key", "k1", *checks], False) == 0
        out = capsys.readouterr().out
        assert "unsupported_model_rejected" in out and "PASS" in out and "SKIP" in out
        assert main(["--backend", "sglang", "--url", url, *checks], False) == 1  # no key: 401, a FAIL
        assert "401" in capsys.readouterr().out
    finally:
        stop_procs([proc])
