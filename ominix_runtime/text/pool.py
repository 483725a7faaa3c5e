"""Tokenization and chat templating on a few threads, never on the event loop, with a bound on waiting work.

A long prompt takes the Rust tokenizer a while; on the event loop that time would stall every other stream.
The tokenizer releases the GIL while it runs (see :meth:`Tokenizer.encode`), so a thread keeps the loop free.
Work beyond ``max_pending`` is refused at once (RESOURCE_EXHAUSTED) instead of queueing without end.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ominix_runtime import memory
from ominix_runtime.contract import AdmissionRejected, RuntimeErrorKind
from ominix_runtime.text.tokenizer import EncodedPrompt, Tokenizer

T = TypeVar("T")

DEFAULT_THREADS = 2
DEFAULT_MAX_PENDING = 64
# After a prompt this long (characters) the allocator hands freed memory back to the system: the tokenizer's
# buffers for one long prompt are large, and glibc keeps freed memory of worker threads' arenas otherwise.
_TRIM_AFTER_CHARS = 256 * 1024


class TokenizationPool:
    """Runs one tokenizer's work on ``threads`` threads; at most ``max_pending`` calls queued or running."""

    def __init__(
        self, tokenizer: Tokenizer, threads: int = DEFAULT_THREADS, max_pending: int = DEFAULT_MAX_PENDING
    ) -> None:
        self.tokenizer = tokenizer
        self.max_pending = max(1, max_pending)
        self.pending = 0
        self._executor = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ominix-tokenize")

    async def encode_prompt(self, text: str, parse_special: bool) -> list[int]:
        return await self._run(len(text), lambda: self.tokenizer.encode(text, parse_special=parse_special))

    async def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], parse_special_in_content: bool
    ) -> EncodedPrompt:
        size = sum(len(str(m.get("content", ""))) for m in messages)
        return await self._run(
            size,
            lambda: self.tokenizer.tokenize_chat(
                messages, add_generation_prompt=True, parse_special_in_content=parse_special_in_content
            ),
        )

    async def _run(self, size: int, work: Callable[[], T]) -> T:
        if self.pending >= self.max_pending:
            raise AdmissionRejected(
                f"too many prompts waiting to be tokenized (limit {self.max_pending}); retry later",
                RuntimeErrorKind.ADMISSION_REJECTED,
            )
        loop = asyncio.get_running_loop()
        # Counted until the thread is done with it: a caller that goes away does not stop work already running.
        self.pending += 1
        job = self._executor.submit(self._call, size, work)

        def release(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to count any more
                loop.call_soon_threadsafe(self._release)

        job.add_done_callback(release)
        return await asyncio.wrap_future(job)

    def _release(self) -> None:
        self.pending -= 1

    def _call(self, size: int, work: Callable[[], T]) -> T:
        try:
            return work()
        finally:
            if size >= _TRIM_AFTER_CHARS:
                memory.trim()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
