"""One GenerateBatch call: many requests admitted through the one Generate path, their event streams merged.

A burst of separate Generate calls costs gRPC's per-call work once per request (~0.2 ms each in Python), so
256 requests sent at once reach the scheduler over 50 - 150 ms and the batch fills late. One call carries
them all; its events go back in one message per wake-up rather than one per request and token.

Every request is admitted, streamed and released exactly as a Generate call's would be (EngineServiceBase:
``reserve`` + ``admit_reserved`` / ``stream`` / ``release``), so validation, tokenization, tracing and metrics
do not fork. Every id is reserved when the call starts, before its request waits for the tokenizer gate. A
request refused at admission ends with an error event in the stream and the others go on; ids that are
malformed or repeated refuse the whole call before anything is admitted, since no event could name them, and
so do more requests than the engine queues, which could only be refused in part. Past MAX_QUEUED_EVENTS
events waiting for a slow reader, the requests stop taking theirs: their tokens then wait in their handles,
which merge them into one event each (as a Generate stream's handle does for a slow client).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
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
    from ominix_runtime.server.tracing import RequestSpan

MAX_BATCH_REQUESTS = 4096  # documented in engine.proto
# Text and chat prompts of batch calls admitted at once, over all calls of a front: they wait for the tokenizer
# pool, which refuses work beyond its max_pending_tokenizations, so batches take at most half of it and a
# Generate call beside them still finds room. Token-id prompts need no tokenizer and go in all together, so a
# front process sends their submissions in one frame and the engine takes them before its next step (in
# windows of 32 they reached the scheduler over ~7 decode steps of an H200, 2026-11-30).
MAX_TOKENIZING_ADMISSIONS = 32
# Events waiting for the client before the requests stop taking theirs (about 16 steps of 256 requests).
MAX_QUEUED_EVENTS = 4096
# A message takes events until it holds this many bytes of them (a little over, by the last event and the
# framing): the clients' default receive limit is 4 MiB.
MAX_MESSAGE_BYTES = 1 << 20
_TERMINAL = frozenset({"done", "error"})

_log = get_logger("ominix.server")


def max_batch_requests(queue_limit: int) -> int:
    """Requests one call may carry: MAX_BATCH_REQUESTS, or fewer where the engine queues fewer (0: no limit).
    A larger call could only be refused in part, so it is refused whole."""
    return min(MAX_BATCH_REQUESTS, queue_limit) if queue_limit > 0 else MAX_BATCH_REQUESTS


def tokenizing_admissions(max_pending_tokenizations: int) -> int:
    """Batch admissions that may wait for the tokenizer pool at once (see MAX_TOKENIZING_ADMISSIONS)."""
    return max(1, min(MAX_TOKENIZING_ADMISSIONS, max_pending_tokenizations // 2))


def batch_request_ids(batch: engine_pb2.GenerateBatchRequest, limit: int) -> list[str]:
    """Each request's id (generated where empty); InvalidArgument for a bad count, a bad id or a repeat."""
    count = len(batch.requests)
    if count == 0:
        raise InvalidArgument("requests is empty")
    if count > limit:
        why = "" if limit == MAX_BATCH_REQUESTS else " (the engine queues no more: --max-queue-len)"
        raise InvalidArgument(f"{count} requests in one call; at most {limit}{why}")
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
    """Admits a call's requests, pumps each one's events into one queue, and hands them out in batches.

    Every request's task ends with its terminal event in the queue: the stream's own, an error event for a
    refusal, or (a task that failed or was cancelled without one, e.g. by a tokenizer pool closing at
    shutdown) an error event its done-callback adds, so the call cannot wait forever for a request.
    """

    def __init__(
        self, service: EngineServiceBase, caller: str, traceparent: str, tokenizing: asyncio.Semaphore
    ) -> None:
        self._service = service
        self._caller = caller
        self._traceparent = traceparent
        self._tokenizing = tokenizing
        self._queue: asyncio.Queue[engine_pb2.GenerateEvent] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._ended: set[str] = set()  # requests whose terminal event is queued
        # Reserved requests not yet handed to admission (waiting for the gate): their span and model.
        self._waiting: dict[str, tuple[RequestSpan, str]] = {}
        self._closing = False
        self._room = asyncio.Event()  # set while fewer than MAX_QUEUED_EVENTS wait
        self._room.set()

    async def events(
        self, requests: list[engine_pb2.GenerateRequest], ids: list[str]
    ) -> AsyncGenerator[engine_pb2.GenerateEventBatch, None]:
        """Batches of events until every request has had its terminal one; leaving early (the client went
        away) aborts every request still live."""
        try:
            for pb, rid in zip(requests, ids, strict=True):
                # Every id is live from the call's start, before its request waits for the tokenizer gate: an
                # Abort finds it there, and a Generate of the same id meanwhile is refused.
                with request_context(rid):
                    try:
                        span = self._service.reserve(rid, self._caller, self._traceparent, pb.model)
                    except OminixError as exc:
                        self._put(_error_event(rid, exc.kind, exc.message, is_retryable(exc.kind)))
                        continue
                self._waiting[rid] = (span, pb.model)
                gate = None if pb.WhichOneof("input") == "input_ids" else self._tokenizing
                task = asyncio.create_task(self._admit(pb, rid, span, gate))
                task.add_done_callback(functools.partial(self._settle, rid))
                self._tasks.add(task)
            while len(self._ended) < len(ids) or not self._queue.empty():
                first = await self._queue.get()
                await asyncio.sleep(0)  # other requests woken by the same step put their events first
                out = engine_pb2.GenerateEventBatch()
                out.events.append(first)
                size = first.ByteSize()
                while not self._queue.empty() and size < MAX_MESSAGE_BYTES:
                    event = self._queue.get_nowait()
                    size += event.ByteSize()
                    out.events.append(event)
                if self._queue.qsize() < MAX_QUEUED_EVENTS:
                    self._room.set()
                yield out
        finally:
            self._closing = True
            for task in self._tasks:
                task.cancel()
            # Each task's own cleanup (abort, release) runs now, before the call's end is reported.
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _put(self, event: engine_pb2.GenerateEvent) -> None:
        if event.WhichOneof("event") in _TERMINAL:
            if event.request_id in self._ended:
                return  # one terminal event per request, whatever went wrong
            self._ended.add(event.request_id)
        self._queue.put_nowait(event)
        if self._queue.qsize() >= MAX_QUEUED_EVENTS:
            self._room.clear()

    def _settle(self, rid: str, task: asyncio.Task[None]) -> None:
        """A request's task ended: if it left no terminal event (and the call goes on), add one. A request
        cancelled before it reached admission (at the gate, or before its task ran) gives its id back."""
        with request_context(rid):  # a done-callback runs outside the task's context
            waiting = self._waiting.pop(rid, None)
            if waiting is not None:
                self._service.withdraw(rid, *waiting)
            if self._closing or rid in self._ended:
                return
            why = "cancelled" if task.cancelled() else repr(task.exception())
            _log.error("batch request ended without a terminal event", reason=why)
            self._put(
                _error_event(rid, RuntimeErrorKind.INTERNAL, f"the request ended without a result ({why})")
            )

    async def _admit(
        self,
        pb: engine_pb2.GenerateRequest,
        rid: str,
        span: RequestSpan,
        gate: asyncio.Semaphore | None,
    ) -> None:
        with request_context(rid):
            if gate is not None:
                await gate.acquire()
            del self._waiting[rid]  # admission answers for the reservation from here
            try:
                try:
                    admitted = await self._service.admit_reserved(pb, rid, self._caller, span)
                except OminixError as exc:
                    self._put(_error_event(rid, exc.kind, exc.message, is_retryable(exc.kind)))
                    return
                except Exception as exc:  # a bug must not leave the call waiting for this request forever
                    _log.exception("batch admission failed")
                    self._put(_error_event(rid, RuntimeErrorKind.INTERNAL, repr(exc)))
                    return
            finally:
                if gate is not None:
                    gate.release()
            await self._pump(admitted)

    async def _pump(self, admitted: AdmittedRequest) -> None:
        """One request's events into the queue; released at its end (an abort unless it finished)."""
        async with contextlib.aclosing(self._service.stream_and_release(admitted)) as events:
            async for event in events:
                self._put(event)
                await self._room.wait()  # a slow reader: leave the next tokens to the handle


def _error_event(
    rid: str, kind: RuntimeErrorKind, message: str, retryable: bool = False
) -> engine_pb2.GenerateEvent:
    return engine_pb2.GenerateEvent(request_id=rid, error=wire.error_info_to_pb(kind, message, retryable))
