"""The text a request's output becomes at two edges: a prompt (sent as token ids) that ends inside a UTF-8
character the output completes, and a request-level backend's own final text after a stop string the front
matched at the very start of the output."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from ominix_runtime import wire
from ominix_runtime.contract import (
    Done,
    FinishReason,
    GenerateRequest,
    PrefillDone,
    SamplingParams,
    Token,
    Usage,
    WorkerEvent,
)
from ominix_runtime.pb import engine_pb2
from ominix_runtime.server.engine_service import EngineService
from ominix_runtime.server.tracing import RequestSpan
from ominix_runtime.text import IncrementalDetokenizer, Tokenizer

MODEL = "served-model"


def test_a_character_the_prompt_leaves_open_is_the_outputs(smollm2_tokenizer: Tokenizer) -> None:
    """ "Hello 😀 world" as [Hello][ +first bytes of 😀][last byte][ world]: with the first two as the prompt,
    the output's text is the completed emoji and " world", token by token or all at once (it was " world",
    the emoji lost; and nothing at all when the output only completed it)."""
    tok = smollm2_tokenizer
    ids = tok.encode("Hello 😀 world", add_special_tokens=False)
    prompt, output = ids[:2], ids[2:]
    assert tok.decode(prompt) == "Hello \ufffd" and len(output) == 2
    one_by_one = IncrementalDetokenizer(tok, prompt)
    assert "".join(one_by_one.push([t]) for t in output) + one_by_one.flush() == "😀 world"
    together = IncrementalDetokenizer(tok, prompt)
    assert together.push(output) + together.flush() == "😀 world"
    emoji = tok.encode("😀", add_special_tokens=False)  # three byte-level tokens
    completing = IncrementalDetokenizer(tok, emoji[:1])
    assert "".join(completing.push([t]) for t in emoji[1:]) + completing.flush() == "😀"


class _Engine:
    """What the event stream asks of the engine: finish() once the front matches a stop string, settle() when
    the engine ended a request with stop strings on its length."""

    def __init__(self) -> None:
        self.settled: list[tuple[str, str]] = []

    def capabilities(self) -> list[object]:
        return []

    def finish(self, request_id: str, reason: FinishReason, matched_stop: str) -> bool:
        return True

    def settle(self, request_id: str, matched_stop: str) -> bool:
        self.settled.append((request_id, matched_stop))
        return True


class _Handle:
    """A request-level backend's events, delivered in one batch."""

    def __init__(self, events: Sequence[WorkerEvent]) -> None:
        self._events = list(events)

    async def next_events(self) -> list[WorkerEvent]:
        events, self._events = self._events, []
        return events

    def abort(self) -> None:
        pass


def _stream(
    events: Sequence[WorkerEvent], sampling: SamplingParams, stream: bool, engine: _Engine | None = None
) -> list[engine_pb2.GenerateEvent]:
    async def run() -> list[engine_pb2.GenerateEvent]:
        service = EngineService(engine or _Engine(), None, MODEL)  # type: ignore[arg-type]
        try:
            request = GenerateRequest("r", [1], sampling, model="other-model", stream=stream)
            return [e async for e in service._events(request, _Handle(events), RequestSpan())]  # noqa: SLF001
        finally:
            service.close()

    return asyncio.run(run())


def test_a_stop_at_the_outputs_start_leaves_no_backend_text_in_done() -> None:
    """The backend ended on length in the same chunk, so its own Done text still holds the stop string (and
    what follows); the front's stop match wins: done.text is the text before the stop, here none."""
    for stream, stop, text in ((True, "STOP", "STOP"), (False, "\n\n", "\n\nHi")):
        engine = _Engine()
        events = _stream(
            [
                PrefillDone("r", 1),
                Token("r", [7, 8], text=text),
                Usage("r", 1, 2),
                Done("r", FinishReason.LENGTH, text=text),
            ],
            SamplingParams(max_tokens=2, stop=[stop]),
            stream,
            engine,
        )
        (done,) = [e.done for e in events if e.HasField("done")]
        assert done.matched_stop == stop and done.text == ""
        assert engine.settled == [("r", stop)]  # the engine's run report names STOP too
        assert "".join(e.token.text for e in events if e.HasField("token")) == ""


def test_a_length_end_without_a_stop_match_is_settled_as_length_and_others_are_not_settled() -> None:
    """The engine's LENGTH stands when no stop string completed (settled with ""); a request without stop
    strings, or one the engine ended otherwise, needs no verdict."""
    cases = [
        (SamplingParams(max_tokens=2, stop=["zzz"]), FinishReason.LENGTH, [("r", "")]),
        (SamplingParams(max_tokens=2), FinishReason.LENGTH, []),
        (SamplingParams(max_tokens=2, stop=["zzz"]), FinishReason.STOP, []),
    ]
    for sampling, reason, settled in cases:
        engine = _Engine()
        events = _stream(
            [
                PrefillDone("r", 1),
                Token("r", [7, 8], text="ab"),
                Usage("r", 1, 2),
                Done("r", reason, text="ab"),
            ],
            sampling,
            True,
            engine,
        )
        (done,) = [e.done for e in events if e.HasField("done")]
        assert done.finish_reason == wire.finish_reason_to_pb(reason)
        assert engine.settled == settled


def test_the_verdict_is_settled_before_the_stream_yields_its_end() -> None:
    """A client that stops reading at the usage event (before Done) still leaves the engine its verdict."""

    async def run() -> list[tuple[str, str]]:
        engine = _Engine()
        service = EngineService(engine, None, MODEL)  # type: ignore[arg-type]
        try:
            request = GenerateRequest(
                "r", [1], SamplingParams(max_tokens=2, stop=["ab"]), model="other-model"
            )
            events = [PrefillDone("r", 1), Token("r", [7, 8], text="ab"), Usage("r", 1, 2)]
            events.append(Done("r", FinishReason.LENGTH, text="ab"))
            stream = service._events(request, _Handle(events), RequestSpan())  # noqa: SLF001
            async for event in stream:
                if event.HasField("usage"):
                    break  # the client leaves here
            await stream.aclose()
        finally:
            service.close()
        return engine.settled

    assert asyncio.run(run()) == [("r", "ab")]
