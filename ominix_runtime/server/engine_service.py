"""gRPC servicer of ominix.runtime.v1.Engine: the front edge where text becomes tokens and back."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn, Protocol

import grpc
import grpc.aio
from google.protobuf import json_format

from ominix_runtime import memory, wire
from ominix_runtime.config import FrontConfig
from ominix_runtime.contract import (
    BackendCapability,
    ChatMessage,
    Done,
    Error,
    FinishReason,
    GenerateRequest,
    Granularity,
    InvalidArgument,
    OminixError,
    PrefillDone,
    Priority,
    RequestLimits,
    RuntimeErrorKind,
    Token,
    Usage,
    is_retryable,
    validate_request,
    validate_request_id,
)
from ominix_runtime.contract.validation import DEFAULT_MAX_CHARS_PER_TOKEN
from ominix_runtime.engine.core import EngineCore, RequestHandle
from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc
from ominix_runtime.server.batch_call import (
    BatchCall,
    batch_request_ids,
    max_batch_requests,
    tokenizing_admissions,
)
from ominix_runtime.server.call_errors import error_metadata
from ominix_runtime.server.front_guard import caller_of
from ominix_runtime.server.logging import get_logger, request_context
from ominix_runtime.server.metrics import EngineMetrics
from ominix_runtime.server.tracing import RequestSpan, RequestTracer, traceparent_from_grpc_metadata
from ominix_runtime.text import OutputText, Tokenizer
from ominix_runtime.text.pool import TokenizationPool

STATUS_OF_ERROR: dict[RuntimeErrorKind, grpc.StatusCode] = {
    RuntimeErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    RuntimeErrorKind.ADMISSION_REJECTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RuntimeErrorKind.KV_CAPACITY_EXCEEDED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RuntimeErrorKind.BACKEND_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    RuntimeErrorKind.CAPABILITY_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    RuntimeErrorKind.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    RuntimeErrorKind.CANCELLED: grpc.StatusCode.CANCELLED,
    RuntimeErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}

_PRIORITIES = frozenset(int(p) for p in Priority)
_log = get_logger("ominix.server")


# The servicer context of each RPC: (request, response) message types.
_GenerateContext = grpc.aio.ServicerContext[engine_pb2.GenerateRequest, engine_pb2.GenerateEvent]
_GenerateBatchContext = grpc.aio.ServicerContext[
    engine_pb2.GenerateBatchRequest, engine_pb2.GenerateEventBatch
]
_AbortContext = grpc.aio.ServicerContext[engine_pb2.AbortRequest, engine_pb2.AbortResponse]
_GetLoadContext = grpc.aio.ServicerContext[engine_pb2.GetLoadRequest, engine_pb2.GetLoadResponse]
_GetStatsContext = grpc.aio.ServicerContext[engine_pb2.GetStatsRequest, engine_pb2.GetStatsResponse]
_DrainContext = grpc.aio.ServicerContext[engine_pb2.DrainRequest, engine_pb2.DrainResponse]
_ListBackendsContext = grpc.aio.ServicerContext[
    engine_pb2.ListBackendsRequest, engine_pb2.ListBackendsResponse
]


class EngineAccess(Protocol):
    """What the Generate path needs of the engine: the EngineCore in its own process, or a front process's
    link to it (server/front_process.py)."""

    @property
    def ready(self) -> bool: ...

    def capabilities(self) -> list[BackendCapability]: ...

    def submit(self, request: GenerateRequest) -> RequestHandle: ...

    def abort(self, request_id: str) -> bool: ...

    def finish(self, request_id: str, reason: FinishReason, matched_stop: str) -> bool: ...

    def settle(self, request_id: str, matched_stop: str) -> bool:
        """The verdict on a request with stop strings that the engine ended on its length (EngineCore.settle):
        ``matched_stop`` when its last tokens completed one, else ""."""
        ...

    def holds(self, request_id: str) -> bool:
        """Whether a request of this id has not yet delivered its terminal event (an aborted one is on its
        way out): its id cannot be taken again until then."""
        ...


class EngineServiceBase(engine_pb2_grpc.EngineServicer):
    """Resolves prompts, admits requests into the engine and streams their events back. Subclasses answer
    the admin RPCs: EngineService from the engine core in this process, FrontService by forwarding them."""

    def __init__(
        self,
        engine: EngineAccess,
        tokenizer: Tokenizer | None,
        model_name: str,
        metrics: EngineMetrics | None = None,
        front: FrontConfig | None = None,
        tracer: RequestTracer | None = None,
        served_names: Sequence[str] = (),
        queue_limit: int = 0,
    ) -> None:
        self._engine = engine
        self.front = front or FrontConfig()
        self._pool: TokenizationPool | None = None
        self.tokenizer = tokenizer
        self.model_name = model_name
        # --served-model-name: further names requests may use for ``model_name``.
        self.served_names = tuple(served_names)
        self._metrics = metrics
        self._tracer = tracer or RequestTracer()
        self._live: set[str] = set()
        self._owners: dict[str, str] = {}  # live request id -> the caller that created it (see caller_of)
        # Live requests the engine has not admitted yet (their prompt is being resolved, or the engine's answer
        # awaited) -> whether an Abort came for them meanwhile: those are aborted as soon as they are admitted.
        self._before_admission: dict[str, bool] = {}
        self._rejected = 0  # refused at the front edge (never reached the engine's counters)
        self._started = time.monotonic()
        # GenerateBatch: requests a call may carry (the engine's --max-queue-len bounds it), the admissions
        # of all calls that may wait for the tokenizer pool at once, and the calls still sending events.
        self._max_batch_requests = max_batch_requests(queue_limit)
        self._batch_tokenizing = asyncio.Semaphore(
            tokenizing_admissions(self.front.max_pending_tokenizations)
        )
        self._open_batch_calls = 0

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._pool.tokenizer if self._pool is not None else None

    @tokenizer.setter
    def tokenizer(self, tokenizer: Tokenizer | None) -> None:
        if self._pool is not None:
            self._pool.close()
        self._pool = (
            TokenizationPool(tokenizer, self.front.tokenizer_threads, self.front.max_pending_tokenizations)
            if tokenizer is not None
            else None
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no Generate or GenerateBatch stream is open (their last events sent); False after
        ``timeout``."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while (self._live or self._open_batch_calls) and loop.time() < end:
            await asyncio.sleep(0.02)
        return not (self._live or self._open_batch_calls)

    # ---- model facts ---------------------------------------------------------------------------------

    def _other_models(self) -> set[str]:
        """Models that only request-level backends serve (e.g. another model behind SGLang)."""
        return {
            c.model.name
            for c in self._engine.capabilities()
            if c.granularity == Granularity.REQUEST and c.model.name and c.model.name != self.model_name
        }

    def _model_limits(self, model: str | None = None) -> tuple[int | None, int | None]:
        """(vocab_size, max_model_len) over the backends serving ``model`` (the strictest)."""
        all_caps = self._engine.capabilities()
        caps = [c for c in all_caps if c.model.name == model] if model else []
        caps = caps or all_caps
        vocab = [c.model.vocab_size for c in caps if c.model.vocab_size > 0]
        lengths = [c.model.max_model_len for c in caps if c.model.max_model_len > 0]
        return (min(vocab) if vocab else None, min(lengths) if lengths else None)

    # ---- request resolution --------------------------------------------------------------------------

    async def _resolve(self, pb: engine_pb2.GenerateRequest, request_id: str) -> GenerateRequest:
        """The contract request of ``pb``: cheap checks first, then tokenization off the event loop."""
        if pb.model and pb.model != self.model_name and pb.model not in self.served_names:
            if pb.model not in self._other_models():
                names = {self.model_name, *self.served_names, *self._other_models()}
                served = ", ".join(repr(m) for m in sorted(names))
                raise _NotFound(f"model '{pb.model}' is not served here (serving {served})")
            return self._resolve_for_request_level(pb, request_id)
        vocab_size, max_model_len = self._model_limits(self.model_name)
        pool = self._pool
        limits = RequestLimits(
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            max_chars_per_token=pool.tokenizer.max_token_chars if pool else DEFAULT_MAX_CHARS_PER_TOKEN,
        )
        request = _request(pb, request_id, self.model_name)
        validate_request(request, limits)  # before any tokenization: a huge prompt costs nothing
        if not (request.chat_messages or request.prompt_text is not None):
            return request  # ids as sent, checked just now
        if request.chat_messages:
            if pool is None:
                raise InvalidArgument("this engine has no tokenizer: send input_ids")
            messages = [{"role": m.role, "content": m.content} for m in request.chat_messages]
            try:
                kwargs = json_format.MessageToDict(pb.messages.chat_template_kwargs)
            except RecursionError:
                raise InvalidArgument("messages.chat_template_kwargs is nested too deeply") from None
            encoded = await pool.encode_chat(messages, self.front.allow_special_tokens_in_chat, kwargs)
            request.prompt_text, request.prompt_token_ids = encoded.text, encoded.token_ids
            request.chat_messages = ()
        elif request.prompt_text is not None and pool is not None:
            request.prompt_token_ids = await pool.encode_prompt(
                request.prompt_text, self.front.allow_special_tokens_in_prompt
            )
        # Without a tokenizer (SGLang alone) prompt text goes to the backend as it is.
        validate_request(request, replace(limits, needs_token_ids=pool is not None))
        return request

    def _resolve_for_request_level(self, pb: engine_pb2.GenerateRequest, request_id: str) -> GenerateRequest:
        """A model only request-level backends serve: they tokenize and apply chat templates themselves, so
        text goes through as text and ids are passed on unchecked against a vocabulary we do not know."""
        if pb.WhichOneof("input") == "messages":
            raise InvalidArgument(
                f"model '{pb.model}' is served by a request-level backend without a chat template here: "
                "send prompt text or input_ids"
            )
        _, max_model_len = self._model_limits(pb.model)
        request = _request(pb, request_id, pb.model)
        validate_request(request, RequestLimits(max_model_len=max_model_len))
        return request

    # ---- RPCs ----------------------------------------------------------------------------------------

    async def admit(
        self, pb: engine_pb2.GenerateRequest, request_id: str, caller: str = "", traceparent: str = ""
    ) -> AdmittedRequest:
        """Validate, resolve and admit one request: the one path every front (gRPC, ominix.worker.v0) takes.

        Raises OminixError when refused (subclasses say which gRPC status fits: not serving, duplicate id,
        unknown model). ``caller`` owns the request (Abort with API keys); ``traceparent`` is the caller's
        W3C trace context. The front streams ``stream(admitted)`` and must ``release`` it.
        """
        span = self.reserve(request_id, caller, traceparent, pb.model)
        return await self.admit_reserved(pb, request_id, caller, span)

    def reserve(self, request_id: str, caller: str, traceparent: str, model: str) -> RequestSpan:
        """The first part of ``admit``, with no await: refuse a bad or duplicate id (or an engine not serving),
        else make the id live. From here Abort finds it (and a duplicate is refused) while the request waits
        for what comes before the engine admits it. Continue with ``admit_reserved``, or ``withdraw``."""
        try:
            validate_request_id(request_id)  # before the id appears in any log line
        except OminixError as exc:
            self._reject(exc.message, "invalid_request_id", counted_by_engine=False)
            raise
        self._check_serving()
        if request_id in self._live:
            self._refuse(AlreadyLive(f"request_id '{request_id}' is already live"))
        if self._engine.holds(request_id):  # its client went away; the engine is still ending it
            self._refuse(
                AlreadyLive(f"request_id '{request_id}' is already live (its previous request is ending)")
            )
        self._live.add(request_id)
        self._owners[request_id] = caller
        self._before_admission[request_id] = False
        return self._tracer.start(request_id, traceparent, model or self.model_name)

    def withdraw(self, request_id: str, span: RequestSpan, model: str) -> None:
        """A reserved request whose client went away (or whose deadline passed) before the engine admitted it:
        counted and logged like any request that never reached the engine."""
        self._forget(request_id)
        self._reject(
            "the client cancelled before admission",
            "cancelled",
            counted_by_engine=False,
            span=span,
            model=self._refused_model(model),
        )

    async def admit_reserved(
        self, pb: engine_pb2.GenerateRequest, request_id: str, caller: str, span: RequestSpan
    ) -> AdmittedRequest:
        """``admit`` after ``reserve``: resolve the prompt and submit it to the engine."""
        try:
            gen_request = await self._resolve(pb, request_id)
            gen_request.traceparent = span.traceparent
        except OminixError as exc:
            self._forget(request_id)
            model = self._refused_model(pb.model)
            self._reject(exc.message, rejection_reason(exc), counted_by_engine=False, span=span, model=model)
            raise
        except asyncio.CancelledError:
            self.withdraw(request_id, span, pb.model)
            raise
        except BaseException as exc:
            self._forget(request_id)
            span.end("error", f"resolving the prompt failed: {exc!r}")  # else it stays open in the tracer
            raise
        gen_request.owner = caller
        try:
            handle = self._engine.submit(gen_request)
            await handle.admitted()  # at once in the engine's process; a front process waits for its answer
        except OminixError as exc:
            self._forget(request_id)
            self._reject(
                exc.message, rejection_reason(exc), counted_by_engine=True, span=span, model=gen_request.model
            )
            raise
        except asyncio.CancelledError:
            # The client went away while a front process waited for the engine's answer: the engine may
            # have admitted the request already, so abort it.
            self._forget(request_id)
            handle.abort()
            span.end("cancelled")
            raise
        except BaseException:
            self._forget(request_id)
            span.end("error", "submit failed")
            raise
        if self._before_admission.pop(request_id, False):  # an Abort came before the engine admitted it
            handle.abort()  # its stream ends with ABORT, as any aborted request's
        _log.debug("request admitted", prompt_tokens=len(gen_request.prompt_token_ids))
        return AdmittedRequest(gen_request, handle, span)

    def stream(self, admitted: AdmittedRequest) -> AsyncIterator[engine_pb2.GenerateEvent]:
        """The admitted request's events (detokenized, stop strings applied), ending with one terminal."""
        return self._events(admitted.request, admitted.handle, admitted.span)

    async def stream_and_release(
        self, admitted: AdmittedRequest
    ) -> AsyncGenerator[engine_pb2.GenerateEvent, None]:
        """``stream(admitted)``, ended by an INTERNAL error event if it fails, then ``release``: exactly one
        terminal event, and the request's end however the consumer stops (which must ``aclose`` it)."""
        finished = False
        last: engine_pb2.GenerateEvent | None = None
        try:
            try:
                async for event in self.stream(admitted):
                    last = event
                    yield event
                finished = True
            except Exception as exc:  # a bug here must still end the stream with one terminal event
                _log.exception("generate stream failed")
                last = engine_pb2.GenerateEvent(
                    request_id=admitted.request.request_id,
                    error=wire.error_info_to_pb(RuntimeErrorKind.INTERNAL, repr(exc)),
                )
                yield last
        finally:
            self.release(admitted, finished, last)

    def release(
        self, admitted: AdmittedRequest, finished: bool, last: engine_pb2.GenerateEvent | None
    ) -> None:
        """End an admitted request's life at its front; unless it finished, abort it (frees its KV at once)."""
        self._forget(admitted.request.request_id)
        try:
            if not finished:
                # The client went away (or the stream failed).
                _log.info("stream ended early, aborting request")
                admitted.handle.abort()
        finally:  # after the abort, so the engine's run report has added the phases
            if last is not None and last.HasField("error"):
                admitted.span.end("error", last.error.message)
            else:
                admitted.span.end("done" if finished else "cancelled")

    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: _GenerateContext
    ) -> AsyncIterator[engine_pb2.GenerateEvent]:
        large = request.ByteSize() >= memory.LARGE_ALLOCATION_BYTES
        try:
            async for event in self._generate(request, context):
                yield event
        finally:
            if large:  # megabytes of request text were just freed: hand them back (off the event loop)
                asyncio.get_running_loop().run_in_executor(None, memory.trim)

    async def _generate(
        self, request: engine_pb2.GenerateRequest, context: _GenerateContext
    ) -> AsyncIterator[engine_pb2.GenerateEvent]:
        request_id = request.request_id or uuid.uuid4().hex
        with request_context(request_id[:256]):  # the id is validated in admit before anything logs it
            try:
                traceparent = traceparent_from_grpc_metadata(context.invocation_metadata())
                admitted = await self.admit(request, request_id, caller_of(context), traceparent)
            except OminixError as exc:
                await abort_call(context, exc)
            async with contextlib.aclosing(self.stream_and_release(admitted)) as events:
                async for event in events:
                    yield event

    def _check_serving(self) -> None:
        if not self._engine.ready:
            raise _NotServing(
                RuntimeErrorKind.BACKEND_UNAVAILABLE,
                "the engine is not serving (starting, shutting down, no worker is up, or every one is drained)",
            )

    async def GenerateBatch(
        self, request: engine_pb2.GenerateBatchRequest, context: _GenerateBatchContext
    ) -> AsyncIterator[engine_pb2.GenerateEventBatch]:
        try:
            ids = batch_request_ids(request, self._max_batch_requests)
        except OminixError as exc:
            self._reject(exc.message, exc.kind.name.lower(), counted_by_engine=False)
            await abort_call(context, exc)
        try:
            self._check_serving()  # as admit refuses one request: not counted as a rejection
        except OminixError as exc:
            await abort_call(context, exc)
        large = request.ByteSize() >= memory.LARGE_ALLOCATION_BYTES
        traceparent = traceparent_from_grpc_metadata(context.invocation_metadata())
        call = BatchCall(self, caller_of(context), traceparent, self._batch_tokenizing)
        events = call.events(list(request.requests), ids)
        self._open_batch_calls += 1
        try:
            async for batch in events:
                yield batch
        finally:
            await events.aclose()
            self._open_batch_calls -= 1
            if large:
                asyncio.get_running_loop().run_in_executor(None, memory.trim)

    def _forget(self, request_id: str) -> None:
        self._live.discard(request_id)
        self._owners.pop(request_id, None)
        self._before_admission.pop(request_id, None)

    def may_abort(self, request_id: str, caller: str) -> bool:
        """Whether ``caller`` may abort a request of that id: anyone without API keys; with them only the caller
        that created it (to any other the id does not exist, so ids of others cannot be probed)."""
        return self._owned_by(self._owners.get(request_id), caller)

    def _owned_by(self, owner: str | None, caller: str) -> bool:
        return not self.front.api_keys or owner == caller

    def abort_live(self, request_id: str) -> bool:
        """Abort a live request of this service; False when it has none of that id. One the engine has not
        admitted yet (its prompt still being resolved) is aborted once admitted."""
        if request_id not in self._live:
            return False
        if self._engine.abort(request_id):
            return True
        if request_id in self._before_admission:
            self._before_admission[request_id] = True
            return True
        return False

    def _refused_model(self, requested: str) -> str:
        """The model a refusal of a request naming ``requested`` is counted under: that model when only a
        request-level backend serves it, else "" (the engine's own model: its served names map to it, and a
        name not served here is the client's choice, which must not make a metric series per name)."""
        return requested if requested and requested in self._other_models() else ""

    def _refuse(self, error: OminixError) -> NoReturn:
        """Count and log ``error`` as a refusal by this front, then raise it."""
        self._reject(error.message, rejection_reason(error), counted_by_engine=False)
        raise error

    def _reject(
        self,
        message: str,
        reason: str,
        counted_by_engine: bool,
        span: RequestSpan | None = None,
        model: str = "",
    ) -> None:
        """Count and log a refused request; ``model`` labels its metric ("" for the engine's own model)."""
        if span is not None:
            span.end("rejected", message)
        if not counted_by_engine:
            self._rejected += 1
        _log.info("request rejected", reason=message)
        if self._metrics is not None:
            self._metrics.observe_rejection(reason, model)

    async def _events(
        self, req: GenerateRequest, handle: RequestHandle, span: RequestSpan
    ) -> AsyncIterator[engine_pb2.GenerateEvent]:
        rid = req.request_id
        # Another model's tokens are not ours to decode: its request-level backend sends the text.
        tokenizer = self.tokenizer if req.model in ("", self.model_name) else None
        output = OutputText(
            tokenizer, req.sampling.stop, req.prompt_token_ids, min_tokens=req.sampling.min_tokens
        )
        matched_stop: str | None = None
        num_emitted_tokens = 0
        usage: Usage | None = None
        while events := await handle.next_events():
            for event in events:
                if isinstance(event, PrefillDone):
                    if req.stream:
                        yield engine_pb2.GenerateEvent(
                            request_id=rid,
                            prefill_done=engine_pb2.PrefillDone(
                                prompt_tokens=event.prompt_tokens,
                                cached_tokens=event.cached_tokens,
                                ttft_seconds=time.monotonic() - req.arrival_time,
                            ),
                        )
                elif isinstance(event, Token):
                    if matched_stop is not None:
                        continue  # tokens of steps already in flight when the stop string matched
                    span.first_token()
                    started = time.perf_counter()
                    match = output.push(event.token_ids, event.text, event.ended_by_stop_token)
                    span.detokenized(time.perf_counter() - started)
                    num_emitted_tokens += len(event.token_ids)
                    if match.matched_stop is not None:
                        matched_stop = match.matched_stop
                        self._engine.finish(rid, FinishReason.STOP, matched_stop)
                    if req.stream:
                        # Filled in place: nested constructors cost several times more, 256 times a step.
                        out = engine_pb2.GenerateEvent(request_id=rid)
                        chunk = out.token
                        chunk.SetInParent()
                        chunk.token_ids.extend(event.token_ids)
                        if match.text:
                            chunk.text = match.text
                        if event.logprobs:
                            chunk.logprobs.extend(wire.logprobs_to_pb(lp) for lp in event.logprobs)
                        yield out
                elif isinstance(event, Usage):
                    usage = event
                elif isinstance(event, Done):
                    backend_stop = event.matched_stop if event.finish_reason == FinishReason.STOP else None
                    tail = output.finish(backend_stop or None)
                    if tail.matched_stop is not None and matched_stop is None:
                        matched_stop = tail.matched_stop
                    if req.sampling.stop and event.finish_reason == FinishReason.LENGTH:
                        # Before any yield: a client gone at this point must not leave the verdict unsaid.
                        self._engine.settle(rid, matched_stop or "")  # the reason its log and metrics name
                    if req.stream and tail.text:
                        yield engine_pb2.GenerateEvent(
                            request_id=rid, token=engine_pb2.TokenChunk(text=tail.text)
                        )
                    completion_tokens = num_emitted_tokens if matched_stop is not None else None
                    yield self._usage_event(rid, req, usage, completion_tokens)
                    finish_reason = FinishReason.STOP if matched_stop is not None else event.finish_reason
                    # The backend's own text only when it sent its text there alone: after a stop string the
                    # front matched, the output's text (maybe empty) is the answer.
                    kept = output.text or matched_stop is not None or not event.text
                    text = output.text if kept else event.text
                    yield engine_pb2.GenerateEvent(
                        request_id=rid,
                        done=engine_pb2.Done(
                            finish_reason=wire.finish_reason_to_pb(finish_reason),
                            text=text,
                            matched_stop=matched_stop if matched_stop is not None else event.matched_stop,
                        ),
                    )
                    _log.debug("request done", finish_reason=FinishReason(finish_reason).name)
                    return
                elif isinstance(event, Error):
                    # Tokens of a request that does not stream never left this process: a retry repeats nothing
                    # the user saw.
                    tokens_sent = req.stream and num_emitted_tokens > 0
                    yield engine_pb2.GenerateEvent(
                        request_id=rid,
                        error=wire.error_info_to_pb(
                            event.kind, event.message, is_retryable(event.kind, tokens_sent=tokens_sent)
                        ),
                    )
                    return
        # The handle ended without a terminal event: report it rather than leaving the client guessing.
        yield engine_pb2.GenerateEvent(
            request_id=rid,
            error=wire.error_info_to_pb(
                RuntimeErrorKind.INTERNAL, "request stream ended without a terminal event"
            ),
        )

    @staticmethod
    def _usage_event(
        rid: str, req: GenerateRequest, usage: Usage | None, completion_tokens: int | None
    ) -> engine_pb2.GenerateEvent:
        prompt_tokens = usage.prompt_tokens if usage else len(req.prompt_token_ids)
        completion = usage.completion_tokens if usage else 0
        if completion_tokens is not None:
            completion = min(completion, completion_tokens) if usage else completion_tokens
        return engine_pb2.GenerateEvent(
            request_id=rid,
            usage=common_pb2.Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion,
                cached_tokens=usage.cached_tokens if usage else 0,
            ),
        )

    async def Abort(
        self, request: engine_pb2.AbortRequest, context: _AbortContext
    ) -> engine_pb2.AbortResponse:
        rid = request.request_id
        try:
            validate_request_id(rid)
        except OminixError as exc:
            await abort_call(context, exc)
        found = rid in self._live
        if not found:
            return await self._abort_elsewhere(request, context)
        if not self.may_abort(rid, caller_of(context)):
            await abort_call(context, UnknownId(f"no live request '{rid}' of this API key"))
        return engine_pb2.AbortResponse(found=self.abort_live(rid))

    async def _abort_elsewhere(
        self, request: engine_pb2.AbortRequest, context: _AbortContext
    ) -> engine_pb2.AbortResponse:
        """Abort of a request this service does not stream (another front's, or unknown)."""
        if self.front.api_keys:
            # With API keys a request belongs to the key that created it; to any other key it does not
            # exist (the same answer as an unknown id, so ids of others cannot be probed).
            await abort_call(context, UnknownId(f"no live request '{request.request_id}' of this API key"))
        return engine_pb2.AbortResponse(found=False)


class FrontProcesses(Protocol):
    """What the engine process's service asks of its front processes (server/front_hub.py)."""

    def push_readiness(self) -> None:
        """Tell every front the engine's readiness now if it changed."""

    def resolving_owner(self, request_id: str) -> str | None:
        """The owner of a request a front holds before submitting it (its prompt being tokenized)."""

    def abort_resolving(self, request_id: str) -> None:
        """Have the front holding that request abort it (once admitted, it ends with ABORT)."""


class EngineService(EngineServiceBase):
    """The Engine service of the process that runs the engine core: the admin RPCs answer from it, and the
    requests of front processes (server/front_hub.py) are tracked here too, so Abort, GetStats and the
    drain at shutdown see every live request."""

    def __init__(
        self,
        engine: EngineCore,
        tokenizer: Tokenizer | None,
        model_name: str,
        metrics: EngineMetrics | None = None,
        front: FrontConfig | None = None,
        tracer: RequestTracer | None = None,
        served_names: Sequence[str] = (),
        queue_limit: int = 0,
    ) -> None:
        super().__init__(engine, tokenizer, model_name, metrics, front, tracer, served_names, queue_limit)
        self._core = engine
        # The front processes (FrontHub), when this service answers for them.
        self.fronts: FrontProcesses | None = None

    def track(self, request_id: str, owner: str) -> None:
        """A front process's request the engine admitted: live until ``forget``."""
        self._live.add(request_id)
        self._owners[request_id] = owner

    def forget(self, request_id: str) -> None:
        self._forget(request_id)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._live

    def count_refusal(self, message: str, reason: str, counted_by_engine: bool, model: str = "") -> None:
        """A refusal at a front process (or by the engine, of a front's request): GetStats and metrics."""
        self._reject(message, reason, counted_by_engine, model=model)

    async def _abort_elsewhere(
        self, request: engine_pb2.AbortRequest, context: _AbortContext
    ) -> engine_pb2.AbortResponse:
        """An id no stream here holds yet may be a front process's request still being tokenized (the Abort
        came through another front): that front aborts it once it is admitted."""
        rid = request.request_id
        fronts = self.fronts
        if fronts is not None:
            owner = fronts.resolving_owner(rid)
            if owner is not None and self._owned_by(owner, caller_of(context)):
                fronts.abort_resolving(rid)
                return engine_pb2.AbortResponse(found=True)
        return await super()._abort_elsewhere(request, context)

    async def GetLoad(
        self, request: engine_pb2.GetLoadRequest, context: _GetLoadContext
    ) -> engine_pb2.GetLoadResponse:
        backends = self.backend_loads()
        return engine_pb2.GetLoadResponse(
            total=wire.total_load_to_pb(backends, int(time.time() * 1000)), backends=backends
        )

    def backend_loads(self, worker_ids: set[str] | None = None) -> list[engine_pb2.BackendLoad]:
        """GetLoad's per-backend entries (optionally only ``worker_ids``)."""
        out = []
        for load in self._core.load():
            if worker_ids is not None and load.worker_id not in worker_ids:
                continue
            aliases = tuple(sorted(self.served_names)) if self.model_name in load.model_ids else ()
            out.append(wire.backend_load_to_pb(load, aliases))
        return out

    async def Drain(
        self, request: engine_pb2.DrainRequest, context: _DrainContext
    ) -> engine_pb2.DrainResponse:
        return await self._drain(request, context, draining=True)

    async def Undrain(
        self, request: engine_pb2.DrainRequest, context: _DrainContext
    ) -> engine_pb2.DrainResponse:
        return await self._drain(request, context, draining=False)

    async def _drain(
        self, request: engine_pb2.DrainRequest, context: _DrainContext, draining: bool
    ) -> engine_pb2.DrainResponse:
        try:
            changed = self._core.drain(request.worker_id, draining=draining)
        except OminixError as exc:
            await abort_call(context, UnknownId(exc.message))
        if self.fronts is not None:
            # They learn it now, not at their next poll: a request sent after the answer is judged by it. The
            # front that forwarded this call reads it from the answer itself (its next request may come
            # before the link's frame is read).
            self.fronts.push_readiness()
            context.set_trailing_metadata(((READY_METADATA_KEY, "true" if self._core.ready else "false"),))
        return engine_pb2.DrainResponse(backends=self.backend_loads(set(changed)))

    async def GetStats(
        self, request: engine_pb2.GetStatsRequest, context: _GetStatsContext
    ) -> engine_pb2.GetStatsResponse:
        stats = self._core.stats()
        return engine_pb2.GetStatsResponse(
            requests_accepted=stats.accepted,
            requests_finished=stats.finished,
            requests_aborted=stats.aborted,
            requests_failed=stats.failed,
            requests_rejected=stats.rejected + self._rejected,
            prompt_tokens=stats.prompt_tokens,
            generated_tokens=stats.generated_tokens,
            cached_tokens=stats.cached_tokens,
            preemptions=stats.preemptions,
            steps=stats.steps,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            uptime_seconds=time.monotonic() - self._started,
        )

    async def ListBackends(
        self, request: engine_pb2.ListBackendsRequest, context: _ListBackendsContext
    ) -> engine_pb2.ListBackendsResponse:
        return engine_pb2.ListBackendsResponse(
            backends=[wire.capability_to_pb(c) for c in self._core.capabilities()]
        )


@dataclass(slots=True)
class AdmittedRequest:
    """A request a front got admitted: what it streams and later releases."""

    request: GenerateRequest
    handle: RequestHandle
    span: RequestSpan


class _NotFound(OminixError):
    """The request names a model this engine does not serve (the contract's CAPABILITY_MISMATCH)."""

    def __init__(self, message: str) -> None:
        super().__init__(RuntimeErrorKind.CAPABILITY_MISMATCH, message)


class _NotServing(OminixError):
    """The engine is starting, stopping or has no backend up."""


class AlreadyLive(InvalidArgument):
    """The request id is in use by a live request."""


class UnknownId(InvalidArgument):
    """The call names a request or backend that this engine does not have (to this caller)."""


_STATUS_OF_REFUSAL: dict[type[OminixError], grpc.StatusCode] = {
    _NotFound: grpc.StatusCode.NOT_FOUND,
    _NotServing: grpc.StatusCode.UNAVAILABLE,
    AlreadyLive: grpc.StatusCode.ALREADY_EXISTS,
    UnknownId: grpc.StatusCode.NOT_FOUND,
}


# Trailing metadata of a Drain or Undrain answered for a front process: whether the engine is ready now.
READY_METADATA_KEY = "ominix-engine-ready"


# The metric's reason for refusals that are more than their error kind (see REJECTION_REASONS).
_REASON_OF_REFUSAL: dict[type[OminixError], str] = {
    _NotFound: "model_not_found",
    AlreadyLive: "duplicate_request_id",
}


def rejection_reason(error: OminixError) -> str:
    """The ``reason`` label a refusal with ``error`` is counted under."""
    return _REASON_OF_REFUSAL.get(type(error), error.kind.name.lower())


def status_for(error: OminixError) -> grpc.StatusCode:
    refusal = _STATUS_OF_REFUSAL.get(type(error))
    return refusal if refusal is not None else STATUS_OF_ERROR.get(error.kind, grpc.StatusCode.INTERNAL)


async def abort_call(context: grpc.aio.ServicerContext[Any, Any], error: OminixError) -> NoReturn:
    """End the call refused with ``error``: its status, message, and the contract's error kind in metadata."""
    await context.abort(status_for(error), error.message, trailing_metadata=error_metadata(error.kind))


__all__ = [
    "AlreadyLive",
    "EngineAccess",
    "EngineService",
    "EngineServiceBase",
    "STATUS_OF_ERROR",
    "UnknownId",
    "rejection_reason",
    "status_for",
]


def _request(pb: engine_pb2.GenerateRequest, request_id: str, model: str) -> GenerateRequest:
    """The contract request as the client sent it (text and chat turns not yet tokenized)."""
    which = pb.WhichOneof("input")
    if which is None:
        raise InvalidArgument("one of prompt, messages or input_ids is required")
    if which == "messages" and not pb.messages.messages:
        raise InvalidArgument("messages is empty")
    if pb.priority and pb.priority not in _PRIORITIES:
        raise InvalidArgument(f"priority {pb.priority} is not one of {sorted(_PRIORITIES)} (or unset)")
    arrival = time.monotonic()
    return GenerateRequest(
        request_id=request_id,
        prompt_token_ids=wire.int_list(pb.input_ids.ids) if which == "input_ids" else [],
        sampling=wire.sampling_from_pb(pb.sampling),
        model=model,
        priority=Priority(pb.priority) if pb.priority else Priority.INTERACTIVE,
        arrival_time=arrival,
        deadline=arrival + pb.deadline_ms / 1000.0 if pb.deadline_ms else None,
        stream=pb.stream if pb.HasField("stream") else True,
        prompt_text=pb.prompt if which == "prompt" else None,
        chat_messages=tuple(ChatMessage(m.role, m.content) for m in pb.messages.messages),
    )
