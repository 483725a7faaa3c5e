"""gRPC servicer of ominix.runtime.v1.Engine: the front edge where text becomes tokens and back."""

from __future__ import annotations

import inspect
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio

from ominix_runtime import wire
from ominix_runtime.contract import (
    Done,
    Error,
    FinishReason,
    GenerateRequest,
    Granularity,
    InvalidArgument,
    OminixError,
    PrefillDone,
    Priority,
    RuntimeErrorKind,
    SamplingParams,
    Token,
    Usage,
)
from ominix_runtime.engine.stats import LoadSnapshot
from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc
from ominix_runtime.server.logging import get_logger, request_context
from ominix_runtime.server.metrics import EngineMetrics
from ominix_runtime.server.tracing import RequestSpan, RequestTracer, traceparent_from_grpc_metadata
from ominix_runtime.text import OutputText, Tokenizer

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

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
_PRIORITIES = frozenset(int(p) for p in Priority)

_log = get_logger("ominix.server")


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class EngineService(engine_pb2_grpc.EngineServicer):
    """Resolves prompts, admits requests into the engine core and streams their events back."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Tokenizer | None,
        model_name: str,
        metrics: EngineMetrics | None = None,
        tracer: RequestTracer | None = None,
    ) -> None:
        self._engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._metrics = metrics
        self._tracer = tracer or RequestTracer()
        self._live: set[str] = set()
        self._rejected = 0  # refused at the front edge (never reached the engine's counters)
        self._started = time.monotonic()

    # ---- model facts ---------------------------------------------------------------------------------

    def _other_models(self) -> set[str]:
        """Models that only request-level backends serve (e.g. another model behind SGLang)."""
        return {
            c.model.name
            for c in self._engine.capabilities() or []
            if c.granularity == Granularity.REQUEST and c.model.name and c.model.name != self.model_name
        }

    def _model_limits(self, model: str | None = None) -> tuple[int | None, int | None]:
        """(vocab_size, max_model_len) over the backends serving ``model`` (the strictest)."""
        all_caps = list(self._engine.capabilities() or [])
        caps = [c for c in all_caps if c.model.name == model] if model else []
        caps = caps or all_caps
        vocab = [c.model.vocab_size for c in caps if c.model.vocab_size > 0]
        lengths = [c.model.max_model_len for c in caps if c.model.max_model_len > 0]
        return (min(vocab) if vocab else None, min(lengths) if lengths else None)

    # ---- request resolution --------------------------------------------------------------------------

    def _resolve(self, pb: engine_pb2.GenerateRequest, request_id: str) -> GenerateRequest:
        if pb.model and pb.model != self.model_name:
            if pb.model not in self._other_models():
                served = ", ".join(repr(m) for m in sorted({self.model_name, *self._other_models()}))
                raise _NotFound(f"model '{pb.model}' is not served here (serving {served})")
            return self._resolve_for_request_level(pb, request_id)
        vocab_size, max_model_len = self._model_limits(self.model_name)
        sampling = wire.sampling_from_pb(pb.sampling).validate(vocab_size, max_model_len)
        which = pb.WhichOneof("input")
        prompt_text: str | None = None
        if which == "input_ids":
            prompt_ids = list(pb.input_ids.ids)
            if vocab_size is not None and any(t >= vocab_size for t in prompt_ids):
                raise InvalidArgument(f"input_ids contain ids outside the vocabulary [0, {vocab_size})")
        elif which == "prompt":
            prompt_text = pb.prompt
            # Without a tokenizer (SGLang alone) the text goes to the backend as is.
            prompt_ids = self.tokenizer.encode(pb.prompt) if self.tokenizer is not None else []
        elif which == "messages":
            messages = [{"role": m.role, "content": m.content} for m in pb.messages.messages]
            if not messages:
                raise InvalidArgument("messages is empty")
            for i, m in enumerate(messages):
                if m["role"] not in CHAT_ROLES:
                    raise InvalidArgument(
                        f"messages[{i}].role {m['role']!r} is not one of {', '.join(sorted(CHAT_ROLES))}"
                    )
            tokenizer = self._require_tokenizer()
            prompt_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
        else:
            raise InvalidArgument("one of prompt, messages or input_ids is required")
        if not prompt_ids and prompt_text is None:
            raise InvalidArgument("the prompt is empty")
        if self.tokenizer is not None and not prompt_ids:
            raise InvalidArgument("the prompt is empty")
        if max_model_len is not None and len(prompt_ids) >= max_model_len:
            raise InvalidArgument(
                f"prompt has {len(prompt_ids)} tokens; the model's context length is {max_model_len}"
            )
        return _request(pb, request_id, prompt_ids, sampling, self.model_name, prompt_text)

    def _resolve_for_request_level(self, pb: engine_pb2.GenerateRequest, request_id: str) -> GenerateRequest:
        """A model only request-level backends serve: they tokenize and apply chat templates themselves, so
        text goes through as text and ids are passed on unchecked against a vocabulary we do not know."""
        _, max_model_len = self._model_limits(pb.model)
        sampling = wire.sampling_from_pb(pb.sampling).validate(None, max_model_len)
        which = pb.WhichOneof("input")
        if which == "input_ids":
            prompt_ids, prompt_text = list(pb.input_ids.ids), None
        elif which == "prompt":
            prompt_ids, prompt_text = [], pb.prompt
        elif which == "messages":
            raise InvalidArgument(
                f"model '{pb.model}' is served by a request-level backend without a chat template here: "
                "send prompt text or input_ids"
            )
        else:
            raise InvalidArgument("one of prompt, messages or input_ids is required")
        if not prompt_ids and not prompt_text:
            raise InvalidArgument("the prompt is empty")
        return _request(pb, request_id, prompt_ids, sampling, pb.model, prompt_text)

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise InvalidArgument("this engine has no tokenizer: send input_ids")
        return self.tokenizer

    # ---- RPCs ----------------------------------------------------------------------------------------

    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateEvent]:
        request_id = request.request_id or uuid.uuid4().hex
        with request_context(request_id):
            if not self._engine.ready:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    "the engine is not serving (starting, shutting down, or no worker is up)",
                )
            if request_id in self._live:
                await context.abort(
                    grpc.StatusCode.ALREADY_EXISTS, f"request_id '{request_id}' is already live"
                )
            self._live.add(request_id)  # before any await, so a concurrent duplicate sees it
            span = self._tracer.start(
                request_id,
                traceparent_from_grpc_metadata(context.invocation_metadata()),
                request.model or self.model_name,
            )
            try:
                gen_request = self._resolve(request, request_id)
                gen_request.traceparent = span.traceparent
            except _NotFound as exc:
                self._live.discard(request_id)
                self._reject(str(exc), "model_not_found", counted_by_engine=False, span=span)
                await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            except OminixError as exc:
                self._live.discard(request_id)
                self._reject(exc.message, exc.kind.name.lower(), counted_by_engine=False, span=span)
                await context.abort(status_for(exc), exc.message)
            try:
                handle = await _maybe_await(self._engine.submit(gen_request))
            except OminixError as exc:
                self._live.discard(request_id)
                self._reject(exc.message, exc.kind.name.lower(), counted_by_engine=True, span=span)
                await context.abort(status_for(exc), exc.message)
            except BaseException:
                self._live.discard(request_id)
                span.end("error", "submit failed")
                raise
            _log.debug("request admitted", prompt_tokens=len(gen_request.prompt_token_ids))
            finished = False
            last: engine_pb2.GenerateEvent | None = None
            try:
                try:
                    async for event in self._events(gen_request, handle, span):
                        last = event
                        yield event
                    finished = True
                except Exception as exc:  # a bug here must still end the stream with one terminal event
                    _log.exception("generate stream failed")
                    last = engine_pb2.GenerateEvent(
                        request_id=request_id,
                        error=common_pb2.ErrorInfo(code=int(RuntimeErrorKind.INTERNAL), message=repr(exc)),
                    )
                    yield last
            finally:
                self._live.discard(request_id)
                try:
                    if not finished:
                        # The client went away (or the stream failed): free the request's KV at once.
                        _log.info("stream ended early, aborting request")
                        await _maybe_await(handle.abort())
                finally:  # after the abort, so the engine's run report has added the phases
                    if last is not None and last.HasField("error"):
                        span.end("error", last.error.message)
                    else:
                        span.end("done" if finished else "cancelled")

    def _reject(self, message: str, reason: str, counted_by_engine: bool, span: RequestSpan) -> None:
        span.end("rejected", message)
        if not counted_by_engine:
            self._rejected += 1
        _log.info("request rejected", reason=message)
        if self._metrics is not None:
            self._metrics.observe_rejection(reason)

    async def _events(
        self, req: GenerateRequest, handle: Any, span: RequestSpan
    ) -> AsyncIterator[engine_pb2.GenerateEvent]:
        rid = req.request_id
        # Another model's tokens are not ours to decode: its request-level backend sends the text.
        tokenizer = self.tokenizer if req.model in ("", self.model_name) else None
        output = OutputText(tokenizer, req.sampling.stop, req.prompt_token_ids)
        matched_stop: str | None = None
        num_emitted_tokens = 0
        usage: Usage | None = None
        async for event in handle:
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
                match = output.push(event.token_ids, event.text)
                span.detokenized(time.perf_counter() - started)
                num_emitted_tokens += len(event.token_ids)
                if match.matched_stop is not None:
                    matched_stop = match.matched_stop
                    await _maybe_await(self._engine.finish(rid, FinishReason.STOP, matched_stop))
                if req.stream:
                    yield engine_pb2.GenerateEvent(
                        request_id=rid,
                        token=engine_pb2.TokenChunk(
                            token_ids=event.token_ids,
                            text=match.text,
                            logprobs=[wire.logprobs_to_pb(lp) for lp in event.logprobs],
                        ),
                    )
            elif isinstance(event, Usage):
                usage = event
            elif isinstance(event, Done):
                backend_stop = event.matched_stop if event.finish_reason == FinishReason.STOP else None
                tail = output.finish(backend_stop or None)
                if tail.matched_stop is not None and matched_stop is None:
                    matched_stop = tail.matched_stop
                if req.stream and tail.text:
                    yield engine_pb2.GenerateEvent(
                        request_id=rid, token=engine_pb2.TokenChunk(text=tail.text)
                    )
                completion_tokens = num_emitted_tokens if matched_stop is not None else None
                yield self._usage_event(rid, req, usage, completion_tokens)
                finish_reason = FinishReason.STOP if matched_stop is not None else event.finish_reason
                text = output.text if (output.text or not event.text) else event.text
                yield engine_pb2.GenerateEvent(
                    request_id=rid,
                    done=engine_pb2.Done(
                        finish_reason=int(finish_reason),
                        text=text,
                        matched_stop=matched_stop if matched_stop is not None else event.matched_stop,
                    ),
                )
                _log.debug("request done", finish_reason=FinishReason(finish_reason).name)
                return
            elif isinstance(event, Error):
                yield engine_pb2.GenerateEvent(
                    request_id=rid, error=common_pb2.ErrorInfo(code=int(event.kind), message=event.message)
                )
                return
        # The handle ended without a terminal event: report it rather than leaving the client guessing.
        yield engine_pb2.GenerateEvent(
            request_id=rid,
            error=common_pb2.ErrorInfo(
                code=int(RuntimeErrorKind.INTERNAL), message="request stream ended without a terminal event"
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

    async def Abort(self, request: engine_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> Any:
        found = request.request_id in self._live
        if found:
            result = await _maybe_await(self._engine.abort(request.request_id))
            found = bool(result) if isinstance(result, bool) else found
        return engine_pb2.AbortResponse(found=found)

    async def GetLoad(self, request: engine_pb2.GetLoadRequest, context: grpc.aio.ServicerContext) -> Any:
        loads = list(await _maybe_await(self._engine.load()))
        backends = [_backend_load_pb(load) for load in loads]
        total = engine_pb2.BackendLoad(
            worker_id="total",
            queued_requests=sum(b.queued_requests for b in backends),
            running_requests=sum(b.running_requests for b in backends),
            waiting_tokens=sum(b.waiting_tokens for b in backends),
            kv_bytes_used=sum(b.kv_bytes_used for b in backends),
            kv_bytes_capacity=sum(b.kv_bytes_capacity for b in backends),
            estimated_decode_tokens_per_second=sum(b.estimated_decode_tokens_per_second for b in backends),
            healthy=bool(backends) and any(b.healthy for b in backends),
        )
        return engine_pb2.GetLoadResponse(total=total, backends=backends)

    async def GetStats(self, request: engine_pb2.GetStatsRequest, context: grpc.aio.ServicerContext) -> Any:
        stats = await _maybe_await(self._engine.stats())
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
        self, request: engine_pb2.ListBackendsRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        return engine_pb2.ListBackendsResponse(
            backends=[wire.capability_to_pb(c) for c in self._engine.capabilities() or []]
        )


def _backend_load_pb(load: LoadSnapshot) -> engine_pb2.BackendLoad:
    return engine_pb2.BackendLoad(
        worker_id=load.worker_id,
        queued_requests=load.queued_requests,
        running_requests=load.running_requests,
        waiting_tokens=load.waiting_tokens,
        kv_bytes_used=load.kv_bytes_used,
        kv_bytes_capacity=load.kv_bytes_capacity,
        estimated_decode_tokens_per_second=load.estimated_decode_tokens_per_second,
        healthy=load.healthy,
    )


class _NotFound(Exception):
    """The request names a model this engine does not serve."""


def status_for(error: OminixError) -> grpc.StatusCode:
    return STATUS_OF_ERROR.get(error.kind, grpc.StatusCode.INTERNAL)


__all__ = ["EngineService", "STATUS_OF_ERROR", "status_for"]


def _request(
    pb: engine_pb2.GenerateRequest,
    request_id: str,
    prompt_ids: list[int],
    sampling: SamplingParams,
    model: str,
    prompt_text: str | None,
) -> GenerateRequest:
    """The contract request: priority, deadline and stream mode come from the wire request as they are."""
    if pb.priority and pb.priority not in _PRIORITIES:
        raise InvalidArgument(f"priority {pb.priority} is not one of {sorted(_PRIORITIES)} (or unset)")
    arrival = time.monotonic()
    return GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        model=model,
        priority=Priority(pb.priority) if pb.priority else Priority.INTERACTIVE,
        arrival_time=arrival,
        deadline=arrival + pb.deadline_ms / 1000.0 if pb.deadline_ms else None,
        stream=pb.stream if pb.HasField("stream") else True,
        prompt_text=prompt_text,
    )
