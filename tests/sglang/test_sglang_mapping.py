"""SGLang chunk → contract event mapping, load and capability parsing, without a server.

Chunks are shaped like SGLang's tokenizer manager output in its three streaming modes: cumulative
(default), incremental ids with cumulative text (older ``stream_output``) and incremental both
(``incremental_streaming_output``).
"""

from __future__ import annotations

from typing import Any

import pytest

from ominix_runtime.backends.sglang import (
    UNKNOWN_VOCAB_SIZE,
    SGLangStreamMapper,
    capability_from_info,
    error_message,
    parse_load,
    stream_modes_from_server_info,
)
from ominix_runtime.contract import (
    BackendKind,
    Done,
    Error,
    FinishReason,
    Granularity,
    PrefillDone,
    RuntimeErrorKind,
    Token,
    Usage,
    WorkerEvent,
)


def chunk(
    ids: list[int], text: str | None, completion: int, finish: Any = None, cached: int = 0
) -> dict[str, Any]:
    meta = {"id": "r", "finish_reason": finish, "prompt_tokens": 5, "completion_tokens": completion}
    meta["cached_tokens"] = cached
    out: dict[str, Any] = {"output_ids": ids, "meta_info": meta}
    if text is not None:
        out["text"] = text
    return out


def feed(mapper: SGLangStreamMapper, chunks: list[dict[str, Any]]) -> list[WorkerEvent]:
    events: list[WorkerEvent] = []
    for c in chunks:
        events.extend(mapper.on_chunk(c))
    return events


def tokens(events: list[WorkerEvent]) -> tuple[list[int], str]:
    toks = [e for e in events if isinstance(e, Token)]
    return [i for t in toks for i in t.token_ids], "".join(t.text for t in toks)


CUMULATIVE = [
    chunk([7], " a", 1, cached=3),
    chunk([7, 8], " a b", 2, cached=3),
    chunk([7, 8, 9], " a b c", 3, {"type": "length", "length": 3}, cached=3),
]
OLD_STREAM_OUTPUT = [
    chunk([7], " a", 1),
    chunk([8], " a b", 2),
    chunk([9], " a b c", 3, {"type": "length", "length": 3}),
]
INCREMENTAL = [
    chunk([7], " a", 1),
    chunk([8], " b", 2),
    chunk([9], " c", 3, {"type": "length", "length": 3}),
]


@pytest.mark.parametrize("chunks", [CUMULATIVE, OLD_STREAM_OUTPUT, INCREMENTAL], ids=["cum", "old", "inc"])
def test_every_streaming_mode_gives_the_same_events(chunks: list[dict[str, Any]]) -> None:
    events = feed(SGLangStreamMapper("r"), chunks)
    assert isinstance(events[0], PrefillDone) and events[0].prompt_tokens == 5
    assert tokens(events) == ([7, 8, 9], " a b c")
    assert isinstance(events[-2], Usage) and events[-2].completion_tokens == 3
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason == FinishReason.LENGTH and done.text == " a b c"


def test_stated_modes_override_guessing() -> None:
    # An incremental chunk that repeats the earlier text would fool a guess; the stated mode does not.
    mapper = SGLangStreamMapper("r", ids_mode="incremental", text_mode="incremental")
    events = feed(mapper, [chunk([7], "ab", 1), chunk([8], "ab", 2)])
    assert tokens(events) == ([7, 8], "abab")
    assert stream_modes_from_server_info({"incremental_streaming_output": True}) == (
        "incremental",
        "incremental",
    )
    assert stream_modes_from_server_info({"stream_output": True}) == ("incremental", "cumulative")
    assert stream_modes_from_server_info({"incremental_streaming_output": False}) == (
        "cumulative",
        "cumulative",
    )
    assert stream_modes_from_server_info({}) == ("auto", "auto")


def test_text_absent_or_trimmed_at_the_end() -> None:
    mapper = SGLangStreamMapper("r")
    events = feed(
        mapper,
        [
            chunk([7], None, 1),  # token-only server (skip_tokenizer_init): no text
            chunk([7, 8], " a STO", 2),
            chunk([7, 8, 9], " a ", 3, {"type": "stop", "matched": "STOP"}),  # stop string trimmed
        ],
    )
    assert tokens(events) == ([7, 8, 9], " a STO")
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason == FinishReason.STOP and done.matched_stop == "STOP"


def test_stop_on_token_id_has_no_matched_string() -> None:
    events = feed(SGLangStreamMapper("r"), [chunk([2], "</s>", 1, {"type": "stop", "matched": 2})])
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason == FinishReason.STOP and done.matched_stop == ""


def test_the_token_a_stop_matched_is_marked_for_the_detokenizer() -> None:
    """The engine decodes the ids of its own model's SGLang requests: the chunk that ends on the stop token
    SGLang matched says so, so that token's text stays out (as SGLang's own text leaves it out). A stop string
    or a length end marks nothing."""
    by_token = feed(
        SGLangStreamMapper("r"), [chunk([7], " a", 1), chunk([8, 9], " b", 3, {"type": "stop", "matched": 9})]
    )
    by_string = feed(SGLangStreamMapper("r"), [chunk([7, 8], " a", 2, {"type": "stop", "matched": "STOP"})])
    by_length = feed(SGLangStreamMapper("r"), [chunk([7, 9], " a", 2, {"type": "length"})])
    assert [e.ended_by_stop_token for e in by_token if isinstance(e, Token)] == [False, True]
    assert [e.ended_by_stop_token for e in by_string + by_length if isinstance(e, Token)] == [False, False]


def test_error_chunk_and_chunks_after_the_end() -> None:
    mapper = SGLangStreamMapper("r")
    events = feed(
        mapper, [chunk([7], "a", 1), {"error": {"message": "CUDA out of memory"}}, chunk([7, 8], "ab", 2)]
    )
    assert isinstance(events[-1], Error) and events[-1].kind == RuntimeErrorKind.INTERNAL
    assert "CUDA out of memory" in events[-1].message
    assert mapper.on_done_marker() == [] and mapper.on_eof() == []


def test_abort_finish() -> None:
    requested = SGLangStreamMapper("r", abort_requested=True)
    events = feed(requested, [chunk([7], "a", 1, {"type": "abort", "message": "Abort"})])
    assert isinstance(events[-1], Done) and events[-1].finish_reason == FinishReason.ABORT
    # Not requested by us, with a client-error status: the server refused the request.
    refused = SGLangStreamMapper("r")
    finish = {"type": "abort", "message": "Input too long", "status_code": 400}
    events = feed(refused, [chunk([], "", 0, finish)])
    assert isinstance(events[-1], Error) and events[-1].kind == RuntimeErrorKind.INVALID_ARGUMENT
    assert "Input too long" in events[-1].message
    # Aborted by an operator on the server side, no status: still an abort.
    events = feed(SGLangStreamMapper("r"), [chunk([7], "a", 1, {"type": "abort"})])
    assert isinstance(events[-1], Done) and events[-1].finish_reason == FinishReason.ABORT


def test_stream_ends_without_finish() -> None:
    mapper = SGLangStreamMapper("r")
    feed(mapper, [chunk([7], "a", 1)])
    events = mapper.on_done_marker()
    assert (
        len(events) == 1 and isinstance(events[0], Error) and "without a finish reason" in events[0].message
    )
    mapper = SGLangStreamMapper("r")
    events = mapper.on_eof("reset by peer")
    assert isinstance(events[0], Error) and events[0].kind == RuntimeErrorKind.BACKEND_UNAVAILABLE
    assert "reset by peer" in events[0].message
    mapper = SGLangStreamMapper("r", abort_requested=True)
    events = mapper.on_eof()
    assert isinstance(events[-1], Done) and events[-1].finish_reason == FinishReason.ABORT


def test_malformed_chunk() -> None:
    events = SGLangStreamMapper("r").on_chunk(["not", "a", "dict"])
    assert len(events) == 1 and isinstance(events[0], Error)


def test_error_message_shapes() -> None:
    assert error_message({"error": {"message": "bad"}}) == "bad"
    assert error_message({"object": "error", "message": "too long", "code": 400}) == "too long"
    assert error_message({"detail": "Not Found"}) == "Not Found"
    assert error_message("Internal Server Error\n") == "Internal Server Error"


def test_parse_load_shapes() -> None:
    per_rank = [
        {"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 100},
        {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 50},
    ]
    want = {"queued_requests": 2.0, "running_requests": 4.0, "kv_tokens_used": 150.0}
    assert parse_load(per_rank) == want
    assert parse_load({"version": "x", "loads": per_rank}) == want
    assert parse_load({"num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 9}) == {
        "queued_requests": 1.0,
        "running_requests": 2.0,
        "kv_tokens_used": 9.0,
    }
    assert parse_load([{"num_reqs": "?"}, "junk"]) == {
        "queued_requests": 0.0,
        "running_requests": 0.0,
        "kv_tokens_used": 0.0,
    }


def test_capability_from_a_real_server_info_shape() -> None:
    model_info = {"model_path": "Qwen/Qwen2.5-7B-Instruct", "is_generation": True, "tokenizer_path": "x"}
    server_info = {
        "model_path": "Qwen/Qwen2.5-7B-Instruct",
        "served_model_name": "qwen2.5-7b",
        "dtype": "auto",
        "kv_cache_dtype": "fp8_e5m2",
        "device": "npu",
        "tp_size": 2,
        "page_size": 128,
        "context_length": None,
        "chunked_prefill_size": -1,
        "disable_radix_cache": True,
        "max_running_requests": None,
        "max_total_num_tokens": 131072,
        "max_req_input_len": 32767,
        "internal_states": [{"max_running_requests": 48}],
        "version": "0.5.4",
    }
    cap = capability_from_info("http://h:30000", model_info, server_info, max_model_len=32768)
    assert cap.kind == BackendKind.SGLANG and cap.granularity == Granularity.REQUEST
    assert cap.worker_id == "sglang@http://h:30000" and cap.model.name == "qwen2.5-7b"
    assert cap.model.max_model_len == 32768 and cap.model.vocab_size == UNKNOWN_VOCAB_SIZE
    assert cap.kv_block_size == 128 and cap.kv_num_blocks == 1024
    assert cap.max_running_requests == 48 and cap.max_batch_tokens == 0
    assert not cap.supports_prefix_caching and not cap.supports_chunked_prefill and cap.supports_fp8_kv
    assert cap.tensor_parallel_size == 2 and cap.collective_backend == "hccl" and cap.version == "0.5.4"
    named = capability_from_info(
        "http://h:30000", model_info, server_info, model="served-as", vocab_size=152064
    )
    assert named.model.name == "served-as" and named.model.vocab_size == 152064
    assert named.model.max_model_len == 32767  # falls back to max_req_input_len


def test_sglang_backend_is_a_request_backend() -> None:
    from ominix_runtime.backends.sglang import SGLangBackend
    from ominix_runtime.contract import RequestBackend, StepBackend

    backend = SGLangBackend("127.0.0.1:30000", model="m")
    assert isinstance(backend, RequestBackend) and not isinstance(backend, StepBackend)
    assert backend.url == "http://127.0.0.1:30000"


def test_chunk_with_wrong_types_is_one_error() -> None:
    mapper = SGLangStreamMapper("r")
    events = mapper.on_chunk({"output_ids": ["x"], "meta_info": {}})
    assert len(events) == 1 and isinstance(events[0], Error) and "malformed" in events[0].message
    assert mapper.terminal and mapper.on_eof() == []
    events = SGLangStreamMapper("r").on_chunk({"output_ids": [1], "meta_info": "oops"})
    assert len(events) == 1 and isinstance(events[0], Error)
