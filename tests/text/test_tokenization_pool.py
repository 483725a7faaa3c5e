"""The tokenization pool: work runs on its threads (the event loop stays free) and waiting work is bounded."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from ominix_runtime.contract import OminixError, RuntimeErrorKind
from ominix_runtime.text import Tokenizer
from ominix_runtime.text.pool import TokenizationPool


def test_a_long_prompt_does_not_block_the_event_loop(smollm2_tokenizer: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 40_000  # ~0.6 s of tokenization on one core

    async def run() -> tuple[list[int], float]:
        pool = TokenizationPool(smollm2_tokenizer.prepare(), threads=1, max_pending=4)
        ticks: list[float] = []

        async def ticker() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.005)

        beat = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.02)
        ids = await pool.encode_prompt(text, parse_special=False)
        beat.cancel()
        pool.close()
        gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
        return ids, max(gaps)

    ids, largest_gap = asyncio.run(run())
    assert ids == smollm2_tokenizer.encode(text, parse_special=False)
    # On the loop the whole tokenization would be one stall; off it only scheduling noise remains.
    assert largest_gap < 0.3, f"the event loop stalled for {largest_gap:.3f} s"


def test_full_pool_refuses_with_resource_exhausted(smollm2_tokenizer: Tokenizer) -> None:
    release = threading.Event()

    async def run() -> None:
        pool = TokenizationPool(smollm2_tokenizer, threads=1, max_pending=2)
        blocked = [asyncio.ensure_future(pool._run(0, release.wait)) for _ in range(2)]  # noqa: SLF001
        await asyncio.sleep(0.05)
        assert pool.pending == 2
        with pytest.raises(OminixError) as info:
            await pool.encode_prompt("one more", parse_special=False)
        assert info.value.kind == RuntimeErrorKind.ADMISSION_REJECTED and "limit 2" in info.value.message
        # A caller that gives up does not free its slot while its work still runs on the thread.
        blocked[0].cancel()
        await asyncio.sleep(0.05)
        assert pool.pending == 2
        release.set()
        await asyncio.gather(*blocked, return_exceptions=True)
        for _ in range(100):
            if pool.pending == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.pending == 0
        assert await pool.encode_prompt("fits again", parse_special=False)
        pool.close()

    asyncio.run(run())
