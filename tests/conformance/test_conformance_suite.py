"""The conformance suite passes against the fake step backend and fails readably against a broken one."""

from __future__ import annotations

import asyncio

import pytest

from ominix_runtime.conformance import ALL_CHECKS, all_passed, format_table, run_checks
from ominix_runtime.conformance.cli import main
from ominix_runtime.conformance.runner import CheckResult
from ominix_runtime.testing.fake_backend import FakeConfig, FakeRequestBackend, FakeStepBackend


def test_suite_passes_against_the_fake_step_backend() -> None:
    backends: list[FakeStepBackend] = []

    def make() -> list[FakeStepBackend]:
        backends.append(FakeStepBackend(FakeConfig()))
        return backends[-1:]

    results = asyncio.run(run_checks(make, timeout=30))
    assert [r.name for r in results] == list(ALL_CHECKS)
    assert all_passed(results), format_table(results)
    assert all(not b.violations for b in backends)  # the fake worker saw only executable steps


def test_suite_passes_against_the_well_behaved_request_level_fake() -> None:
    results = asyncio.run(run_checks(lambda: [FakeRequestBackend()], timeout=30))
    assert all_passed(results), format_table(results)


def test_suite_fails_readably_against_a_broken_backend() -> None:
    results = asyncio.run(run_checks(lambda: [FakeRequestBackend(broken=True)], timeout=30))
    by_name = {r.name: r for r in results}
    assert not all_passed(results)
    assert not by_name["prefill_done_before_first_token"].passed
    assert "Token arrived before PrefillDone" in by_name["prefill_done_before_first_token"].message
    terminal = by_name["exactly_one_terminal_event"]
    assert not terminal.passed
    assert "sent another terminal event (Done) after its terminal event" in terminal.message
    table = format_table(results)
    assert "FAIL" in table and "checks passed" in table


def test_cli_exit_codes_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    checks = ["--check", "abort_frees_kv", "--check", "same_seed_same_tokens"]
    assert main(["--backend", "fake", *checks], configure_logs=False) == 0
    out = capsys.readouterr().out
    assert "abort_frees_kv" in out and "PASS" in out and "2/2 checks passed" in out
    assert (
        main(
            ["--backend", "fake-broken", "--json", "--check", "exactly_one_terminal_event"],
            configure_logs=False,
        )
        == 1
    )
    out = capsys.readouterr().out
    assert '"passed": false' in out


def test_a_hung_backend_fails_the_check_instead_of_hanging() -> None:
    make = lambda: [FakeStepBackend(FakeConfig(hang_at_step=1))]  # noqa: E731
    results = asyncio.run(run_checks(make, ["prefill_done_before_first_token"], timeout=2))
    assert not results[0].passed
    assert "did not finish within 2 s" in results[0].message or "sent no result" in results[0].message


def test_suite_passes_against_the_sglang_adapter_over_loopback_http() -> None:
    from ominix_runtime.backends.sglang import SGLangBackend
    from ominix_runtime.testing.fake_sglang import FakeSGLangServer

    async def main() -> list[CheckResult]:
        async with FakeSGLangServer() as server:
            make = lambda: [SGLangBackend(server.url, vocab_size=32000, eos_token_ids=[2])]  # noqa: E731
            return await run_checks(make, timeout=30)

    results = asyncio.run(main())
    assert all_passed(results), format_table(results)
