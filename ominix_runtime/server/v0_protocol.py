"""The ``ominix.worker.v0`` wire protocol (OminiX-API's worker protocol): parsing and record shapes.

Pure: no HTTP, no engine. :func:`parse_generate_request` turns a ``POST /generate`` body into a
:class:`V0GenerateRequest` (or raises :class:`V0ProtocolError`, answered with HTTP 400);
:class:`V0EventWriter` builds the WorkerEvent records of one request (``prefill_done``, ``token``,
``usage``, then exactly one ``done`` or ``error``), each with the envelope OminiX-API checks. Field names
and defaults follow OminiX-API's client (``src/engines/sglang.rs``) and the reference worker shim, which
accepts a superset (text and token inputs, ``sampling_params`` alias, more sampling fields). Logprobs follow
the protocol's token event (``logprobs{token_logprob, top_logprobs[{logprob, token_id}]}``, one token per
event, as the reference worker's event adapter writes them); OminiX-API never asks for them and ignores them.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

PROTOCOL_VERSION = "ominix.worker.v0"
GENERATE_MESSAGE = "GenerateRequest"
ABORT_MESSAGE = "AbortRequest"
EVENT_MESSAGE = "WorkerEvent"
DONE_FRAME = b"data: [DONE]\n\n"
# OminiX-API's readiness probe wants the reference shim's identity strings verbatim.
SCHEDULER_BACKEND = "sglang-ominix-v0-http-shim"
SCHEDULER_MODE = "grpc"
ROUTES = {
    "generate": "/generate",
    "health_generate": "/health_generate",
    "server_info": "/server_info",
    "get_model_info": "/get_model_info",
    "get_loads": "/get_loads",
    "abort_request": "/abort_request",
    "flush_cache": "/flush_cache",
}
# Finish reasons OminiX-API knows; "stop", "length" and "content_filter" are success.
FINISH_REASONS = frozenset({"stop", "length", "abort", "error", "content_filter", "tool_calls"})
# The shim's default when no temperature is sent (OminiX-API omits it when its caller did): greedy.
DEFAULT_TEMPERATURE = 0.0
_SAMPLING_NUMBERS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_SAMPLING_INTS = ("top_k", "seed", "min_new_tokens")
_ALIASES = {"min_tokens": "min_new_tokens"}  # vLLM's spelling
# Sampling fields of SGLang's and vLLM's requests that this engine does not implement: several choices a
# request, and constraints on the draw (biases, banned or allowed tokens, grammars, schemas, logit processors).
# Each passes only at its no-op value (absent, null, empty, or 1 choice); any other value is refused rather than
# ignored, since ignoring it would change what the caller gets without saying so.
_UNSUPPORTED_CHOICE_COUNTS = ("n", "best_of")
_UNSUPPORTED_CONSTRAINTS = (
    "logit_bias",
    "bad_words",
    "allowed_token_ids",
    "regex",
    "stop_regex",
    "json_schema",
    "ebnf",
    "structural_tag",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "custom_logit_processor",
    "logits_processors",
)
_PRIORITIES = {"realtime": 1, "interactive": 2, "batch": 3}


class V0ProtocolError(ValueError):
    """A request the protocol refuses (HTTP 400 with ``{"error": {"message": ...}}``)."""


@dataclass(slots=True)
class V0Sampling:
    """Sampling as the protocol states it; unset fields keep the engine's defaults."""

    max_new_tokens: int | None = None
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    min_new_tokens: int | None = None
    logprobs: int | None = None  # the engine's form: None none, 0 the sampled token's, N plus the top N
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # The request's own name of a field it sent by an alias (errors name the field as the caller sent it).
    names: dict[str, str] = field(default_factory=dict)

    def name(self, key: str) -> str:
        return f"sampling.{self.names.get(key, key)}"


@dataclass(slots=True)
class V0GenerateRequest:
    """One ``GenerateRequest``; exactly one of ``messages``, ``text`` or ``tokens`` is set."""

    request_id: str
    model: str
    sampling: V0Sampling
    messages: list[dict[str, str]] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    text: str | None = None
    tokens: list[int] | None = None
    stream: bool = False
    trace_id: str = ""
    priority: int = 0  # 0: the engine's default class
    deadline_ms: int = 0


def new_request_id() -> str:
    return "ominix-" + uuid.uuid4().hex


def parse_json_object(body: bytes, what: str = "request") -> dict[str, Any]:
    """A JSON object of finite numbers and valid Unicode strings. Python's json reads NaN, Infinity, 1e400
    and lone-surrogate escapes (``"\\ud800"``), none of which the records echoed back or the wire types
    can carry."""
    if not body:
        raise V0ProtocolError(f"{what} body is empty")
    try:
        obj = json.loads(body.decode("utf-8"), parse_constant=_non_finite, parse_float=_finite_float)
    except UnicodeDecodeError as exc:
        raise V0ProtocolError(f"{what} body is not UTF-8: {exc}") from exc
    except RecursionError:
        raise V0ProtocolError(f"{what} body is nested too deeply") from None
    except ValueError as exc:
        raise V0ProtocolError(f"{what} body is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise V0ProtocolError(f"{what} body must be a JSON object, got {type(obj).__name__}")
    if _SURROGATE_ESCAPE.search(body) and not _valid_unicode(obj):  # checked only when an escape could be one
        raise V0ProtocolError(f"{what} body has a string with a lone surrogate (not valid Unicode)")
    return obj


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _non_finite(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:32]} is out of range")
    return value


def _valid_unicode(value: object) -> bool:
    """Whether every string in ``value`` encodes as UTF-8: one C-speed pass (a surrogate pair escaped by an
    ASCII-only encoder, an emoji, also brings the check here, and a long token list must not cost a Python
    walk)."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def check_envelope(obj: dict[str, Any], message_type: str) -> None:
    """``protocol_version`` and ``message_type`` are optional; when present they must match."""
    version = obj.get("protocol_version")
    if version is not None and version != PROTOCOL_VERSION:
        raise V0ProtocolError(f"protocol_version must be {PROTOCOL_VERSION!r}, got {version!r}")
    kind = obj.get("message_type")
    if kind is not None and kind != message_type:
        raise V0ProtocolError(f"message_type must be {message_type!r}, got {kind!r}")


def parse_generate_request(body: bytes) -> V0GenerateRequest:
    obj = parse_json_object(body)
    check_envelope(obj, GENERATE_MESSAGE)
    request_id = _optional_str(obj, "request_id") or new_request_id()
    model = _optional_str(obj, "model")
    trace_id = _optional_str(obj, "trace_id")
    stream = obj.get("stream", False)
    if not isinstance(stream, bool):
        raise V0ProtocolError("stream must be a boolean")
    sampling_obj = obj.get("sampling", obj.get("sampling_params"))
    req = V0GenerateRequest(
        request_id=request_id,
        model=model,
        sampling=parse_sampling(sampling_obj if sampling_obj is not None else {}),
        stream=stream,
        trace_id=trace_id,
        priority=_priority(obj.get("priority")),
        deadline_ms=_non_negative_int(obj, "deadline_ms"),
    )
    _parse_input(obj, req)
    return req


def _parse_input(obj: dict[str, Any], req: V0GenerateRequest) -> None:
    """First match wins, as in the reference worker: tokens, then text, then chat."""
    inp = obj.get("input")
    if inp is not None and not isinstance(inp, dict):
        raise V0ProtocolError("input must be an object")
    inp = inp or {}
    kind = inp.get("kind")
    if kind == "tokens" or (kind is None and "input_ids" in obj):
        tokens = inp.get("tokens", obj.get("input_ids"))
        if not isinstance(tokens, list) or not tokens:
            raise V0ProtocolError("input.tokens must be a non-empty array of token ids")
        try:
            req.tokens = _token_ids(tokens)
        except (TypeError, ValueError) as exc:
            raise V0ProtocolError(f"input.tokens: {exc}") from exc
        return
    if kind in ("text", "completion") or (
        kind is None and isinstance(obj.get("prompt", obj.get("text")), str)
    ):
        for source, key in ((inp, "prompt"), (inp, "text"), (obj, "prompt"), (obj, "text")):
            if isinstance(source.get(key), str):
                req.text = source[key]
                return
        raise V0ProtocolError("a text input needs input.prompt or input.text (a string)")
    if kind == "chat":
        req.messages = _messages(inp.get("messages"))
        kwargs = inp.get("chat_template_kwargs", {})
        if not isinstance(kwargs, dict):
            raise V0ProtocolError("input.chat_template_kwargs must be an object")
        req.chat_template_kwargs = kwargs
        return
    raise V0ProtocolError("input.kind must be one of tokens, text, completion, or chat")


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise V0ProtocolError("input.messages must be a non-empty array")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise V0ProtocolError(f"input.messages[{i}] must be an object with a string role")
        content = m.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise V0ProtocolError(f"input.messages[{i}].content must be a string")
        out.append({"role": m["role"], "content": content})
    return out


def parse_sampling(obj: Any) -> V0Sampling:
    if not isinstance(obj, dict):
        raise V0ProtocolError("sampling must be an object")
    for key in _UNSUPPORTED_CHOICE_COUNTS:
        if obj.get(key) is not None and _int(obj[key], f"sampling.{key}") != 1:
            raise V0ProtocolError(f"sampling.{key} is not supported by this worker: one choice a request")
    for key in _UNSUPPORTED_CONSTRAINTS:
        value = obj.get(key)
        if value is not None and value not in ("", [], {}):
            raise V0ProtocolError(f"sampling.{key} is not supported by this worker (leave it out)")
    out = V0Sampling()
    for alias, key in _ALIASES.items():
        if obj.get(alias) is not None:
            value = _int(obj[alias], f"sampling.{alias}")
            if obj.get(key) is not None and _int(obj[key], f"sampling.{key}") != value:
                raise V0ProtocolError(f"sampling.{alias} and sampling.{key} are one field, with two values")
            obj = {**obj, key: value}
            out.names[key] = alias
    for key in ("max_new_tokens", "max_completion_tokens", "max_tokens"):  # the shim's alias order
        if obj.get(key) is not None:
            out.max_new_tokens = _int(obj[key], f"sampling.{key}")
            out.names["max_new_tokens"] = key
            break
    for key in _SAMPLING_NUMBERS:
        if obj.get(key) is not None:
            setattr(out, key, _number(obj[key], f"sampling.{key}"))
    for key in _SAMPLING_INTS:
        if obj.get(key) is not None:
            setattr(out, key, _int(obj[key], f"sampling.{key}"))
    if out.seed == -1:  # vLLM's and SGLang's spelling of "no seed"
        out.seed = None
    out.logprobs = _logprobs(obj)
    stop = obj.get("stop")
    if isinstance(stop, str):
        out.stop = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        out.stop = list(stop)
    elif stop is not None:
        raise V0ProtocolError("sampling.stop must be a string or an array of strings")
    ids = obj.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list):
            raise V0ProtocolError("sampling.stop_token_ids must be an array of token ids")
        plain = set(map(type, ids)) <= {int}  # checked at C speed, as prompt ids are
        out.stop_token_ids = ids if plain else [_int(t, "sampling.stop_token_ids[]") for t in ids]
    ignore_eos = obj.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise V0ProtocolError("sampling.ignore_eos must be a boolean")
    out.ignore_eos = ignore_eos
    return out


def _logprobs(obj: dict[str, Any]) -> int | None:
    """The engine's logprobs count from the protocol's ``sampling.logprobs`` (a boolean) and
    ``sampling.top_logprobs`` (how many alternatives), or from ``sampling.logprobs: N`` alone (this worker's
    own form, N alternatives). Anything contradictory is refused rather than guessed: the engine computes
    logprobs only for requests that will get them."""
    flag = obj.get("logprobs")
    top = obj.get("top_logprobs")
    top_n = None if top is None else _int(top, "sampling.top_logprobs")
    if flag is None or flag is False:
        if top_n is not None:
            raise V0ProtocolError("sampling.top_logprobs needs sampling.logprobs: true")
        return None
    if flag is True:
        return top_n or 0
    if top_n is not None:
        raise V0ProtocolError(
            "sampling.logprobs is a count here, so sampling.top_logprobs must be absent (or logprobs true)"
        )
    return _int(flag, "sampling.logprobs")


def parse_abort_request(body: bytes) -> str:
    """The id of a ``POST /abort_request`` body (``request_id`` or the SGLang-style ``rid``)."""
    obj = parse_json_object(body, "abort")
    check_envelope(obj, ABORT_MESSAGE)
    rid = obj.get("request_id", obj.get("rid"))
    if not isinstance(rid, str) or not rid:
        raise V0ProtocolError("abort_request needs request_id (or rid), a non-empty string")
    return rid


# ---- records --------------------------------------------------------------------------------------------


class V0EventWriter:
    """The WorkerEvent records of one request, in order, with a non-decreasing integer ``created_at_ms``."""

    def __init__(self, request_id: str, trace_id: str = "") -> None:
        self.request_id = request_id
        self.trace_id = trace_id
        self.tokens_sent = 0
        self.terminal_sent = False
        self._last_ms = 0

    def _record(self, kind: str, **fields: Any) -> dict[str, Any]:
        now = max(int(time.time() * 1000), self._last_ms)
        self._last_ms = now
        record: dict[str, Any] = {
            "protocol_version": PROTOCOL_VERSION,
            "message_type": EVENT_MESSAGE,
            "request_id": self.request_id,
            "kind": kind,
            "created_at_ms": now,
            "sequence_index": 0,
        }
        if self.trace_id:
            record["trace_id"] = self.trace_id
        record.update(fields)
        return record

    def prefill_done(self, prompt_tokens: int, cached_tokens: int) -> dict[str, Any]:
        return self._record("prefill_done", usage=_usage(prompt_tokens, 0, cached_tokens))

    def token(
        self, token_ids: list[int], text: str, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """One engine chunk: ``token_id`` (the last id), all ``token_ids``, and ``text_delta`` when the
        chunk released text (held-back text comes with a later token). ``logprobs`` (see
        :func:`token_logprobs`) belong to one token, so a record that carries them has a single id."""
        self.tokens_sent += len(token_ids)
        fields: dict[str, Any] = {"token_ids": list(token_ids)}
        if token_ids:
            fields["token_id"] = token_ids[-1]
        if text:
            fields["text_delta"] = text
        if logprobs is not None:
            if len(token_ids) != 1:
                raise ValueError(f"logprobs belong to one token, got {len(token_ids)} ids")
            fields["logprobs"] = logprobs
        return self._record("token", **fields)

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        return self._record("usage", usage=_usage(prompt_tokens, completion_tokens, cached_tokens))

    def done(self, finish_reason: str, matched_stop: str = "") -> dict[str, Any]:
        if finish_reason not in FINISH_REASONS:
            raise ValueError(f"unknown finish reason {finish_reason!r}")
        self.terminal_sent = True
        fields: dict[str, Any] = {"finish_reason": finish_reason}
        if matched_stop:
            fields["matched_stop"] = matched_stop
        return self._record("done", **fields)

    def error(self, code: str, message: str, retryable: bool) -> dict[str, Any]:
        self.terminal_sent = True
        error = {"code": code, "message": message, "retryable": retryable}
        return self._record("error", finish_reason="error", error=error)


def token_logprobs(logprob: float, top: Iterable[tuple[int, float]] = ()) -> dict[str, Any]:
    """A token record's ``logprobs``: ``token_logprob`` of the sampled token and, when any were asked for,
    ``top_logprobs`` as ``{"logprob", "token_id"}`` entries, best first (the reference worker's shape)."""
    out: dict[str, Any] = {"token_logprob": _json_logprob(logprob)}
    alternatives = [{"logprob": _json_logprob(lp), "token_id": token_id} for token_id, lp in top]
    if alternatives:
        out["top_logprobs"] = alternatives
    return out


def _json_logprob(value: float) -> float | None:
    """JSON has no -Infinity (a token of probability 0): such a logprob is written as null, since a frame
    with ``-Infinity`` in it would not parse at all on the client."""
    return value if math.isfinite(value) else None


def _usage(prompt: int, completion: int, cached: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "cached_tokens": cached,
    }


def sse_frame(record: dict[str, Any]) -> bytes:
    # backslashreplace writes a lone surrogate as its JSON escape: a record that cannot be UTF-8 must not
    # end the stream without its terminal record.
    text = json.dumps(record, separators=(",", ":"), ensure_ascii=False)
    return b"data: " + text.encode("utf-8", "backslashreplace") + b"\n\n"


def error_body(message: str, code: str = "", retryable: bool = False) -> dict[str, Any]:
    """Body of a non-200 answer: ``error.message`` is what OminiX-API reads (and logs)."""
    error: dict[str, Any] = {"message": message}
    if code:
        error["code"] = code
        error["retryable"] = retryable
    return {"error": error}


def server_info(model: str, version: str) -> dict[str, Any]:
    """``GET /server_info``: the reference shim's identity (OminiX-API's readiness probe checks it field by
    field) plus who really answers."""
    return {
        "scheduler_backend": SCHEDULER_BACKEND,
        "mode": SCHEDULER_MODE,
        "protocol_version": PROTOCOL_VERSION,
        "routes": dict(ROUTES),
        "public_openai_api": False,
        "auth_required": True,
        "worker": "ominix-runtime",
        "version": version,
        "model": model,
    }


# ---- helpers --------------------------------------------------------------------------------------------


def _optional_str(obj: dict[str, Any], key: str) -> str:
    value = obj.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise V0ProtocolError(f"{key} must be a string")
    return value


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise V0ProtocolError(f"{what} must be an integer, got {value!r}")
    return int(value)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise V0ProtocolError(f"{what} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # a JSON integer has no size limit
        raise V0ProtocolError(f"{what} is out of range") from None


def _non_negative_int(obj: dict[str, Any], key: str) -> int:
    if obj.get(key) is None:
        return 0
    value = _int(obj[key], key)
    if value < 0:
        raise V0ProtocolError(f"{key} must be >= 0")
    return value


def _token_ids(values: list[Any]) -> list[int]:
    """A list of token ids. Plain integers (the usual list) are checked at C speed: megabytes of ids must not
    cost a Python call each; a list with int-like strings goes id by id."""
    if set(map(type, values)) == {int}:
        if min(values) < 0:
            raise ValueError(f"{min(values)!r} is not a token id")
        return values
    return [_token_id(t) for t in values]


def _token_id(value: Any) -> int:
    """Token ids may be ints or int-like strings (the reference worker accepts both)."""
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is not a token id")
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a token id")
    return value


def _priority(value: Any) -> int:
    """An ominix-runtime extension: "realtime" | "interactive" | "batch" (or 1..3); absent: default."""
    if value is None:
        return 0
    if isinstance(value, str) and value in _PRIORITIES:
        return _PRIORITIES[value]
    if isinstance(value, int) and not isinstance(value, bool) and value in _PRIORITIES.values():
        return value
    raise V0ProtocolError(f"priority must be one of {', '.join(_PRIORITIES)}, got {value!r}")
