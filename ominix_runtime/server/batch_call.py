"""One GenerateBatch call: many requests admitted through the one Generate path, their event streams merged.

A burst of separate Generate calls costs gRPC's per-call work once per request (~0.2 ms each in Python), so
256 requests sent at once reach the scheduler over 50 - 150 ms and the batch fills late. One call carries
them all; its events go back in one message per wake-up rather than one per request and token.

Every request is admitted, streamed and released exactly as a Generate call's would be (EngineServiceBase:
``admit`` / ``stream`` / ``release``), so validation, tokenization, tracing and metrics do not fork. A
request refused at admission ends with an error event in the stream and the others go on; ids that are
malformed or repeated refuse the whole call before anything is admitted, since no event could name them.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from ominix_runtime import wire
from ominix_runtime.contract import (
    InvalidArgument,
    OminixError,
    RuntimeErrorKind,
    is_retryable,
    validate_request_id,
)
from ominix_runtime.pb import engine_pb2
from ominix_runtime.server.logging import get_logger, request_context

if TYPE_CHECKING:
    from ominix_runtime.server.engine_service import AdmittedRequest, EngineServiceBase

MAX_BATCH_REQUESTS = 4096  # documented in engine.proto
# Text and chat prompts admitted at once: they queue for the tokenizer pool, whose own limit
# (max_pending_tokenizations) other callers share. Token-id prompts need no tokenizer and go in all together,
# so a front process sends their submissions in one frame and the engine takes them before its next step
# (in windows of 32 they reached the scheduler over ~7 decode steps of an H200, 2026-11-30).
TOKENIZED_ADMIT_CONCURRENCY = 32
# A message's size before the next event starts a new one (the clients' default receive limit is 4 MiB).
MAX_MESSAGE_BYTES = 1 << 20
_TERMINAL = frozenset({"done", "error"})

_log = get_logger("ominix.server")


def batch_request_ids(batch: engine_pb2.GenerateBatchRequest) -> list[str]:
    """Each request's id (generated where empty); InvalidArgument for a bad count, a bad id or a repeat."""
    count = len(batch.requests)
    if count == 0:
        raise InvalidArgument("requests is empty")
    if count > MAX_BATCH_REQUESTS:
        raise InvalidArgument(f"{count} requests in one call; at most {MAX_BATCH_REQUESTS}")
    ids = [pb.request_id or uuid.uuid4().hex for pb in batch.requests]
    seen: set[str] = set()
    for index, rid in enumerate(ids):
        try:
            validate_request_id(rid)
        except InvalidArgument as exc:
            raise InvalidArgument(f"requests[{index}]: {exc.message}") from None
        if rid in seen:
            raise InvalidArgument(f"requests[{index}]: request_id '{rid}' appears twice in the call")
        seen.add(rid)
    return ids


class BatchCall:
    """Admits a call's requests, pumps each one's events into one queue, and hands them out in batches."""

    def __init__(self, service: EngineServiceBase, caller: str, traceparent: str) -> None:
        self._service = service
        self._caller = caller
        self._traceparent = traceparent
        self._queue: asyncio.Queue[engine_pb2.GenerateEvent] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._terminals = 0

    async def events(
        self, requests: list[engine_pb2.GenerateRequest], ids: list[str]
    ) -> AsyncGenerator[engine_pb2.GenerateEventBatch, None]:
        """Batches of events until every request has had its terminal one; leaving early (the client went
        away) aborts every request still live."""
        gate = asyncio.Semaphore(TOKENIZED_ADMIT_CONCURRENCY)
        admitting = [
            asyncio.create_task(self._admit(pb, rid, None if pb.WhichOneof("input") == "input_ids" else gate))
            for pb, rid in zip(requests, ids, strict=True)
        ]
        self._tasks.update(admitting)
        try:
            while self._terminals < len(ids) or not self._queue.empty():
                first = await self._queue.get()
                await asyncio.sleep(0)  # other requests woken by the same step put their events first
                out = engine_pb2.GenerateEventBatch()
                out.events.append(first)
                size = first.ByteSize()
                while not self._queue.empty() and size < MAX_MESSAGE_BYTES:
                    event = self._queue.get_nowait()
                    size += event.ByteSize()
                    out.events.append(event)
                yield out
        finally:
            for task in self._tasks:
                task.cancel()
            # Each task's own cleanup (abort, release) runs now, before the call's end is reported.
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _put(self, event: engine_pb2.GenerateEvent) -> None:
        if event.WhichOneof("event") in _TERMINAL:
            self._terminals += 1
        self._queue.put_nowait(event)

    async def _admit(self, pb: engine_pb2.GenerateRequest, rid: str, gate: asyncio.Semaphore | None) -> None:
        with request_context(rid):
            async with gate or contextlib.nullcontext():
                try:
                    admitted = await self._service.admit(pb, rid, self._caller, self._traceparent)
                except OminixError as exc:
                    self._put(_error_event(rid, exc.kind, exc.message, is_retryable(exc.kind)))
                    return
                except Exception as exc:  # a bug must not leave the call waiting for this request forever
                    _log.exception("batch admission failed")
                    self._put(_error_event(rid, RuntimeErrorKind.INTERNAL, repr(exc)))
                    return
            await self._pump(admitted)

    async def _pump(self, admitted: AdmittedRequest) -> None:
        """One request's events into the queue, then its release (an abort unless it finished)."""
        rid = admitted.request.request_id
        finished = False
        last: engine_pb2.GenerateEvent | None = None
        try:
            try:
                async for event in self._service.stream(admitted):
                    last = event
                    self._put(event)
                finished = True
            except Exception as exc:  # a bug here must still end the request with one terminal event
                _log.exception("batch stream failed")
                last = _error_event(rid, RuntimeErrorKind.INTERNAL, repr(exc))
                self._put(last)
        finally:
            self._service.release(admitted, finished, last)


def _error_event(
    rid: str, kind: RuntimeErrorKind, message: str, retryable: bool = False
) -> engine_pb2.GenerateEvent:
    return engine_pb2.GenerateEvent(request_id=rid, error=wire.error_info_to_pb(kind, message, retryable))
