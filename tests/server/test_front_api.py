"""The Engine gRPC front service over the fake backend: event order, inputs, errors, stops, cancel, metrics."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from server_harness import RunningDaemon

from ominix_runtime.models import DEFAULT_MODEL_NAME
from ominix_runtime.pb import common_pb2, engine_pb2

FINISH_STOP = common_pb2.FINISH_REASON_STOP
FINISH_LENGTH = common_pb2.FINISH_REASON_LENGTH
FINISH_ABORT = common_pb2.FINISH_REASON_ABORT


def generate(daemon: RunningDaemon, timeout: float = 30.0, **fields) -> list[engine_pb2.GenerateEvent]:  # noqa: ANN003
    return list(daemon.stub.Generate(engine_pb2.GenerateRequest(**fields), timeout=timeout))


def kinds(events: list[engine_pb2.GenerateEvent]) -> list[str]:
    return [e.WhichOneof("event") for e in events]


def greedy(max_tokens: int, **extra) -> common_pb2.SamplingParams:  # noqa: ANN003
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)


def wait_kv_free(daemon: RunningDaemon, timeout: float = 5.0) -> engine_pb2.GetLoadResponse:
    deadline = time.monotonic() + timeout
    while True:
        load = daemon.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
        if load.total.kv_bytes_used == 0 and load.total.running_requests == 0:
            return load
        assert time.monotonic() < deadline, f"KV still used: {load.total}"
        time.sleep(0.01)


def test_health_is_serving(fake_daemon: RunningDaemon) -> None:
    stub = health_pb2_grpc.HealthStub(fake_daemon.channel)
    for service in ("", "ominix.runtime.v1.Engine"):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_stream_event_order_and_text(fake_daemon: RunningDaemon) -> None:
    events = generate(fake_daemon, prompt="Hello there", sampling=greedy(12), request_id="order-1")
    k = kinds(events)
    assert k[0] == "prefill_done" and k[-2:] == ["usage", "done"]
    assert set(k[1:-2]) == {"token"}
    assert all(e.request_id == "order-1" for e in events)
    token_ids = [t for e in events if e.HasField("token") for t in e.token.token_ids]
    assert len(token_ids) == 12
    streamed = "".join(e.token.text for e in events if e.HasField("token"))
    done = events[-1].done
    assert done.finish_reason == FINISH_LENGTH
    assert done.text == streamed
    assert events[-2].usage.completion_tokens == 12
    assert events[-2].usage.prompt_tokens == events[0].prefill_done.prompt_tokens > 0


def test_non_streaming_sends_usage_and_done_only(fake_daemon: RunningDaemon) -> None:
    streamed = generate(fake_daemon, prompt="Same prompt", sampling=greedy(8))
    whole = generate(fake_daemon, prompt="Same prompt", sampling=greedy(8), stream=False)
    assert kinds(whole) == ["usage", "done"]
    assert whole[-1].done.text == streamed[-1].done.text


def test_prompt_forms_agree(fake_daemon: RunningDaemon) -> None:
    tokenizer_ids = generate(fake_daemon, prompt="abc", sampling=greedy(1))[0].prefill_done.prompt_tokens
    assert tokenizer_ids > 0
    by_ids = generate(fake_daemon, input_ids=engine_pb2.TokenIds(ids=[17, 18, 19]), sampling=greedy(4))
    assert by_ids[0].prefill_done.prompt_tokens == 3
    chat = generate(
        fake_daemon,
        messages=engine_pb2.ChatMessages(messages=[engine_pb2.ChatMessage(role="user", content="hi")]),
        sampling=greedy(4),
    )
    # SmolLM2's template adds a system turn: far more tokens than the two-letter message.
    assert chat[0].prefill_done.prompt_tokens > 10
    assert chat[-1].done.finish_reason == FINISH_LENGTH


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        (
            {"prompt": "x", "sampling": common_pb2.SamplingParams(temperature=-1.0)},
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        ({"prompt": "x", "sampling": common_pb2.SamplingParams(top_p=1.5)}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": "x", "model": "no-such-model"}, grpc.StatusCode.NOT_FOUND),
        ({}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"input_ids": engine_pb2.TokenIds(ids=[10**6])}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": "word " * 3000}, grpc.StatusCode.INVALID_ARGUMENT),
        # Fits the context but not the KV cache even alone (64 blocks x 16 tokens).
        (
            {"prompt": "x", "sampling": common_pb2.SamplingParams(max_tokens=1500)},
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
    ],
)
def test_bad_requests_get_status_codes(
    fake_daemon: RunningDaemon, fields: dict, code: grpc.StatusCode
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(fake_daemon, **fields)
    assert info.value.code() == code
    assert info.value.details()


def test_served_model_name_is_accepted(fake_daemon: RunningDaemon) -> None:
    events = generate(fake_daemon, prompt="x", model="SmolLM2-135M-Instruct", sampling=greedy(2))
    assert events[-1].done.finish_reason == FINISH_LENGTH


def test_duplicate_live_request_id_is_refused(fake_daemon: RunningDaemon) -> None:
    first = fake_daemon.stub.Generate(
        engine_pb2.GenerateRequest(request_id="dup", prompt="x", sampling=greedy(800)), timeout=30
    )
    assert next(first).WhichOneof("event") == "prefill_done"
    with pytest.raises(grpc.RpcError) as info:
        generate(fake_daemon, request_id="dup", prompt="y", sampling=greedy(2))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    resp = fake_daemon.stub.Abort(engine_pb2.AbortRequest(request_id="dup"), timeout=5)
    assert resp.found
    rest = list(first)
    assert rest[-1].done.finish_reason == FINISH_ABORT
    assert kinds(rest).count("done") == 1
    assert not fake_daemon.stub.Abort(engine_pb2.AbortRequest(request_id="dup"), timeout=5).found
    wait_kv_free(fake_daemon)


def test_stop_string_across_token_boundaries(fake_daemon: RunningDaemon) -> None:
    reference = generate(fake_daemon, prompt="Tell me a story", sampling=greedy(40))
    pieces = [e.token.text for e in reference if e.HasField("token")]
    full = reference[-1].done.text
    # A stop string made of the end of one token's text and the start of a later one's.
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    index = next(i for i in range(5, len(pieces) - 3) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 1)
    start = offsets[index] + len(pieces[index]) - 2
    stop = full[start : offsets[index + 1] + len(pieces[index + 1])]
    expected = full[: full.find(stop)]
    events = generate(fake_daemon, prompt="Tell me a story", sampling=greedy(40, stop=[stop]))
    done = events[-1].done
    assert done.finish_reason == FINISH_STOP
    assert done.matched_stop == stop
    assert done.text == expected
    streamed = "".join(e.token.text for e in events if e.HasField("token"))
    assert streamed == expected and stop not in streamed
    assert kinds(events)[-2:] == ["usage", "done"]
    wait_kv_free(fake_daemon)


def test_a_stop_token_id_ends_the_output_without_its_text(fake_daemon: RunningDaemon) -> None:
    """A stop_token_ids entry that is an ordinary word token ends the request with STOP: its id is the last
    output token (and counted in usage), its text is neither streamed nor in done.text, as vLLM and SGLang do
    (and as for a matched stop string): the text is that of the tokens before it."""
    prompt = "Tell me a story"
    reference = generate(fake_daemon, prompt=prompt, sampling=greedy(40))
    ids = [t for e in reference if e.HasField("token") for t in e.token.token_ids]

    def text_of(n: int) -> str:  # the output text of the first n tokens (greedy: the same tokens again)
        return generate(fake_daemon, prompt=prompt, sampling=greedy(n))[-1].done.text

    for k in range(3, len(ids)):
        if ids[k] in ids[:k]:
            continue  # it would stop earlier
        before, through = text_of(k), text_of(k + 1)
        if len(through) > len(before) and through.startswith(before) and "\ufffd" not in through:
            break  # ids[k] is a token with text of its own
    else:
        pytest.fail(f"no first-seen token with text of its own in {ids}")
    events = generate(fake_daemon, prompt=prompt, sampling=greedy(40, stop_token_ids=[ids[k]]))
    assert [t for e in events if e.HasField("token") for t in e.token.token_ids] == ids[: k + 1]
    done = events[-1].done
    assert (done.finish_reason, done.matched_stop, done.text) == (FINISH_STOP, "", before)
    assert "".join(e.token.text for e in events if e.HasField("token")) == before
    assert events[-2].usage.completion_tokens == k + 1
    wait_kv_free(fake_daemon)


def test_client_cancel_frees_kv(fake_daemon: RunningDaemon) -> None:
    call = fake_daemon.stub.Generate(
        engine_pb2.GenerateRequest(request_id="cancel-me", prompt="long " * 40, sampling=greedy(800)),
        timeout=30,
    )
    seen_tokens = 0
    for event in call:
        if event.HasField("token"):
            seen_tokens += 1
            if seen_tokens == 3:
                break
    load = fake_daemon.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
    assert load.total.kv_bytes_used > 0
    steps_before = fake_daemon.backend.num_steps
    call.cancel()
    wait_kv_free(fake_daemon, timeout=2.0)
    # The worker was told to drop the request promptly (a couple of steps at most: one may be in flight).
    assert (
        fake_daemon.backend.num_steps - steps_before <= 3 or "cancel-me" not in fake_daemon.backend.requests
    )


def test_concurrent_streams_each_end_once(fake_daemon: RunningDaemon) -> None:
    results: dict[int, list[engine_pb2.GenerateEvent]] = {}

    def run(i: int) -> None:
        sampling = common_pb2.SamplingParams(max_tokens=5 + i % 7, temperature=0.7 * (i % 2), seed=i)
        results[i] = generate(fake_daemon, prompt=f"request {i} " * (1 + i % 5), sampling=sampling)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 16
    for i, events in results.items():
        k = kinds(events)
        assert k.count("done") + k.count("error") == 1 and k[-1] == "done"
        assert sum(len(e.token.token_ids) for e in events if e.HasField("token")) == 5 + i % 7
    wait_kv_free(fake_daemon)


def test_introspection_rpcs(fake_daemon: RunningDaemon) -> None:
    backends = fake_daemon.stub.ListBackends(engine_pb2.ListBackendsRequest(), timeout=5).backends
    assert [b.worker_id for b in backends] == ["fake-0"]
    assert backends[0].model.vocab_size == 49152
    load = fake_daemon.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
    assert load.total.worker_id == "total" and [b.worker_id for b in load.backends] == ["fake-0"]
    assert load.total.kv_bytes_capacity == 64 * 1024
    stats = fake_daemon.stub.GetStats(engine_pb2.GetStatsRequest(), timeout=5)
    assert stats.requests_accepted > 0 and stats.generated_tokens > 0 and stats.steps > 0
    assert stats.kv_blocks_total == 64 and stats.uptime_seconds > 0


def scrape(daemon: RunningDaemon) -> dict[str, list]:
    with urllib.request.urlopen(daemon.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_metrics_families_and_counts_move(fake_daemon: RunningDaemon) -> None:
    def finished_stop_or_length(families: dict[str, list]) -> float:
        return sum(
            s.value
            for s in families["ominix_requests"]
            if s.name == "ominix_requests_total" and s.labels["finish_reason"] in ("length", "stop")
        )

    def worker_value(families: dict[str, list], family: str) -> float:
        return next(s.value for s in families[family] if s.labels["worker_id"] == "fake-0")

    before = scrape(fake_daemon)
    generate(fake_daemon, prompt="metrics", sampling=greedy(6))
    for _ in range(2):  # a prompt of several full KV blocks, twice: the second run hits the prefix cache
        generate(fake_daemon, prompt="a shared prefix " * 20, sampling=greedy(2))
    deadline = time.monotonic() + 5
    while True:
        after = scrape(fake_daemon)
        hits = worker_value(after, "ominix_prefix_cache_hit_tokens")
        # Worker figures refresh periodically; request counters move with each finished request.
        if finished_stop_or_length(after) > finished_stop_or_length(before) and hits > 0:
            break
        assert time.monotonic() < deadline, "ominix_requests_total or the prefix cache hits did not move"
        time.sleep(0.05)
    expected = {
        "ominix_build_info",
        "ominix_requests",
        "ominix_request_rejections",
        "ominix_requests_waiting",
        "ominix_requests_running",
        "ominix_requests_preempted",
        "ominix_request_ttft_seconds",
        "ominix_request_inter_token_latency_seconds",
        "ominix_request_tpot_seconds",
        "ominix_request_e2e_seconds",
        "ominix_request_queue_time_seconds",
        "ominix_request_prompt_tokens",
        "ominix_request_generation_tokens",
        "ominix_prompt_tokens",
        "ominix_generation_tokens",
        "ominix_kv_blocks_used",
        "ominix_kv_blocks_cached",
        "ominix_kv_blocks_free",
        "ominix_kv_blocks_capacity",
        "ominix_kv_capacity_tokens",
        "ominix_kv_usage_ratio",
        "ominix_prefix_cache_queried_tokens",
        "ominix_prefix_cache_hit_tokens",
        "ominix_preemptions",
        "ominix_backlog_admission_held_steps",
        "ominix_burst_budget_steps",
        "ominix_scheduler_step_duration_seconds",
        "ominix_scheduler_batch_size",
        "ominix_integrity_violations",
        "ominix_worker_up",
        "ominix_worker_failovers",
        "ominix_worker_restarts",
    }
    assert expected <= set(after), expected - set(after)
    gen_tokens = next(s.value for s in after["ominix_generation_tokens"] if s.name.endswith("_total"))
    assert gen_tokens >= 6
    ttft_count = next(s.value for s in after["ominix_request_ttft_seconds"] if s.name.endswith("_count"))
    assert ttft_count >= 1
    assert all(s.labels["model_name"] == DEFAULT_MODEL_NAME for s in after["ominix_request_ttft_seconds"])
    worker_ids = {s.labels.get("worker_id") for s in after["ominix_scheduler_step_duration_seconds"]}
    assert "fake-0" in worker_ids
    assert worker_value(after, "ominix_kv_blocks_capacity") == 64
    assert worker_value(after, "ominix_kv_capacity_tokens") == 64 * 16  # the fake's 16-token blocks
    assert worker_value(after, "ominix_worker_up") == 1
    queried = worker_value(after, "ominix_prefix_cache_queried_tokens")
    assert 0 < hits <= queried
    kv = [
        worker_value(after, f"ominix_kv_blocks_{k}") for k in ("used", "cached", "free")
    ]  # leased + cached-evictable + free == capacity (the registry invariant)
    assert sum(kv) == 64


def test_deadline_ends_the_stream_with_timeout(fake_daemon: RunningDaemon) -> None:
    events = generate(fake_daemon, prompt="slow", sampling=greedy(800), deadline_ms=100)
    assert kinds(events).count("error") == 1 and kinds(events)[-1] == "error"
    assert events[-1].error.code == common_pb2.ERROR_CODE_TIMEOUT
    wait_kv_free(fake_daemon)
