"""Request-level backend: an SGLang server reached over its native HTTP API.

Whole requests are forwarded to ``POST /generate`` with ``stream: true``; SGLang owns batching and KV, the
engine keeps admission, priority, streams and metrics. The SSE chunks (``data: {...}``, ending with
``data: [DONE]``) are mapped onto contract events by :class:`SGLangStreamMapper`, which is pure and
unit-testable. Field names follow SGLang's ``GenerateReqInput`` / ``SamplingParams`` and the
``meta_info`` its tokenizer manager attaches to every chunk.

Control endpoints: the current ``/model_info``, ``/server_info`` and ``/v1/loads`` first, the deprecated
``/get_model_info``, ``/get_server_info`` and ``/get_load`` when a server answers 404 (older releases). With
``api_key`` every call carries ``Authorization: Bearer <key>`` (SGLang's ``--api-key``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import aiohttp

from ominix_runtime.contract import (
    SGLANG_PROFILE,
    BackendCapability,
    Done,
    Error,
    FinishReason,
    GenerateRequest,
    ModelInfo,
    OminixError,
    PrefillDone,
    RuntimeErrorKind,
    SampledLogprobs,
    SamplingParams,
    Token,
    TokenLogprob,
    Usage,
    WorkerEvent,
)

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_STREAM_IDLE_TIMEOUT_S = 600.0
DEFAULT_ABORT_GRACE_S = 5.0
MAX_SSE_LINE_BYTES = 64 * 1024 * 1024  # cumulative chunks of very long outputs stay well below this
MAX_ERROR_BODY_CHARS = 2000
# SGLang does not state its vocabulary or EOS ids over HTTP; it tokenizes, validates and stops by itself.
# An unstated vocabulary is 0, which the engine reads as "unknown" (no token-id range checks).
UNKNOWN_VOCAB_SIZE = 0

StreamMode = Literal["auto", "cumulative", "incremental"]

# (current, deprecated) paths of each control endpoint.
MODEL_INFO_PATHS = ("/model_info", "/get_model_info")
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
LOAD_PATHS = ("/v1/loads?include=core,memory", "/get_load")
# SGLang's memory report is in GiB (its ``GB`` constant is 1 << 30).
BYTES_PER_GIB = 1 << 30
# Our priority classes (1 realtime .. 3 batch, lower first) as SGLang priority values, where by default a
# larger value is scheduled first (``--schedule-low-priority-values-first`` reverses it).
SGLANG_PRIORITY_HIGH_FIRST = {1: 2, 2: 1, 3: 0}


def sampling_params_payload(sampling: SamplingParams) -> dict[str, Any]:
    """SGLang ``sampling_params`` for one request (names from SGLang's SamplingParams)."""
    out: dict[str, Any] = {
        "max_new_tokens": sampling.max_tokens,
        "min_new_tokens": sampling.min_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "ignore_eos": sampling.ignore_eos,
        "repetition_penalty": sampling.repetition_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
    }
    if sampling.stop:
        out["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        out["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.seed is not None:
        out["sampling_seed"] = sampling.seed
    return out


def sglang_priority(priority: int, low_values_first: bool) -> int:
    """Our priority class as SGLang's integer priority under the server's ordering."""
    high_first = SGLANG_PRIORITY_HIGH_FIRST.get(int(priority), 1)
    return max(SGLANG_PRIORITY_HIGH_FIRST.values()) - high_first if low_values_first else high_first


def generate_payload(
    request: GenerateRequest, stream: bool = True, priority: int | None = None
) -> dict[str, Any]:
    """The ``/generate`` body: token ids when the engine has them, else the prompt text. ``priority`` is
    SGLang's value (sent only when the server schedules by priority, which otherwise refuses the field)."""
    body: dict[str, Any] = {
        "rid": request.request_id,
        "sampling_params": sampling_params_payload(request.sampling),
        "stream": stream,
    }
    if priority is not None:
        body["priority"] = priority
    if request.prompt_token_ids:
        body["input_ids"] = list(request.prompt_token_ids)
    elif request.prompt_text is not None:
        body["text"] = request.prompt_text
    else:
        raise OminixError(RuntimeErrorKind.INVALID_ARGUMENT, "request has neither prompt token ids nor text")
    if request.sampling.logprobs is not None:
        body["return_logprob"] = True
        body["top_logprobs_num"] = request.sampling.logprobs
        body["logprob_start_len"] = -1  # output tokens only, no prompt logprobs
    return body


def error_message(body: Any) -> str:
    """The human message inside an SGLang error body (``{"error": {...}}``, ``{"message": ...}`` or text)."""
    if isinstance(body, Mapping):
        err = body.get("error", body)
        if isinstance(err, Mapping):
            for key in ("message", "detail", "msg"):
                if err.get(key):
                    return str(err[key])[:MAX_ERROR_BODY_CHARS]
            return json.dumps(err)[:MAX_ERROR_BODY_CHARS]
        if err:
            return str(err)[:MAX_ERROR_BODY_CHARS]
    if isinstance(body, str):
        return body.strip()[:MAX_ERROR_BODY_CHARS] or "(empty body)"
    return repr(body)[:MAX_ERROR_BODY_CHARS]


def error_kind_for_status(status: int) -> RuntimeErrorKind:
    if status in (400, 404, 413, 422):
        return RuntimeErrorKind.INVALID_ARGUMENT
    if status in (502, 503, 504):
        return RuntimeErrorKind.BACKEND_UNAVAILABLE
    return RuntimeErrorKind.INTERNAL


@dataclass(slots=True)
class SGLangStreamMapper:
    """Turns one request's SSE chunks into contract events; emits exactly one terminal event.

    ``output_ids`` may be cumulative (SGLang's default) or incremental (``incremental_streaming_output``,
    older ``stream_output``); ``meta_info.completion_tokens`` tells which when present. ``text`` follows
    the same modes independently (older servers sent incremental ids with cumulative text).
    """

    request_id: str
    ids_mode: StreamMode = "auto"
    text_mode: StreamMode = "auto"
    abort_requested: bool = False
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    started: bool = False
    terminal: bool = False

    def on_chunk(self, chunk: Any) -> list[WorkerEvent]:
        if self.terminal:
            return []
        if not isinstance(chunk, Mapping):
            return self._fail(RuntimeErrorKind.INTERNAL, f"SGLang sent a malformed chunk: {chunk!r:.200}")
        if "error" in chunk:
            return self._fail(self._error_kind(chunk), f"SGLang error: {error_message(chunk)}")
        try:
            return self._map(chunk)
        except (TypeError, ValueError, AttributeError) as exc:
            return self._fail(
                RuntimeErrorKind.INTERNAL, f"SGLang sent a malformed chunk ({exc}): {chunk!r:.200}"
            )

    def _map(self, chunk: Mapping[str, Any]) -> list[WorkerEvent]:
        meta = chunk.get("meta_info") or {}
        if not isinstance(meta, Mapping):
            raise TypeError("meta_info is not an object")
        events: list[WorkerEvent] = []
        self._read_counts(meta)
        if not self.started:
            self.started = True
            events.append(PrefillDone(self.request_id, self.prompt_tokens, self.cached_tokens))
        had = len(self.output_ids)
        finish = meta.get("finish_reason")
        if _finish_type(finish) == "abort":
            # SGLang re-sends the whole output when it aborts a request it had requeued (retracted), even
            # in incremental mode: read such a chunk as cumulative so no text is streamed twice.
            chunk = self._without_resent_output(chunk)
        new_ids = self._new_ids(chunk.get("output_ids"), meta)
        new_text = self._new_text(chunk.get("text"))
        if new_ids or new_text:
            logprobs = _logprobs_of(meta, had, new_ids)
            ended = bool(new_ids) and _stop_token_of(finish) == new_ids[-1]
            events.append(
                Token(self.request_id, new_ids, logprobs=logprobs, text=new_text, ended_by_stop_token=ended)
            )
        if finish is not None:
            events.extend(self._finish(finish))
        return events

    def _without_resent_output(self, chunk: Mapping[str, Any]) -> Mapping[str, Any]:
        out = dict(chunk)
        ids, text = chunk.get("output_ids"), chunk.get("text")
        have = len(self.output_ids)
        if (
            self.ids_mode != "cumulative"
            and have
            and isinstance(ids, list)
            and len(ids) >= have
            and [int(t) for t in ids[:have]] == self.output_ids
        ):
            out["output_ids"] = ids[have:] if self.ids_mode == "incremental" else ids
        if (
            self.text_mode != "cumulative"
            and self.text
            and isinstance(text, str)
            and text.startswith(self.text)
        ):
            out["text"] = text[len(self.text) :] if self.text_mode == "incremental" else text
        return out

    def on_done_marker(self) -> list[WorkerEvent]:
        """``data: [DONE]`` arrived without a finish reason."""
        if self.terminal:
            return []
        if self.abort_requested:
            return self._end(FinishReason.ABORT)
        return self._fail(RuntimeErrorKind.INTERNAL, "SGLang ended the stream without a finish reason")

    def on_eof(self, detail: str = "") -> list[WorkerEvent]:
        """The connection ended (cleanly or not) before a terminal chunk."""
        if self.terminal:
            return []
        if self.abort_requested:
            return self._end(FinishReason.ABORT)
        why = f": {detail}" if detail else ""
        return self._fail(RuntimeErrorKind.BACKEND_UNAVAILABLE, f"SGLang connection closed mid-stream{why}")

    def fail(self, kind: RuntimeErrorKind, message: str) -> list[WorkerEvent]:
        return [] if self.terminal else self._fail(kind, message)

    # -- internals -------------------------------------------------------------------------------------

    def _error_kind(self, chunk: Mapping[str, Any]) -> RuntimeErrorKind:
        """SGLang streams request validation failures (ValueError: prompt too long, bad parameter) as an
        error chunk before any output; those are the caller's fault. A stated HTTP code decides when given."""
        err = chunk.get("error")
        code = err.get("code") if isinstance(err, Mapping) else None
        if isinstance(code, int) and not isinstance(code, bool) and code >= 400:
            return error_kind_for_status(code)
        return RuntimeErrorKind.INVALID_ARGUMENT if not self.started else RuntimeErrorKind.INTERNAL

    def _read_counts(self, meta: Mapping[str, Any]) -> None:
        for name in ("prompt_tokens", "cached_tokens"):
            value = meta.get(name)
            if isinstance(value, int) and value >= 0:
                setattr(self, name, value)

    def _new_ids(self, raw_ids: Any, meta: Mapping[str, Any]) -> list[int]:
        ids = [int(t) for t in raw_ids] if isinstance(raw_ids, list) else []
        have = len(self.output_ids)
        total = meta.get("completion_tokens")
        mode = self.ids_mode
        if mode == "auto":
            mode = _ids_mode_of(ids, self.output_ids, total)
        new = ids[have:] if mode == "cumulative" else ids
        self.output_ids.extend(new)
        self.completion_tokens = max(len(self.output_ids), total if isinstance(total, int) else 0)
        return new

    def _new_text(self, text: Any) -> str:
        if not isinstance(text, str) or not text:
            return ""
        mode = self.text_mode
        if mode == "auto":
            mode = "cumulative" if text.startswith(self.text) else "incremental"
            if mode == "incremental" and self.text.startswith(text):
                # A shorter cumulative text: the server trimmed a matched stop string at the end.
                mode = "cumulative"
        if mode == "cumulative":
            if not text.startswith(self.text):
                # Trimmed (stop string) or rewritten: keep what was already sent, add nothing.
                return ""
            new = text[len(self.text) :]
            self.text = text
            return new
        self.text += text
        return text

    def _finish(self, finish: Any) -> list[WorkerEvent]:
        kind = finish.get("type") if isinstance(finish, Mapping) else str(finish)
        matched = finish.get("matched") if isinstance(finish, Mapping) else None
        if kind == "length":
            return self._end(FinishReason.LENGTH)
        if kind == "abort":
            status = finish.get("status_code") if isinstance(finish, Mapping) else None
            message = finish.get("message") if isinstance(finish, Mapping) else None
            if not self.abort_requested and isinstance(status, int) and status >= 400 and message:
                # The server refused the request (prompt too long, bad parameter...), nobody aborted it.
                return self._fail(error_kind_for_status(status), f"SGLang aborted the request: {message}")
            return self._end(FinishReason.ABORT)
        return self._end(FinishReason.STOP, matched_stop=matched if isinstance(matched, str) else "")

    def _usage(self) -> Usage:
        return Usage(self.request_id, self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def _end(self, reason: FinishReason, matched_stop: str = "") -> list[WorkerEvent]:
        self.terminal = True
        return [self._usage(), Done(self.request_id, reason, text=self.text, matched_stop=matched_stop)]

    def _fail(self, kind: RuntimeErrorKind, message: str) -> list[WorkerEvent]:
        self.terminal = True
        return [Error(self.request_id, kind, message)]


def _finish_type(finish: Any) -> str | None:
    if finish is None:
        return None
    return str(finish.get("type")) if isinstance(finish, Mapping) else str(finish)


def _stop_token_of(finish: Any) -> int | None:
    """The token id a ``stop`` finish matched (SGLang names an id for a stop token or eos, a string for a stop
    string), else None: the engine's detokenizer leaves that token's text out, as SGLang's own text does."""
    if _finish_type(finish) != "stop" or not isinstance(finish, Mapping):
        return None
    matched = finish.get("matched")
    return matched if isinstance(matched, int) and not isinstance(matched, bool) else None


def _ids_mode_of(ids: list[int], seen: list[int], total: Any) -> StreamMode:
    """Cumulative lists hold every token so far, incremental ones only the new ones; on the first chunk
    both readings agree. ``completion_tokens`` decides when present, else the shared prefix does."""
    have = len(seen)
    if isinstance(total, int):
        if len(ids) == total:
            return "cumulative"
        if len(ids) == total - have:
            return "incremental"
    return "cumulative" if len(ids) >= have and ids[:have] == seen else "incremental"


def _logprob_entry(entry: Any) -> TokenLogprob | None:
    """SGLang logprob entries are ``[logprob, token_id, text_or_null]``."""
    if isinstance(entry, (list, tuple)) and len(entry) >= 2 and entry[0] is not None:
        return TokenLogprob(int(entry[1]), float(entry[0]))
    return None


def _logprobs_of(meta: Mapping[str, Any], had: int, new_ids: list[int]) -> list[SampledLogprobs]:
    """Logprobs of ``new_ids`` from ``output_token_logprobs`` / ``output_top_logprobs``, which are cumulative
    or hold only the new tokens like ``output_ids``; empty when absent or misaligned."""
    sampled = meta.get("output_token_logprobs")
    if not new_ids or not isinstance(sampled, list):
        return []
    n = len(new_ids)
    start = had if len(sampled) == had + n else len(sampled) - n
    top = meta.get("output_top_logprobs")
    top = top if isinstance(top, list) and len(top) == len(sampled) else None
    out: list[SampledLogprobs] = []
    for k in range(n):
        i = start + k
        entry = _logprob_entry(sampled[i]) if 0 <= i < len(sampled) else None
        if entry is None or entry.token_id != new_ids[k]:
            return []
        alternatives = top[i] if top is not None and isinstance(top[i], list) else []
        out.append(SampledLogprobs(entry, [t for t in map(_logprob_entry, alternatives) if t is not None]))
    return out


def parse_load(body: Any) -> dict[str, float]:
    """Sum SGLang's load report over its DP ranks.

    Current servers answer ``/v1/loads`` with ``{"loads": [{num_running_reqs, num_waiting_reqs,
    num_used_tokens, max_total_num_tokens, gen_throughput, memory: {kv_cache_gb, token_capacity}}, ...]}``;
    older ones ``/get_load`` with a list (or one dict) of ``{num_reqs, num_waiting_reqs, num_tokens}``
    where ``num_reqs`` counts running and waiting together. KV bytes are reported when the server states
    its KV pool size (``memory.kv_cache_gb``, GiB): used bytes = pool bytes x used tokens / token capacity.
    """
    if isinstance(body, Mapping):
        entries = body.get("loads", [body])
    elif isinstance(body, list):
        entries = body
    else:
        raise OminixError(RuntimeErrorKind.INTERNAL, f"SGLang load report is a {type(body).__name__}")
    running = waiting = used = capacity = throughput = kv_bytes = 0.0
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, Mapping):
            continue
        waiting_here = _number(entry.get("num_waiting_reqs"))
        waiting += waiting_here
        if "num_running_reqs" in entry:
            running += _number(entry.get("num_running_reqs"))
        else:  # /get_load: num_reqs = running + waiting
            running += max(_number(entry.get("num_reqs")) - waiting_here, 0.0)
        used += _number(entry.get("num_used_tokens", entry.get("num_tokens")))
        memory = entry.get("memory")
        capacity_here = _number(entry.get("max_total_num_tokens"))
        if isinstance(memory, Mapping):
            capacity_here = capacity_here or _number(memory.get("token_capacity"))
            kv_bytes += _number(memory.get("kv_cache_gb")) * BYTES_PER_GIB
        capacity += capacity_here
        throughput += _number(entry.get("gen_throughput"))
    out = {"queued_requests": waiting, "running_requests": running, "kv_tokens_used": used}
    if capacity:
        out["kv_tokens_capacity"] = capacity
    if kv_bytes and capacity:
        out["kv_bytes_capacity"] = kv_bytes
        out["kv_bytes_used"] = kv_bytes * min(used, capacity) / capacity
    if throughput:
        out["decode_tokens_per_second"] = throughput
    return out


def _number(value: Any) -> float:
    """A load figure: a finite number >= 0, anything else 0. SGLang derives some figures (used tokens =
    capacity - free - evictable) and they can dip below zero for a moment; the engine's load and GetLoad's
    unsigned fields take counts only."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return 0.0
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        return 0.0
    return number if 0.0 < number < math.inf else 0.0  # NaN fails both comparisons


def _int_or(value: Any, default: int) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else default


def capability_from_info(
    url: str,
    model_info: Mapping[str, Any],
    server_info: Mapping[str, Any],
    *,
    model: str | None = None,
    max_model_len: int | None = None,
    vocab_size: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
    kv_bytes_per_token: int = 0,
) -> BackendCapability:
    """SGLANG_PROFILE filled from ``/model_info`` and ``/server_info`` (or their deprecated names);
    ``kv_bytes_per_token`` from the load report's KV pool size (0: unknown)."""
    internal = server_info.get("internal_states")
    state0: Mapping[str, Any] = internal[0] if isinstance(internal, list) and internal else {}
    page_size = max(_int_or(server_info.get("page_size"), 1), 1)
    max_total_tokens = _int_or(server_info.get("max_total_num_tokens"), 0)
    context_len = _int_or(server_info.get("context_length"), 0) or (max_model_len or 0)
    if not context_len:
        context_len = _int_or(server_info.get("max_req_input_len"), 0)
    chunked_prefill = _int_or(server_info.get("chunked_prefill_size"), 0)
    device = str(server_info.get("device") or "remote")
    tp_size = max(_int_or(server_info.get("tp_size"), 1), 1)
    kv_dtype = str(server_info.get("kv_cache_dtype") or "auto")
    name = model or server_info.get("served_model_name") or model_info.get("model_path") or ""
    eos = tuple(eos_token_ids or model_info.get("eos_token_ids") or server_info.get("eos_token_ids") or ())
    vocab = (
        vocab_size or _int_or(model_info.get("vocab_size"), 0) or _int_or(server_info.get("vocab_size"), 0)
    )
    return replace(
        SGLANG_PROFILE,
        worker_id=f"sglang@{url}",
        device=device,
        dtype=str(server_info.get("dtype") or "auto"),
        model=ModelInfo(
            name=str(name),
            vocab_size=vocab or UNKNOWN_VOCAB_SIZE,
            max_model_len=context_len,
            eos_token_ids=tuple(int(t) for t in eos),
            architecture=_architecture(model_info),
        ),
        kv_block_size=page_size,
        kv_num_blocks=max_total_tokens // page_size,
        kv_bytes_per_block=kv_bytes_per_token * page_size,
        max_batch_tokens=chunked_prefill if chunked_prefill > 0 else 0,
        max_running_requests=_int_or(server_info.get("max_running_requests"), 0)
        or _int_or(state0.get("max_running_requests"), 0)
        or SGLANG_PROFILE.max_running_requests,
        supports_prefix_caching=not bool(server_info.get("disable_radix_cache", False)),
        supports_chunked_prefill=chunked_prefill > 0 or "chunked_prefill_size" not in server_info,
        supports_graph_capture=not bool(server_info.get("disable_cuda_graph", False)),
        supports_fp8_kv=kv_dtype.startswith("fp8"),
        tensor_parallel_size=tp_size,
        collective_backend="hccl" if device.startswith("npu") else SGLANG_PROFILE.collective_backend,
        attention_backend=str(server_info.get("attention_backend") or SGLANG_PROFILE.attention_backend),
        version=str(server_info.get("version") or ""),
    )


def _architecture(model_info: Mapping[str, Any]) -> str:
    """SGLang states ``architectures`` as a list (HF config style); older servers one ``architecture``."""
    names = model_info.get("architectures")
    if isinstance(names, list) and names:
        return ",".join(str(n) for n in names)
    return str(model_info.get("architecture") or "")


def stream_modes_from_server_info(server_info: Mapping[str, Any]) -> tuple[StreamMode, StreamMode]:
    """(ids mode, text mode) a server states: newer ``incremental_streaming_output`` sends both as deltas,
    older ``stream_output`` sent incremental ids with cumulative text."""
    if server_info.get("incremental_streaming_output"):
        return "incremental", "incremental"
    if server_info.get("stream_output"):
        return "incremental", "cumulative"
    if "incremental_streaming_output" in server_info or "stream_output" in server_info:
        return "cumulative", "cumulative"
    return "auto", "auto"


@dataclass(slots=True)
class _LiveRequest:
    mapper: SGLangStreamMapper
    response: aiohttp.ClientResponse | None = None
    abort_timer: asyncio.TimerHandle | None = None


class SGLangBackend:
    """contract.RequestBackend over one SGLang server (``http://host:port``)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        model: str | None = None,
        stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT_S,
        abort_grace: float = DEFAULT_ABORT_GRACE_S,
        stream_mode: StreamMode = "auto",
        max_model_len: int | None = None,
        vocab_size: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        api_key: str | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            url = "http://" + url
        self.url = url.rstrip("/")
        self.model = model
        self.timeout = timeout
        self.stream_idle_timeout = stream_idle_timeout
        self.abort_grace = abort_grace
        self._stream_modes: tuple[StreamMode, StreamMode] = (stream_mode, stream_mode)
        self._max_model_len = max_model_len
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._live: dict[str, _LiveRequest] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._capability: BackendCapability | None = None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._priority_scheduling = False
        self._low_priority_values_first = False

    def __repr__(self) -> str:
        return f"SGLangBackend({self.url!r})"

    # -- RequestBackend --------------------------------------------------------------------------------

    async def describe(self) -> BackendCapability:
        model_info, server_info = await asyncio.gather(
            self._get_json_first(MODEL_INFO_PATHS), self._get_json_first(SERVER_INFO_PATHS)
        )
        if not isinstance(model_info, Mapping) or not isinstance(server_info, Mapping):
            raise OminixError(
                RuntimeErrorKind.INTERNAL, f"SGLang at {self.url} returned malformed server info"
            )
        if model_info.get("is_generation") is False:
            raise OminixError(
                RuntimeErrorKind.CAPABILITY_MISMATCH,
                f"SGLang at {self.url} serves {model_info.get('model_path')!r}, which is not a generation model",
            )
        max_model_len = self._max_model_len
        if max_model_len is None and not _int_or(server_info.get("context_length"), 0):
            max_model_len = await self._models_max_len()
        if self._stream_modes == ("auto", "auto"):
            self._stream_modes = stream_modes_from_server_info(server_info)
        self._priority_scheduling = bool(server_info.get("enable_priority_scheduling", False))
        self._low_priority_values_first = bool(server_info.get("schedule_low_priority_values_first", False))
        bytes_per_token = 0
        with contextlib.suppress(OminixError):
            load = await self.load()
            if load.get("kv_bytes_capacity") and load.get("kv_tokens_capacity"):
                bytes_per_token = int(load["kv_bytes_capacity"] // load["kv_tokens_capacity"])
        self._capability = capability_from_info(
            self.url,
            model_info,
            server_info,
            model=self.model,
            max_model_len=max_model_len,
            vocab_size=self._vocab_size,
            eos_token_ids=self._eos_token_ids,
            kv_bytes_per_token=bytes_per_token,
        )
        return self._capability

    def generate(self, request: GenerateRequest) -> AsyncIterator[WorkerEvent]:
        return self._generate(request)

    async def abort(self, request_id: str) -> None:
        """Ask SGLang to abort; the stream then ends with Done(ABORT). Best effort: a server that ignores
        the abort gets its connection closed after ``abort_grace`` seconds (SGLang aborts on disconnect)."""
        live = self._live.get(request_id)
        if live is None:
            return
        live.mapper.abort_requested = True
        if live.abort_timer is None:
            live.abort_timer = asyncio.get_running_loop().call_later(
                self.abort_grace, self._force_close, request_id
            )
        await self._post_abort(request_id)

    async def load(self) -> dict[str, float]:
        out = parse_load(await self._get_json_first(LOAD_PATHS))
        if self._capability is not None and self._capability.kv_capacity_tokens:
            out.setdefault("kv_tokens_capacity", float(self._capability.kv_capacity_tokens))
        if "kv_bytes_capacity" not in out and self._capability is not None:
            # No pool size in this report (older server): the bytes stated at startup, used in proportion.
            capacity = self._capability.kv_bytes_capacity
            tokens = out.get("kv_tokens_capacity", 0.0)
            if capacity and tokens:
                out["kv_bytes_capacity"] = float(capacity)
                out["kv_bytes_used"] = capacity * min(out["kv_tokens_used"], tokens) / tokens
        return out

    async def health(self) -> bool:
        try:
            session = self._get_session()
            async with session.get(
                self.url + "/health", headers=self._headers, timeout=aiohttp.ClientTimeout(total=self.timeout)
            ) as r:
                await r.read()
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def close(self) -> None:
        for live in list(self._live.values()):
            if live.abort_timer is not None:
                live.abort_timer.cancel()
            if live.response is not None:
                live.response.close()
        if self._background:
            # Let pending abort notices reach the server (each is bounded by the control timeout).
            pending = list(self._background)
            _, late = await asyncio.wait(pending, timeout=self.timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._session is not None:
            if self._session_loop is asyncio.get_running_loop():
                await self._session.close()
            # A session of another (finished) loop cannot be closed from here; dropping it frees it.
            self._session = None
            self._session_loop = None

    async def flush_cache(self) -> bool:
        """Drop SGLang's prefix cache (refused by the server while requests run)."""
        session = self._get_session()
        async with session.post(
            self.url + "/flush_cache",
            headers=self._headers,
            timeout=aiohttp.ClientTimeout(total=self.timeout),
        ) as r:
            await r.read()
            return r.status == 200

    # -- streaming -------------------------------------------------------------------------------------

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[WorkerEvent]:
        rid = request.request_id
        if rid in self._live:
            yield Error(
                rid, RuntimeErrorKind.INVALID_ARGUMENT, f"request {rid} is already running on {self.url}"
            )
            return
        ids_mode, text_mode = self._stream_modes
        mapper = SGLangStreamMapper(rid, ids_mode=ids_mode, text_mode=text_mode)
        live = _LiveRequest(mapper)
        self._live[rid] = live
        priority = (
            sglang_priority(request.priority, self._low_priority_values_first)
            if self._priority_scheduling
            else None
        )
        try:
            payload = generate_payload(request, stream=True, priority=priority)
        except OminixError as exc:
            del self._live[rid]
            yield Error(rid, exc.kind, exc.message)
            return
        try:
            # The engine's trace context, so a traced SGLang server joins the request's trace.
            headers = {"traceparent": request.traceparent} if request.traceparent else None
            async with contextlib.aclosing(self._stream(payload, live, headers)) as events:
                async for event in events:
                    yield event
        finally:
            self._live.pop(rid, None)
            if live.abort_timer is not None:
                live.abort_timer.cancel()
            if not mapper.terminal:
                # The consumer went away mid-stream: tell SGLang so it frees the request's KV at once.
                self._spawn(self._post_abort(rid))

    async def _stream(
        self, payload: dict[str, Any], live: _LiveRequest, headers: dict[str, str] | None = None
    ) -> AsyncGenerator[WorkerEvent, None]:
        mapper = live.mapper
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.timeout, sock_read=self.stream_idle_timeout
        )
        try:
            session = self._get_session()
            async with session.post(
                self.url + "/generate",
                json=payload,
                timeout=timeout,
                headers={**self._headers, **(headers or {})},
            ) as resp:
                live.response = resp
                if resp.status != 200:
                    body = await _read_error_body(resp)
                    for event in mapper.fail(
                        error_kind_for_status(resp.status),
                        f"SGLang /generate HTTP {resp.status}: {error_message(body)}",
                    ):
                        yield event
                    return
                if mapper.abort_requested:
                    # Aborted before SGLang registered the request: disconnecting aborts it there.
                    for event in mapper.on_eof():
                        yield event
                    return
                async for data in _sse_data(resp):
                    if data == "[DONE]":
                        events = mapper.on_done_marker()
                    else:
                        try:
                            chunk = json.loads(data)
                        except ValueError:
                            events = mapper.fail(
                                RuntimeErrorKind.INTERNAL, f"SGLang sent invalid JSON: {data[:200]!r}"
                            )
                        else:
                            events = mapper.on_chunk(chunk)
                    for event in events:
                        yield event
                    if mapper.terminal:
                        return
                for event in mapper.on_eof():
                    yield event
        except asyncio.TimeoutError:
            if mapper.abort_requested:
                events = mapper.on_eof()
            else:
                # A hung request may still hold KV on the server: ask SGLang to drop it.
                self._spawn(self._post_abort(mapper.request_id))
                events = mapper.fail(
                    RuntimeErrorKind.BACKEND_UNAVAILABLE,
                    f"SGLang at {self.url} sent nothing for {self.stream_idle_timeout:g} s",
                )
            for event in events:
                yield event
        except aiohttp.ClientConnectorError as exc:
            for event in mapper.fail(
                RuntimeErrorKind.BACKEND_UNAVAILABLE, f"cannot reach SGLang at {self.url}: {exc}"
            ):
                yield event
        except (aiohttp.ClientError, OSError) as exc:
            # Payload errors, server disconnects, reset connections: the stream broke.
            detail = str(exc) or type(exc).__name__
            if mapper.started or mapper.abort_requested:
                events = mapper.on_eof(detail)
            else:
                events = mapper.fail(
                    RuntimeErrorKind.BACKEND_UNAVAILABLE, f"SGLang at {self.url} failed: {detail}"
                )
            for event in events:
                yield event

    def _force_close(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is not None and live.response is not None and not live.mapper.terminal:
            log.warning("SGLang at %s ignored the abort of %s; closing its stream", self.url, request_id)
            live.response.close()

    # -- plumbing --------------------------------------------------------------------------------------

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            # A session belongs to one event loop; a caller that runs several loops gets one per loop.
            # No connection limit per host: each streaming request holds one connection for its lifetime.
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
            self._session = aiohttp.ClientSession(connector=connector, raise_for_status=False)
            self._session_loop = loop
        return self._session

    async def _get_json_first(self, paths: Sequence[str]) -> Any:
        """The first of ``paths`` (current name, then deprecated ones) the server has."""
        for path in paths[:-1]:
            try:
                return await self._get_json(path)
            except _NoSuchEndpoint:
                log.debug("SGLang at %s has no %s; trying %s", self.url, path, paths[-1])
        return await self._get_json(paths[-1])

    async def _get_json(self, path: str) -> Any:
        try:
            session = self._get_session()
            async with session.get(
                self.url + path, headers=self._headers, timeout=aiohttp.ClientTimeout(total=self.timeout)
            ) as resp:
                if resp.status in (404, 405):
                    await resp.read()
                    raise _NoSuchEndpoint(RuntimeErrorKind.INVALID_ARGUMENT, f"SGLang has no {path}")
                if resp.status != 200:
                    body = await _read_error_body(resp)
                    raise OminixError(
                        error_kind_for_status(resp.status),
                        f"SGLang {path} HTTP {resp.status}: {error_message(body)}",
                    )
                return await resp.json(content_type=None)
        except asyncio.TimeoutError as exc:
            raise OminixError(
                RuntimeErrorKind.BACKEND_UNAVAILABLE,
                f"SGLang at {self.url} did not answer {path} in {self.timeout:g} s",
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise OminixError(
                RuntimeErrorKind.BACKEND_UNAVAILABLE, f"cannot reach SGLang at {self.url} ({path}): {exc}"
            ) from exc
        except ValueError as exc:
            raise OminixError(
                RuntimeErrorKind.INTERNAL, f"SGLang {path} returned invalid JSON: {exc}"
            ) from exc

    async def _models_max_len(self) -> int | None:
        with contextlib.suppress(OminixError):
            body = await self._get_json("/v1/models")
            data = body.get("data") if isinstance(body, Mapping) else None
            if isinstance(data, list) and data and isinstance(data[0], Mapping):
                value = data[0].get("max_model_len")
                return value if isinstance(value, int) else None
        return None

    async def _post_abort(self, request_id: str) -> None:
        try:
            session = self._get_session()
            async with session.post(
                self.url + "/abort_request",
                json={"rid": request_id},
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout),
            ) as resp:
                await resp.read()
                if resp.status != 200:
                    log.warning(
                        "SGLang at %s refused to abort %s: HTTP %d", self.url, request_id, resp.status
                    )
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.warning("cannot abort %s on SGLang at %s: %s", request_id, self.url, exc)

    def _spawn(self, coro: Any) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # no running loop (interpreter shutdown): nothing to tell the server
            coro.close()
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class _NoSuchEndpoint(OminixError):
    """The server answered 404/405: an older or newer release without this endpoint name."""


async def _read_error_body(resp: aiohttp.ClientResponse) -> Any:
    raw = await resp.content.read(64 * 1024)
    text = raw.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


async def _sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent event stream, one per line."""
    buffer = b""
    async for piece in resp.content.iter_any():
        buffer += piece
        while True:
            newline = buffer.find(b"\n")
            if newline < 0:
                break
            line, buffer = buffer[:newline].rstrip(b"\r"), buffer[newline + 1 :]
            if line.startswith(b"data:"):
                yield line[5:].strip().decode("utf-8", errors="replace")
        if len(buffer) > MAX_SSE_LINE_BYTES:
            raise aiohttp.ClientPayloadError(f"SSE line longer than {MAX_SSE_LINE_BYTES} bytes")
    # An unterminated last line is a truncated stream, not an event; the caller sees the end of input.


__all__ = [
    "SGLangBackend",
    "SGLangStreamMapper",
    "capability_from_info",
    "generate_payload",
    "parse_load",
    "sampling_params_payload",
]
