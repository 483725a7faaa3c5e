"""The v0 wire protocol module alone: the inputs the reference worker accepts beyond OminiX-API's chat, the
refusals, and the records' envelope."""

from __future__ import annotations

import json

import pytest

from ominix_runtime.server.v0_protocol import (
    PROTOCOL_VERSION,
    V0EventWriter,
    V0ProtocolError,
    parse_abort_request,
    parse_generate_request,
    server_info,
    sse_frame,
)


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_token_text_and_chat_inputs() -> None:
    tokens = parse_generate_request(body(input={"kind": "tokens", "tokens": [5, "6", 7]}))
    assert tokens.tokens == [5, 6, 7] and tokens.request_id.startswith("ominix-")
    legacy = parse_generate_request(body(input_ids=[1, 2]))
    assert legacy.tokens == [1, 2]
    text = parse_generate_request(body(input={"kind": "completion", "text": "hello"}))
    assert text.text == "hello"
    top = parse_generate_request(body(prompt="hi there", request_id="r-1"))
    assert top.text == "hi there" and top.request_id == "r-1"
    chat = parse_generate_request(
        body(input={"kind": "chat", "messages": [{"role": "user"}], "chat_template_kwargs": {"x": 1}})
    )
    assert chat.messages == [{"role": "user", "content": ""}] and chat.chat_template_kwargs == {"x": 1}


def test_sampling_aliases_and_defaults() -> None:
    req = parse_generate_request(
        body(prompt="a", sampling_params={"max_tokens": 7, "stop": "x", "top_k": -1})
    )
    s = req.sampling
    assert s.max_new_tokens == 7 and s.stop == ["x"] and s.top_k == -1 and s.temperature == 0.0
    first = parse_generate_request(body(prompt="a", sampling={"max_new_tokens": 3, "max_tokens": 9}))
    assert first.sampling.max_new_tokens == 3  # max_new_tokens wins, as in the shim


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"", "empty"),
        (b"\xff\xfe", "UTF-8"),
        (b"[]", "JSON object"),
        (body(protocol_version="v9", prompt="a"), "protocol_version"),
        (body(message_type="AbortRequest", prompt="a"), "message_type"),
        (body(input={"kind": "tokens", "tokens": [-1]}), "input.tokens"),
        (body(input={"kind": "tokens", "tokens": []}), "non-empty"),
        (body(input={"kind": "chat", "messages": []}), "non-empty"),
        (
            body(input={"kind": "chat", "messages": [{"role": "user", "content": [{"type": "text"}]}]}),
            "string",
        ),
        (body(input={"kind": "audio"}), "input.kind"),
        (body(prompt="a", sampling={"temperature": "hot"}), "temperature"),
        (body(prompt="a", sampling={"max_new_tokens": 1.5}), "integer"),
        (body(prompt="a", stream="yes"), "stream"),
        (body(prompt="a", priority="urgent"), "priority"),
        # Python's json reads these; neither the echoed records nor the wire types can carry them.
        (b'{"prompt": "a", "sampling": {"max_new_tokens": NaN}}', "NaN is not a JSON number"),
        (b'{"prompt": "a", "deadline_ms": Infinity}', "Infinity is not a JSON number"),
        (b'{"prompt": "a", "sampling": {"temperature": 1e400}}', "out of range"),
        (body(prompt="a", sampling={"temperature": 10**400}), "temperature is out of range"),
        (b'{"prompt": "a", "trace_id": "\\ud800"}', "lone surrogate"),
        (
            b'{"input": {"kind": "chat", "messages": [{"role": "user", "content": "x\\udfff"}]}}',
            "lone surrogate",
        ),
    ],
)
def test_refusals_name_the_field(raw: bytes, needle: str) -> None:
    with pytest.raises(V0ProtocolError, match=needle):
        parse_generate_request(raw)


@pytest.mark.parametrize(
    "sampling",
    [
        {"n": 2},
        {"n": 3.0},
        {"best_of": 3},
        {"logit_bias": {"42": 5.0}},
        {"bad_words": ["no"]},
        {"allowed_token_ids": [1, 2]},
        {"regex": "[a-z]+"},
        {"json_schema": "{}"},
        {"guided_choice": ["yes", "no"]},
        {"structured_outputs": {"json": {}}},
        {"stop_regex": ["a+"]},
        {"custom_logit_processor": "serialized"},
    ],
)
def test_a_sampling_field_this_worker_does_not_implement_is_refused_not_ignored(sampling: dict) -> None:
    (key,) = sampling
    with pytest.raises(V0ProtocolError, match=rf"sampling\.{key} is not supported"):
        parse_generate_request(body(prompt="a", sampling=sampling))


def test_unimplemented_fields_at_their_no_op_values_pass() -> None:
    no_ops = {"n": 1.0, "best_of": None, "logit_bias": {}, "bad_words": [], "regex": "", "stop_regex": []}
    assert parse_generate_request(body(prompt="a", sampling=no_ops)).sampling.max_new_tokens is None


def test_min_tokens_is_min_new_tokens_spelled_as_vllm_does() -> None:
    assert parse_generate_request(body(prompt="a", sampling={"min_tokens": 4})).sampling.min_new_tokens == 4
    both = body(prompt="a", sampling={"min_tokens": 4, "min_new_tokens": 4.0})
    assert parse_generate_request(both).sampling.min_new_tokens == 4
    with pytest.raises(V0ProtocolError, match="one field, with two values"):
        parse_generate_request(body(prompt="a", sampling={"min_tokens": 4, "min_new_tokens": 2}))
    # Errors name the field as the request spelled it.
    with pytest.raises(V0ProtocolError, match=r"^sampling\.min_tokens must be an integer"):
        parse_generate_request(body(prompt="a", sampling={"min_tokens": "x"}))


def test_surrogate_pairs_and_finite_numbers_pass() -> None:
    """Only a lone surrogate is refused: an escaped pair is one valid character."""
    req = parse_generate_request(b'{"prompt": "\\ud83d\\ude00", "sampling": {"temperature": 0.5e1}}')
    assert req.text == "\U0001f600" and req.sampling.temperature == 5.0


def test_a_record_that_is_not_valid_unicode_still_frames() -> None:
    """A lone surrogate in a record is written as its JSON escape: the frame is UTF-8 and reads back whole."""
    frame = sse_frame({"text_delta": "a\ud800", "kind": "token"})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert json.loads(frame[6:].decode("utf-8")) == {"text_delta": "a\ud800", "kind": "token"}


def test_abort_body() -> None:
    assert parse_abort_request(body(request_id="a", reason="x")) == "a"
    assert parse_abort_request(body(rid="b")) == "b"
    with pytest.raises(V0ProtocolError):
        parse_abort_request(body(message_type="GenerateRequest", rid="c"))


def test_records_carry_the_envelope_and_end_once() -> None:
    w = V0EventWriter("r-9", trace_id="t-1")
    records = [
        w.prefill_done(4, 1),
        w.token([10, 11], "ab"),
        w.token([12], ""),
        w.usage(4, 3, 1),
        w.done("stop"),
    ]
    for r in records:
        assert r["protocol_version"] == PROTOCOL_VERSION and r["message_type"] == "WorkerEvent"
        assert r["request_id"] == "r-9" and r["trace_id"] == "t-1" and isinstance(r["created_at_ms"], int)
    assert (
        records[1]["token_id"] == 11 and records[1]["text_delta"] == "ab" and "text_delta" not in records[2]
    )
    assert records[3]["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "total_tokens": 7,
        "cached_tokens": 1,
    }
    assert w.tokens_sent == 3 and w.terminal_sent
    stamps = [r["created_at_ms"] for r in records]
    assert stamps == sorted(stamps)
    assert sse_frame(records[0]).startswith(b"data: {") and sse_frame(records[0]).endswith(b"}\n\n")
    err = V0EventWriter("r-10").error("timeout", "deadline passed", retryable=False)
    assert err["finish_reason"] == "error" and err["error"] == {
        "code": "timeout",
        "message": "deadline passed",
        "retryable": False,
    }
    with pytest.raises(ValueError):
        V0EventWriter("r-11").done("finished")


def test_server_info_is_the_identity_ominix_api_probes() -> None:
    info = server_info("m", "1.0")
    assert info["scheduler_backend"] == "sglang-ominix-v0-http-shim" and info["mode"] == "grpc"
    assert info["public_openai_api"] is False and info["auth_required"] is True
    assert info["routes"]["generate"] == "/generate"
