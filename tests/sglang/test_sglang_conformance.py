"""The backend conformance suite against SGLangBackend in front of the fake SGLang server."""

from __future__ import annotations

import asyncio
import re

from ominix_runtime.backends.fake_sglang import FakeSGLangServer, FakeSGLangState
from ominix_runtime.backends.sglang import SGLangBackend
from ominix_runtime.conformance import ALL_CHECKS, all_passed, format_table, run_checks

CHECK_TIMEOUT_S = 20.0
TOKENIZER_FACTS = re.compile(r"model\.(vocab_size|eos_token_ids)")


def test_conformance_suite_passes_over_sglang() -> None:
    async def main() -> str:
        # A small per-token delay, like a real server: requests are still running when the suite aborts them.
        async with FakeSGLangServer(FakeSGLangState(mode="slow", token_delay=0.002)) as server:
            results = await run_checks(
                lambda: [SGLangBackend(server.url, timeout=5.0)], None, CHECK_TIMEOUT_S
            )
            table = format_table(results)
            assert {r.name for r in results} == set(ALL_CHECKS)
            # SGLang's HTTP API states neither the vocabulary nor the EOS ids, so the capability check may
            # fail on those two facts only (the engine accepts that from request-level backends).
            declaration = next(r for r in results if r.name == "capability_declaration")
            if not declaration.passed:
                problems = declaration.message.removeprefix("capability problems: ").split("; ")
                assert all(TOKENIZER_FACTS.search(p) for p in problems), table
            assert all_passed([r for r in results if r.name != "capability_declaration"]), table
            assert server.state.aborted_rids, "the abort checks reached the server"
            return table

    table = asyncio.run(asyncio.wait_for(main(), 120.0))
    assert "checks passed" in table
