"""The backend conformance suite against SGLangBackend in front of the fake SGLang server."""

from __future__ import annotations

import asyncio

from ominix_runtime.backends.sglang import SGLangBackend
from ominix_runtime.conformance import ALL_CHECKS, all_passed, format_table, run_checks
from ominix_runtime.testing.fake_sglang import FakeSGLangServer, FakeSGLangState

CHECK_TIMEOUT_S = 20.0


def test_conformance_suite_passes_over_sglang() -> None:
    async def main() -> str:
        # A small per-token delay, like a real server: requests are still running when the suite aborts them.
        async with FakeSGLangServer(FakeSGLangState(mode="slow", token_delay=0.002)) as server:
            results = await run_checks(
                lambda: [SGLangBackend(server.url, timeout=5.0)], None, CHECK_TIMEOUT_S
            )
            table = format_table(results)
            assert {r.name for r in results} == set(ALL_CHECKS)
            # SGLang states neither vocabulary nor EOS ids; the contract allows that at request level.
            assert all_passed(results), table
            assert server.state.aborted_rids, "the abort checks reached the server"
            return table

    table = asyncio.run(asyncio.wait_for(main(), 120.0))
    assert "checks passed" in table
