"""A protocol-faithful stand-in for an SGLang server (native HTTP API), for tests and demos.

Same endpoints, request fields and response shapes as SGLang's http_server: ``/generate`` (streaming SSE
and plain JSON), ``/abort_request``, ``/model_info``, ``/server_info``, ``/v1/loads`` (and, unless
``legacy_only``, the deprecated ``/get_model_info``, ``/get_server_info``, ``/get_load``; with ``legacy_only``
only those, like an older release), ``/health``, ``/flush_cache``. With ``api_key`` every route but
``/health`` wants ``Authorization: Bearer <key>`` (401 otherwise). The KV pool holds ``max_total_num_tokens``
tokens: a request waits (``num_waiting_reqs``) until its prompt + max_new_tokens fit, and one that can never
fit is aborted with a 400 finish reason, as SGLang does. Tokens are a seeded function of the input ids (same input and seed → same tokens);
text is a fixed id → word map. Fault modes exercise a client's error paths:

- ``normal``: answers like a healthy server;
- ``slow``: waits ``token_delay`` seconds before each token;
- ``failing``: ``/generate`` answers HTTP 500 with an error body and ``/health`` answers 503;
- ``midstream_error``: sends a few tokens, then an ``{"error": ...}`` chunk and ``[DONE]``;
- ``drop``: sends a few tokens, then closes the connection without ending the stream;
- ``flaky``: cycles normal → midstream_error → drop per request.

Run it: ``python -m ominix_runtime.testing.fake_sglang --port 30000 --mode slow``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

MODES = ("normal", "slow", "failing", "midstream_error", "drop", "flaky")
FLAKY_CYCLE = ("normal", "midstream_error", "drop")
DEFAULT_VOCAB_SIZE = 32000
DEFAULT_CONTEXT_LENGTH = 4096
NUM_SPECIAL_TOKENS = 3  # 0 pad, 1 bos, 2 eos; never sampled
EOS_TOKEN_ID = 2
MAX_NEW_TOKENS_CAP = 4096
MAX_REMEMBERED_PROMPTS = 64
FAULT_AFTER_TOKENS = 2
MAX_REQUEST_BYTES = 8 * 1024 * 1024
_MASK64 = (1 << 64) - 1


def token_text(token_id: int) -> str:
    """The fixed id → text map: every token is one space-led word."""
    return f" w{token_id}"


def fake_logprob(token_id: int) -> float:
    """A fixed, plausible log-probability per token id."""
    return -0.01 - (token_id % 97) / 10


def tokenize(text: str, vocab_size: int) -> list[int]:
    """Deterministic word hashing into the non-special part of the vocabulary (``w<id>`` words map back)."""
    ids = []
    span = vocab_size - NUM_SPECIAL_TOKENS
    for word in text.split():
        if word.startswith("w") and word[1:].isdigit() and NUM_SPECIAL_TOKENS <= int(word[1:]) < vocab_size:
            ids.append(int(word[1:]))
            continue
        h = 1469598103934665603
        for byte in word.encode():
            h = ((h ^ byte) * 1099511628211) & _MASK64
        ids.append(NUM_SPECIAL_TOKENS + h % span)
    return ids


def token_stream(input_ids: Sequence[int], seed: int | None, vocab_size: int) -> Iterator[int]:
    """Infinite deterministic token ids from the prompt and seed (a 64-bit LCG, folded prompt)."""
    state = (seed or 0) * 0x9E3779B97F4A7C15 & _MASK64
    for t in input_ids:
        state = (state * 31 + int(t) + 1) & _MASK64
    span = vocab_size - NUM_SPECIAL_TOKENS
    while True:
        state = (state * 6364136223846793005 + 1442695040888963407) & _MASK64
        yield NUM_SPECIAL_TOKENS + (state >> 33) % span


@dataclass(slots=True)
class FakeSGLangState:
    """What the server was asked; tests read it to check what a client sent."""

    mode: str = "normal"
    vocab_size: int = DEFAULT_VOCAB_SIZE
    context_length: int = DEFAULT_CONTEXT_LENGTH
    token_delay: float = 0.05
    model_path: str = "fake/sglang-model"
    incremental_output: bool = False
    page_size: int = 1
    max_total_num_tokens: int = 65536
    max_running_requests: int = 128
    generate_bodies: list[dict[str, Any]] = field(default_factory=list)
    generate_traceparents: list[str] = field(default_factory=list)  # the traceparent header of each call
    aborted_rids: list[str] = field(default_factory=list)
    disconnected_rids: list[str] = field(default_factory=list)
    running: dict[str, asyncio.Event] = field(default_factory=dict)
    running_tokens: dict[str, int] = field(default_factory=dict)
    prompts: OrderedDict[tuple[int, ...], None] = field(default_factory=OrderedDict)
    request_count: int = 0
    flush_count: int = 0
    ignore_aborts: bool = False  # a server that answers /abort_request but keeps generating
    api_key: str | None = None
    legacy_only: bool = False  # only the deprecated control endpoints (an older SGLang)
    # On abort, send the whole output again in the final chunk (SGLang does so for a request it had
    # requeued after a retraction), also in incremental mode.
    resend_output_on_abort: bool = False
    enable_priority_scheduling: bool = False
    kv_bytes_per_token: int = 4096  # stated in /v1/loads as the pool size in GiB
    reserved_tokens: int = 0  # KV tokens held by running requests (prompt + max_new_tokens each)
    waiting: int = 0  # requests waiting for KV
    kv_freed: asyncio.Condition | None = None
    priorities: list[int | None] = field(default_factory=list)

    def mode_for_next_request(self) -> str:
        self.request_count += 1
        if self.mode == "flaky":
            return FLAKY_CYCLE[(self.request_count - 1) % len(FLAKY_CYCLE)]
        return self.mode

    def cached_prefix(self, ids: Sequence[int]) -> int:
        """Longest prefix shared with a remembered prompt (the last prompt token is always recomputed)."""
        best = 0
        for prompt in self.prompts:
            n = 0
            for a, b in zip(prompt, ids, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, max(len(ids) - 1, 0))

    def remember(self, ids: Sequence[int]) -> None:
        key = tuple(ids)
        self.prompts[key] = None
        self.prompts.move_to_end(key)
        while len(self.prompts) > MAX_REMEMBERED_PROMPTS:
            self.prompts.popitem(last=False)


STATE_KEY = web.AppKey("fake_sglang_state", FakeSGLangState)


def _error(status: int, message: str) -> web.Response:
    # SGLang's error body (ORJSONResponse of ErrorResponse).
    return web.json_response(
        {
            "object": "error",
            "message": message,
            "type": "BadRequest" if status < 500 else "InternalServerError",
            "param": None,
            "code": status,
        },
        status=status,
    )


@dataclass(slots=True)
class _Plan:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    min_new_tokens: int
    stop: list[str]
    stop_token_ids: set[int]
    ignore_eos: bool
    seed: int | None
    stream: bool
    return_logprob: bool = False
    top_logprobs_num: int = 0
    priority: int | None = None


class _BadRequest(ValueError):
    pass


def _plan(state: FakeSGLangState, body: Any) -> _Plan:
    if not isinstance(body, dict):
        raise _BadRequest("the request body must be a JSON object")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise _BadRequest("sampling_params must be an object")
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise _BadRequest("input_ids must be one list of integers (batches are not supported here)")
    elif isinstance(body.get("text"), str):
        ids = tokenize(body["text"], state.vocab_size)
    else:
        raise _BadRequest("Either text or input_ids should be provided.")
    if not ids:
        raise _BadRequest("The input is empty.")
    if any(not 0 <= t < state.vocab_size for t in ids):
        raise _BadRequest(f"input_ids contain ids outside the vocabulary [0, {state.vocab_size})")
    if len(ids) >= state.context_length:
        raise _BadRequest(
            f"The input ({len(ids)} tokens) is longer than the model's context length "
            f"({state.context_length} tokens)."
        )
    max_new = params.get("max_new_tokens", 128)
    if not isinstance(max_new, int) or max_new < 0:
        raise _BadRequest(f"max_new_tokens must be a non-negative integer, got {max_new!r}")
    temperature = params.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise _BadRequest(f"temperature must be non-negative, got {temperature!r}.")
    stop = params.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    max_new = min(max_new, state.context_length - len(ids), MAX_NEW_TOKENS_CAP)
    return _Plan(
        rid=str(body.get("rid") or f"fake-{state.request_count}"),
        input_ids=list(ids),
        max_new_tokens=max_new,
        min_new_tokens=int(params.get("min_new_tokens") or 0),
        stop=[str(s) for s in stop][:16],
        stop_token_ids={int(t) for t in params.get("stop_token_ids") or []},
        ignore_eos=bool(params.get("ignore_eos", False)),
        seed=params.get("sampling_seed"),
        stream=bool(body.get("stream", False)),
        return_logprob=bool(body.get("return_logprob", False)),
        top_logprobs_num=max(0, min(int(body.get("top_logprobs_num") or 0), 20)),
        priority=_priority(state, body.get("priority")),
    )


def _priority(state: FakeSGLangState, value: Any) -> int | None:
    if value is None:
        return None
    if not state.enable_priority_scheduling:
        raise _BadRequest(
            "priority is set but priority scheduling is disabled (--enable-priority-scheduling)"
        )
    if not isinstance(value, int) or isinstance(value, bool):
        raise _BadRequest(f"priority must be an integer, got {value!r}")
    return value


class _Generation:
    """One request's decode loop; yields the out dict SGLang would stream after each token."""

    def __init__(self, state: FakeSGLangState, plan: _Plan) -> None:
        self.state = state
        self.plan = plan
        self.output_ids: list[int] = []
        self.text = ""
        self.sent_ids = 0
        self.sent_text = 0
        self.cached = state.cached_prefix(plan.input_ids)
        self.created = time.monotonic()

    def step(self, token: int) -> dict[str, Any] | None:
        """Append one token; return the finish reason dict once the request ends."""
        plan = self.plan
        self.output_ids.append(token)
        self.text += token_text(token)
        n = len(self.output_ids)
        if n >= plan.min_new_tokens:
            if token in plan.stop_token_ids or (token == EOS_TOKEN_ID and not plan.ignore_eos):
                # SGLang decodes the output without the matched stop token: its text is never sent.
                self.text = self.text[: len(self.text) - len(token_text(token))]
                return {"type": "stop", "matched": token}
            for s in plan.stop:
                at = self.text.find(s)
                if at >= 0:
                    self.text = self.text[:at]  # SGLang trims the matched stop string
                    return {"type": "stop", "matched": s}
        if n >= plan.max_new_tokens:
            return {"type": "length", "length": n}
        return None

    def out(self, finish: dict[str, Any] | None, incremental: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {  # JSON, as SGLang's meta_info
            "id": self.plan.rid,
            "finish_reason": finish,
            "prompt_tokens": len(self.plan.input_ids),
            "weight_version": "default",
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached,
        }
        if finish is not None:
            meta["e2e_latency"] = time.monotonic() - self.created
        if incremental:
            ids, text = self.output_ids[self.sent_ids :], self.text[self.sent_text :]
            self.sent_ids, self.sent_text = len(self.output_ids), len(self.text)
        else:
            ids, text = list(self.output_ids), self.text
        if self.plan.return_logprob:
            # SGLang's entries: [logprob, token_id, text or null]; sliced like output_ids.
            meta["output_token_logprobs"] = [[fake_logprob(t), t, None] for t in ids]
            meta["output_top_logprobs"] = [self._top(t) for t in ids]
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def _top(self, token: int) -> list[list[Any]]:
        n = self.plan.top_logprobs_num
        vocab = self.state.vocab_size
        return [[fake_logprob(token) - j, (token + j) % vocab, None] for j in range(n)]


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def handle_generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    mode = state.mode_for_next_request()
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "the request body is not valid JSON")
    state.generate_bodies.append(body if isinstance(body, dict) else {"_invalid": body})
    del state.generate_bodies[:-256]
    state.generate_traceparents.append(request.headers.get("traceparent", ""))
    del state.generate_traceparents[:-256]
    if mode == "failing":
        return web.json_response({"error": {"message": "fake SGLang is failing on purpose"}}, status=500)
    try:
        plan = _plan(state, body)
    except _BadRequest as exc:
        if isinstance(body, dict) and body.get("stream"):
            # SGLang reports request validation errors inside the stream when streaming.
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(_sse({"error": {"message": str(exc)}}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return _error(400, str(exc))
    if plan.rid in state.running:
        return _error(400, f"Duplicate request ID {plan.rid}")
    state.priorities.append(plan.priority)
    del state.priorities[:-256]
    aborted = asyncio.Event()
    state.running[plan.rid] = aborted
    state.running_tokens[plan.rid] = len(plan.input_ids)
    need = len(plan.input_ids) + plan.max_new_tokens
    reserved = 0
    try:
        if need <= state.max_total_num_tokens:
            await _wait_for_kv(state, need, aborted)
            reserved = need
        if plan.stream:
            return await _stream(request, state, plan, mode, aborted, fits=reserved > 0)
        return await _whole(state, plan, mode, aborted, fits=reserved > 0)
    finally:
        state.running.pop(plan.rid, None)
        state.running_tokens.pop(plan.rid, None)
        state.remember(plan.input_ids)
        if reserved:
            await _release_kv(state, reserved)


def _kv_condition(state: FakeSGLangState) -> asyncio.Condition:
    if state.kv_freed is None:
        state.kv_freed = asyncio.Condition()
    return state.kv_freed


async def _wait_for_kv(state: FakeSGLangState, need: int, aborted: asyncio.Event) -> None:
    """Queue until the pool has ``need`` tokens free (or the request is aborted while waiting)."""
    cond = _kv_condition(state)
    async with cond:
        state.waiting += 1
        try:
            while state.reserved_tokens + need > state.max_total_num_tokens and not aborted.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(cond.wait(), timeout=0.05)
        finally:
            state.waiting -= 1
        state.reserved_tokens += need


async def _release_kv(state: FakeSGLangState, tokens: int) -> None:
    cond = _kv_condition(state)
    async with cond:
        state.reserved_tokens -= tokens
        cond.notify_all()


async def _decode(
    state: FakeSGLangState,
    plan: _Plan,
    mode: str,
    aborted: asyncio.Event,
    gen: _Generation,
    fits: bool = True,
) -> AsyncIterator[tuple[dict[str, Any] | None, str]]:
    """Yield (finish, fault) after each token; fault is "" or the fault mode that fires now."""
    if not fits:
        need = len(plan.input_ids) + plan.max_new_tokens
        message = f"Input needs {need} KV tokens, more than the pool's {state.max_total_num_tokens}."
        yield {"type": "abort", "message": message, "status_code": 400}, ""
        return
    tokens = token_stream(plan.input_ids, plan.seed, state.vocab_size)
    if plan.max_new_tokens == 0:
        yield {"type": "length", "length": 0}, ""
        return
    for _ in range(plan.max_new_tokens):
        if mode == "slow":
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(aborted.wait(), timeout=state.token_delay)
        else:
            await asyncio.sleep(0)
        if aborted.is_set():
            yield {"type": "abort", "message": "Abort before prefill" if not gen.output_ids else "Abort"}, ""
            return
        finish = gen.step(next(tokens))
        state.running_tokens[plan.rid] = len(plan.input_ids) + len(gen.output_ids)
        fault = (
            mode if mode in ("midstream_error", "drop") and len(gen.output_ids) > FAULT_AFTER_TOKENS else ""
        )
        yield finish, fault
        if finish is not None or fault:
            return


async def _stream(
    request: web.Request,
    state: FakeSGLangState,
    plan: _Plan,
    mode: str,
    aborted: asyncio.Event,
    fits: bool = True,
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    gen = _Generation(state, plan)
    try:
        await _write_stream(request, resp, state, plan, mode, aborted, gen, fits)
    except ConnectionError:
        # The client went away: SGLang aborts such a request; so does the fake.
        state.disconnected_rids.append(plan.rid)
        del state.disconnected_rids[:-256]
    return resp


async def _write_stream(
    request: web.Request,
    resp: web.StreamResponse,
    state: FakeSGLangState,
    plan: _Plan,
    mode: str,
    aborted: asyncio.Event,
    gen: _Generation,
    fits: bool = True,
) -> None:
    async for finish, fault in _decode(state, plan, mode, aborted, gen, fits):
        if fault == "drop":
            # Close the socket mid-stream: no terminating chunk, no [DONE].
            transport = request.transport
            if transport is not None:
                transport.abort()
            return
        if fault == "midstream_error":
            await resp.write(_sse({"error": {"message": "fake SGLang failed in the middle of the stream"}}))
            break
        resend = state.resend_output_on_abort and (finish or {}).get("type") == "abort"
        await resp.write(_sse(gen.out(finish, state.incremental_output and not resend)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


async def _whole(
    state: FakeSGLangState, plan: _Plan, mode: str, aborted: asyncio.Event, fits: bool = True
) -> web.Response:
    gen = _Generation(state, plan)
    last_finish: dict[str, Any] | None = None
    async for finish, fault in _decode(state, plan, mode, aborted, gen, fits):
        if fault:
            return web.json_response({"error": {"message": f"fake SGLang fault: {fault}"}}, status=500)
        last_finish = finish
    return web.json_response(gen.out(last_finish, incremental=False))


async def handle_abort(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "the request body is not valid JSON")
    rid = body.get("rid") if isinstance(body, dict) else None
    if isinstance(body, dict) and body.get("abort_all"):
        targets = list(state.running)
    else:
        targets = [rid] if isinstance(rid, str) else []
    state.aborted_rids.append(str(rid) if rid is not None else "*")
    del state.aborted_rids[:-256]
    for target in targets if not state.ignore_aborts else []:
        event = state.running.get(target)
        if event is not None:
            event.set()
    return web.Response(status=200)


async def handle_model_info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return web.json_response(
        {
            "model_path": state.model_path,
            "tokenizer_path": state.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
        }
    )


async def handle_server_info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return web.json_response(
        {
            # server args (a subset of SGLang's ServerArgs, same names)
            "model_path": state.model_path,
            "served_model_name": state.model_path,
            "dtype": "bfloat16",
            "kv_cache_dtype": "auto",
            "device": "cuda",
            "tp_size": 1,
            "dp_size": 1,
            "page_size": state.page_size,
            "context_length": state.context_length,
            "max_running_requests": state.max_running_requests,
            "chunked_prefill_size": 8192,
            "disable_radix_cache": False,
            "disable_cuda_graph": False,
            "attention_backend": "fake",
            "stream_interval": 1,
            "incremental_streaming_output": state.incremental_output,
            "enable_priority_scheduling": state.enable_priority_scheduling,
            "schedule_low_priority_values_first": False,
            # scheduler info
            "max_total_num_tokens": state.max_total_num_tokens,
            "max_req_input_len": state.context_length - 1,
            "internal_states": [
                {"last_gen_throughput": 0.0, "max_running_requests": state.max_running_requests}
            ],
            "version": "0.0.0-fake",
        }
    )


async def handle_load(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return web.json_response(
        [
            {
                "rid": None,
                "http_worker_ipc": None,
                "dp_rank": None,
                "num_reqs": len(state.running),
                "num_waiting_reqs": 0,
                "num_tokens": sum(state.running_tokens.values()),
            }
        ]
    )


async def handle_loads(request: web.Request) -> web.Response:
    """``/v1/loads``: one DP rank; ``include=memory`` (or all) adds the KV pool size."""
    state = request.app[STATE_KEY]
    include = set((request.query.get("include") or "all").split(","))
    used = sum(state.running_tokens.values())
    running = len(state.running) - state.waiting
    load: dict[str, Any] = {
        "dp_rank": 0,
        "timestamp": time.time(),
        "num_running_reqs": running,
        "num_waiting_reqs": state.waiting,
        "num_total_reqs": len(state.running),
        "num_used_tokens": used,
        "max_total_num_tokens": state.max_total_num_tokens,
        "token_usage": used / state.max_total_num_tokens,
        "gen_throughput": 0.0,
        "cache_hit_rate": 0.0,
        "utilization": used / state.max_total_num_tokens,
        "max_running_requests": state.max_running_requests,
    }
    if include & {"memory", "all"}:
        pool_gib = state.max_total_num_tokens * state.kv_bytes_per_token / (1 << 30)
        load["memory"] = {
            "weight_gb": 0.25,
            "kv_cache_gb": pool_gib,
            "graph_gb": 0.0,
            "token_capacity": state.max_total_num_tokens,
        }
    return web.json_response({"timestamp": "", "version": "0.0.0-fake", "dp_rank_count": 1, "loads": [load]})


async def handle_health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return web.Response(status=503 if state.mode == "failing" else 200)


async def handle_flush_cache(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.running:
        return web.Response(status=400, text="Cache not flushed: requests are running.\n")
    state.prompts.clear()
    state.flush_count += 1
    return web.Response(status=200, text="Cache flushed.\n")


async def handle_fake_stats(request: web.Request) -> web.Response:
    """Not SGLang: what this fake saw, for tests that run it as a separate process."""
    state = request.app[STATE_KEY]
    return web.json_response(
        {
            "requests": state.request_count,
            "aborted_rids": state.aborted_rids,
            "disconnected_rids": state.disconnected_rids,
            "running": sorted(state.running),
            "flushes": state.flush_count,
        }
    )


@web.middleware
async def _api_key(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    key = request.app[STATE_KEY].api_key
    if key and request.path != "/health" and request.headers.get("Authorization") != f"Bearer {key}":
        return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)


def make_app(state: FakeSGLangState | None = None) -> web.Application:
    app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[_api_key])
    app[STATE_KEY] = state = state or FakeSGLangState()
    app.router.add_route("POST", "/generate", handle_generate)
    app.router.add_route("PUT", "/generate", handle_generate)
    app.router.add_post("/abort_request", handle_abort)
    app.router.add_get("/get_model_info", handle_model_info)
    app.router.add_get("/get_server_info", handle_server_info)
    app.router.add_get("/get_load", handle_load)
    if not state.legacy_only:
        app.router.add_get("/model_info", handle_model_info)
        app.router.add_get("/server_info", handle_server_info)
        app.router.add_get("/v1/loads", handle_loads)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/health_generate", handle_health)
    app.router.add_route("*", "/flush_cache", handle_flush_cache)
    app.router.add_get("/_fake/stats", handle_fake_stats)
    return app


class FakeSGLangServer:
    """The fake in this process, on a loopback port: ``async with FakeSGLangServer() as server: server.url``."""

    def __init__(self, state: FakeSGLangState | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.state = state or FakeSGLangState()
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> FakeSGLangServer:
        self._runner = web.AppRunner(make_app(self.state), handle_signals=False, access_log=None)
        await self._runner.setup()
        # Bind the socket here so port 0 yields a known free port.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()
        return self

    async def stop(self) -> None:
        for event in self.state.running.values():
            event.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeSGLangServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A fake SGLang server (native API) for tests and demos.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--mode", choices=MODES, default="normal")
    parser.add_argument("--vocab", type=int, default=DEFAULT_VOCAB_SIZE, help="vocabulary size")
    parser.add_argument("--context-length", type=int, default=DEFAULT_CONTEXT_LENGTH)
    parser.add_argument("--token-delay", type=float, default=0.05, help="seconds per token in slow mode")
    parser.add_argument("--model-path", default="fake/sglang-model")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--max-total-num-tokens", type=int, default=65536, help="KV pool size in tokens")
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    parser.add_argument("--legacy-only", action="store_true", help="only the deprecated control endpoints")
    parser.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="stream deltas instead of cumulative output",
    )
    args = parser.parse_args(argv)
    if args.vocab <= NUM_SPECIAL_TOKENS:
        parser.error(f"--vocab must be > {NUM_SPECIAL_TOKENS}")
    state = FakeSGLangState(
        mode=args.mode,
        vocab_size=args.vocab,
        context_length=args.context_length,
        token_delay=args.token_delay,
        model_path=args.model_path,
        incremental_output=args.incremental_streaming_output,
        page_size=args.page_size,
        max_total_num_tokens=args.max_total_num_tokens,
        api_key=args.api_key,
        legacy_only=args.legacy_only,
    )
    print(f"fake SGLang ({args.mode}) starting on http://{args.host}:{args.port}", flush=True)

    def announce(_message: str) -> None:
        # run_app calls this once the socket listens: scripts and tests wait for this line.
        print(f"fake SGLang ready on http://{args.host}:{args.port}", flush=True)

    web.run_app(make_app(state), host=args.host, port=args.port, print=announce, access_log=None)


if __name__ == "__main__":
    main()
