"""Request metrics as docs/METRICS.md states them, through an in-process engine on fake backends: the finish
reason a passed deadline is counted under, the model a refusal is labelled with, and request phase times
measured from the request's arrival at the front edge (before tokenization), as the client's own TTFT is."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ominix_runtime.contract import (
    Error,
    GenerateRequest,
    OminixError,
    RuntimeErrorKind,
    SamplingParams,
    Token,
    WorkerEvent,
)
from ominix_runtime.engine.config import EngineCoreConfig
from ominix_runtime.engine.core import EngineCore
from ominix_runtime.engine.stats import RunReport
from ominix_runtime.pb import common_pb2, engine_pb2
from ominix_runtime.server.engine_service import AlreadyLive, EngineService, EngineServiceBase
from ominix_runtime.server.metrics import EngineMetrics
from ominix_runtime.testing.fake_backend import FakeConfig, FakeRequestBackend, FakeStepBackend
from ominix_runtime.testing.front_link import linked_front

METRICS_DOC = Path(__file__).resolve().parents[2] / "docs" / "METRICS.md"
VOCAB = 49152
TOKENIZE_S = 0.3

Labels = tuple[tuple[str, str], ...]


def _samples(metrics: EngineMetrics, name: str) -> dict[Labels, float]:
    """The non-zero samples of ``name`` in a scrape, by their sorted labels."""
    out: dict[Labels, float] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name and sample.value:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _backend(kind: str) -> FakeStepBackend | FakeRequestBackend:
    """A backend serving model "m" that takes about 20 ms per token."""
    if kind == "step":
        return FakeStepBackend(FakeConfig(model_name="m", vocab_size=VOCAB, step_latency=0.02))
    return FakeRequestBackend(FakeConfig(worker_id="sg", model_name="m", vocab_size=VOCAB), token_delay=0.02)


@dataclass
class _SlowTokenizer:
    """Just enough of a Tokenizer for the front's tokenization pool: it takes ``delay`` seconds per prompt."""

    delay: float
    max_token_chars: int = 64
    vocab_size: int = VOCAB

    def encode(self, text: str, parse_special: bool = False) -> list[int]:
        time.sleep(self.delay)
        return [5, 6, 7, 8]


@pytest.mark.parametrize("kind", ["step", "request"])
def test_a_passed_deadline_is_counted_as_error_as_the_doc_says(kind: str) -> None:
    """A request whose deadline passes ends with Error(TIMEOUT) and counts as finish_reason="error" (GetStats
    calls it failed), in both group kinds; METRICS.md lists deadlines under that same reason."""

    async def main() -> tuple[list[WorkerEvent], dict[Labels, float]]:
        core = EngineCore([_backend(kind)], EngineCoreConfig())
        await core.start()
        metrics = EngineMetrics("m")
        core.add_listener(metrics.observe_run)
        sampling = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        request = GenerateRequest("dl", [5, 6, 7], sampling, deadline=time.monotonic() + 0.2)
        events = [e async for e in core.submit(request)]
        await core.stop()
        return events, _samples(metrics, "ominix_requests_total")

    events, counted = asyncio.run(asyncio.wait_for(main(), 30))
    assert isinstance(events[-1], Error) and events[-1].kind == RuntimeErrorKind.TIMEOUT
    assert counted == {(("finish_reason", "error"), ("model_name", "m")): 1.0}
    row = next(
        line for line in METRICS_DOC.read_text().splitlines() if line.startswith("| `ominix_requests_total`")
    )
    assert re.search(r"`error` \([^)]*deadline", row), f"METRICS.md does not put deadlines under error: {row}"


async def _refuse_each(front: EngineServiceBase, core: EngineCore, metrics: EngineMetrics) -> None:
    """Three refusals through ``front``, then wait until the engine process has counted them all."""
    cases = (
        ("too-long", "model-b", 20),  # over model-b's 16 tokens: refused by the front
        ("unknown", "no-such-model", 4),
        ("drained", "model-b", 4),  # no backend of model-b takes requests: refused by the engine
    )
    for rid, model, num_tokens in cases:
        if rid == "drained":
            core.drain("sg")
        pb = engine_pb2.GenerateRequest(
            request_id=rid,
            model=model,
            input_ids=engine_pb2.TokenIds(ids=list(range(5, 5 + num_tokens))),
            sampling=common_pb2.SamplingParams(max_tokens=4),
        )
        with pytest.raises(OminixError):
            await front.admit(pb, rid)
    for _ in range(100):  # a front's refusals reach the engine process over the link
        if sum(_samples(metrics, "ominix_request_rejections_total").values()) >= len(cases):
            break
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("front_process", [False, True], ids=["in-process", "front-process"])
def test_refusals_are_labelled_with_the_served_model_the_request_named(front_process: bool) -> None:
    """A refusal of a request naming a second served model (a request-level backend's) carries that model's
    label, whether the front refused it (too long for that model) or the engine did (its backend drained); an
    unknown model name, which the client chooses, is labelled with the engine's own model. Behind a front
    process (``--front-procs``, here its service linked over the hub's socket in this process) the engine
    process counts the front's refusals with the same labels."""

    async def main() -> dict[Labels, float]:
        step = FakeStepBackend(FakeConfig(model_name="model-a"))
        other = FakeRequestBackend(FakeConfig(worker_id="sg", model_name="model-b", max_model_len=16))
        core = EngineCore([step, other], EngineCoreConfig())
        await core.start()
        metrics = EngineMetrics("model-a")
        service = EngineService(core, None, "model-a", metrics)
        async with contextlib.AsyncExitStack() as stack:
            front: EngineServiceBase = service
            if front_process:
                _link, front = await stack.enter_async_context(linked_front(core, service))
            await _refuse_each(front, core, metrics)
        await core.stop()
        return _samples(metrics, "ominix_request_rejections_total")

    assert asyncio.run(asyncio.wait_for(main(), 30)) == {
        (("model_name", "model-b"), ("reason", "invalid_argument")): 1.0,
        (("model_name", "model-a"), ("reason", "model_not_found")): 1.0,
        (("model_name", "model-b"), ("reason", "backend_unavailable")): 1.0,
    }


def _long_request(rid: str) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=rid,
        input_ids=engine_pb2.TokenIds(ids=[5, 6, 7]),
        sampling=common_pb2.SamplingParams(max_tokens=4000, ignore_eos=True),
    )


@pytest.mark.parametrize("front_process", [False, True], ids=["in-process", "front-process"])
def test_a_duplicate_request_id_is_counted_once_as_such(front_process: bool) -> None:
    """A request whose id is live is refused (ALREADY_EXISTS) and counted once under reason
    "duplicate_request_id", in GetStats' rejected count too: whether the front refusing it holds the live
    request itself or, behind a front process, the id is live through another front (here the engine
    process's own service) or only in the engine, which the hub finds."""

    async def main() -> tuple[dict[Labels, float], int]:
        core = EngineCore(
            [FakeStepBackend(FakeConfig(model_name="m", step_latency=0.01))], EngineCoreConfig()
        )
        await core.start()
        metrics = EngineMetrics("m")
        service = EngineService(core, None, "m", metrics)
        held = [await service.admit(_long_request("held"), "held")]
        async with contextlib.AsyncExitStack() as stack:
            front: EngineServiceBase = service
            refused = ["held"]
            if front_process:
                _link, front = await stack.enter_async_context(linked_front(core, service))
                held.append(await front.admit(_long_request("own"), "own"))
                # Held by the engine with no front's record of it (as while a request of a lost link ends).
                sampling = SamplingParams(max_tokens=4000, ignore_eos=True)
                engine_only = core.submit(GenerateRequest("engine-only", [5, 6, 7], sampling))
                refused += ["own", "engine-only"]
            for rid in refused:
                with pytest.raises(AlreadyLive):
                    await front.admit(_long_request(rid), rid)
            for _ in range(100):  # a front's refusals reach the engine process over the link
                if sum(_samples(metrics, "ominix_request_rejections_total").values()) >= len(refused):
                    break
                await asyncio.sleep(0.01)
            for admitted in held:
                admitted.handle.abort()
            if front_process:
                engine_only.abort()
            stats = await service.GetStats(engine_pb2.GetStatsRequest(), None)  # type: ignore[arg-type]
        await core.stop(drain_timeout=0)
        return _samples(metrics, "ominix_request_rejections_total"), stats.requests_rejected

    counted, rejected = asyncio.run(asyncio.wait_for(main(), 30))
    refusals = 3 if front_process else 1
    assert counted == {(("model_name", "m"), ("reason", "duplicate_request_id")): float(refusals)}
    assert rejected == refusals


@pytest.mark.parametrize("kind", ["step", "request"])
def test_phase_times_run_from_arrival_like_the_clients_ttft(kind: str) -> None:
    """The run report behind the TTFT, end-to-end and queue-time histograms starts at the request's arrival:
    tokenizing its prompt (here TOKENIZE_S) is part of them, as it is of the time to the first token the
    client sees (from GenerateRequest.arrival_time, as PrefillDone.ttft_seconds counts), and the report's
    TTFT is not longer than that."""

    async def main() -> tuple[float, RunReport]:
        core = EngineCore([_backend(kind)], EngineCoreConfig())
        await core.start()
        reports: list[RunReport] = []
        core.add_listener(reports.append)
        service = EngineService(core, _SlowTokenizer(TOKENIZE_S), "m")  # type: ignore[arg-type]
        pb = engine_pb2.GenerateRequest(
            request_id="t1", prompt="hello", sampling=common_pb2.SamplingParams(max_tokens=3)
        )
        admitted = await service.admit(pb, "t1")
        client_ttft = -1.0
        while events := await admitted.handle.next_events():
            if client_ttft < 0 and any(isinstance(e, Token) for e in events):
                client_ttft = time.monotonic() - admitted.request.arrival_time
        service.release(admitted, True, None)
        await core.stop()
        service.close()
        return client_ttft, reports[0]

    client_ttft, report = asyncio.run(asyncio.wait_for(main(), 30))
    assert report.ttft is not None and report.queue_time is not None
    assert client_ttft >= TOKENIZE_S
    assert TOKENIZE_S <= report.ttft <= client_ttft
    assert report.queue_time >= TOKENIZE_S and report.e2e >= report.ttft


@dataclass
class _LetterTokenizer:
    """Every token id decodes to "x": a stop string of n x's completes on the n-th output token."""

    max_token_chars: int = 1
    vocab_size: int = VOCAB

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(token_ids)


@pytest.mark.parametrize("front_process", [False, True], ids=["in-process", "front-process"])
def test_a_stop_string_completed_by_the_last_allowed_token_is_counted_as_stop(front_process: bool) -> None:
    """The engine ends a request on its length when its max_tokens-th token is sampled, and only the front sees
    that this token completed a stop string: the client gets STOP, and the request is counted and logged under
    stop too (the engine's run report waits for the front's verdict). A request whose stop string never
    completes is counted under length."""

    async def main() -> tuple[dict[str, int], dict[Labels, float], list[RunReport]]:
        core = EngineCore(
            [FakeStepBackend(FakeConfig(model_name="m", vocab_size=VOCAB, step_latency=0.005))],
            EngineCoreConfig(),
        )
        await core.start()
        metrics = EngineMetrics("m")
        reports: list[RunReport] = []
        core.add_listener(metrics.observe_run)
        core.add_listener(reports.append)
        service = EngineService(core, _LetterTokenizer(), "m")  # type: ignore[arg-type]
        got: dict[str, int] = {}
        async with contextlib.AsyncExitStack() as stack:
            front: EngineServiceBase = service
            if front_process:
                _link, front = await stack.enter_async_context(linked_front(core, service))
                front.tokenizer = service.tokenizer  # as a front process loads the model's own
            for rid, stop in (("completes", "xxx"), ("never", "y")):
                pb = engine_pb2.GenerateRequest(
                    request_id=rid,
                    input_ids=engine_pb2.TokenIds(ids=[5, 6, 7]),
                    sampling=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True, stop=[stop]),
                )
                admitted = await front.admit(pb, rid)
                events = [e async for e in front.stream(admitted)]
                front.release(admitted, True, None)
                got[rid] = events[-1].done.finish_reason
            for _ in range(200):  # behind a front process the verdict crosses the link
                if len(reports) == 2:
                    break
                await asyncio.sleep(0.01)
        await core.stop()
        service.close()
        return got, _samples(metrics, "ominix_requests_total"), reports

    got, counted, reports = asyncio.run(asyncio.wait_for(main(), 30))
    assert got == {"completes": common_pb2.FINISH_REASON_STOP, "never": common_pb2.FINISH_REASON_LENGTH}
    assert counted == {
        (("finish_reason", "stop"), ("model_name", "m")): 1.0,
        (("finish_reason", "length"), ("model_name", "m")): 1.0,
    }
    assert {r.request_id: r.finish_reason.name for r in reports} == {"completes": "STOP", "never": "LENGTH"}


def test_an_unsettled_length_report_is_published_with_the_engines_reason_after_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request with stop strings ended on its length whose front never settles it (its client left before
    the end) is still reported, as LENGTH, once the wait for a verdict is over; a settle after that is a no-op."""
    from ominix_runtime.engine import core as core_module

    monkeypatch.setattr(core_module, "_VERDICT_WAIT_S", 0.05)

    async def main() -> tuple[list[RunReport], list[RunReport], bool]:
        core = EngineCore(
            [FakeStepBackend(FakeConfig(model_name="m", step_latency=0.005))], EngineCoreConfig()
        )
        await core.start()
        reports: list[RunReport] = []
        core.add_listener(reports.append)
        sampling = SamplingParams(max_tokens=2, ignore_eos=True, stop=["never"])
        events = [e async for e in core.submit(GenerateRequest("left", [5, 6, 7], sampling))]
        assert events[-1].finish_reason.name == "LENGTH"  # type: ignore[union-attr]
        before = list(reports)
        await asyncio.sleep(0.3)
        late = core.settle("left", "never")
        await core.stop()
        return before, reports, late

    before, reports, late = asyncio.run(asyncio.wait_for(main(), 30))
    assert before == []  # held for the front's verdict
    assert [(r.request_id, r.finish_reason.name) for r in reports] == [("left", "LENGTH")]
    assert late is False


def test_a_held_report_is_published_when_a_request_of_the_same_id_ends_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request of a reused id that ends on its length while the previous one's report still waits: the
    earlier report comes out at once with the engine's reason, and the verdict that follows is the later
    request's. Every report is published once."""
    from ominix_runtime.engine import core as core_module

    monkeypatch.setattr(core_module, "_VERDICT_WAIT_S", 60.0)

    async def main() -> list[tuple[str, str, int]]:
        core = EngineCore(
            [FakeStepBackend(FakeConfig(model_name="m", step_latency=0.005))], EngineCoreConfig()
        )
        await core.start()
        reports: list[RunReport] = []
        core.add_listener(reports.append)
        for max_tokens in (2, 3):
            sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop=["zz"])
            [e async for e in core.submit(GenerateRequest("a", [5, 6, 7], sampling))]
        assert core.settle("a", "zz")
        assert not core.settle("a", "zz")  # nothing left to settle
        without_stops = SamplingParams(max_tokens=2, ignore_eos=True)
        [e async for e in core.submit(GenerateRequest("a", [5, 6, 7], without_stops))]
        await core.stop()
        return [(r.request_id, r.finish_reason.name, r.output_tokens) for r in reports]

    assert asyncio.run(asyncio.wait_for(main(), 30)) == [
        ("a", "LENGTH", 2),
        ("a", "STOP", 3),
        ("a", "LENGTH", 2),
    ]
