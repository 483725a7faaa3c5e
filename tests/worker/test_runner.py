"""Runner behaviour beyond logits: seeded sampling across batches and preemption, per-request errors."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ominix_runtime.contract import (
    DecodeStep,
    NewRequestData,
    RunningRequestData,
    RuntimeErrorKind,
    SamplingParams,
    StepResult,
)
from ominix_worker.runner import (
    ModelRunner,
    _extend_slots,
    build_runner,
    resolve_placeholders,
    warm_up_token_counts,
)


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Callable[[str], Path]) -> ModelRunner:
    return build_runner(str(tiny_model_dir("llama")), num_blocks=32, block_size=16)


def seeded(seed: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, seed=seed)


def generate(runner: ModelRunner, requests: list[NewRequestData], steps: int) -> dict[str, list[int]]:
    """Prefill every request in step 1, then decode them together; returns each one's sampled tokens."""
    runner.reset()
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    step = DecodeStep(1, new_requests=requests)
    for step_id in range(1, steps + 1):
        if step_id > 1:
            step = DecodeStep(step_id, running_requests=[RunningRequestData(rid, [], 1) for rid in out])
        for o in runner.execute_step(step).outputs:
            assert o.error_kind is None, o.error_message
            out[o.request_id].append(o.sampled_token_id)
    return out


def test_seeded_tokens_do_not_depend_on_the_batch(runner: ModelRunner) -> None:
    prompt = list(range(10, 30))
    alone = generate(runner, [NewRequestData("x", prompt, seeded(123), [5, 6], 0, 20, 0)], 8)
    together = generate(
        runner,
        [
            NewRequestData("y", list(range(40, 47)), seeded(7), [1], 0, 7, 0),
            NewRequestData("x", prompt, seeded(123), [9, 3], 0, 20, 0),
            NewRequestData("z", list(range(50, 80)), seeded(None), [2, 4, 8], 0, 30, 99),
        ],
        8,
    )
    assert together["x"] == alone["x"]
    other_seed = generate(runner, [NewRequestData("x", prompt, seeded(124), [5, 6], 0, 20, 0)], 8)
    assert other_seed["x"] != alone["x"]


def test_effective_seed_makes_a_resumed_request_draw_the_same(runner: ModelRunner) -> None:
    prompt = list(range(60, 75))
    full = generate(runner, [NewRequestData("p", prompt, seeded(None), [0, 1], 0, 15, 2024)], 6)["p"]
    # Preempted after 3 tokens: the engine resends prompt + those tokens and recomputes them all.
    resumed = generate(
        runner, [NewRequestData("p", prompt, seeded(None), [7, 8], 0, 18, 2024, output_token_ids=full[:3])], 3
    )["p"]
    assert resumed == full[3:]


def test_problems_stay_with_their_request(runner: ModelRunner) -> None:
    runner.reset()
    good = NewRequestData("good", [5, 6, 7], SamplingParams(temperature=0.0), [3], 0, 3, 0)
    bad_sampling = NewRequestData("bad-sampling", [5, 6], SamplingParams(top_p=0.0), [4], 0, 2, 0)
    too_few_blocks = NewRequestData("no-room", list(range(3, 40)), SamplingParams(), [5], 0, 37, 0)
    bad_token = NewRequestData("bad-token", [5, 10_000], SamplingParams(), [6], 0, 2, 0)
    bad_block = NewRequestData("bad-block", [5, 6], SamplingParams(), [runner.num_blocks], 0, 2, 0)
    result = runner.execute_step(
        DecodeStep(
            1,
            new_requests=[good, bad_sampling, too_few_blocks, bad_token, bad_block],
            running_requests=[RunningRequestData("ghost", [], 1)],
        )
    )
    by_id = {o.request_id: o for o in result.outputs}
    assert [o.request_id for o in result.outputs] == [
        "good",
        "bad-sampling",
        "no-room",
        "bad-token",
        "bad-block",
        "ghost",
    ]
    assert by_id["good"].sampled_token_id is not None and by_id["good"].error_kind is None
    assert by_id["bad-sampling"].error_kind == RuntimeErrorKind.INVALID_ARGUMENT
    assert by_id["bad-token"].error_kind == RuntimeErrorKind.INVALID_ARGUMENT
    assert (
        by_id["no-room"].error_kind == RuntimeErrorKind.INTERNAL
        and "KV blocks" in by_id["no-room"].error_message
    )
    assert by_id["ghost"].error_kind == RuntimeErrorKind.INTERNAL
    assert "outside" in by_id["bad-block"].error_message
    assert set(runner.requests) == {"good"}
    assert result.num_tokens == 3


def test_min_tokens_holds_back_eos(runner: ModelRunner) -> None:
    eos = runner.config.eos_token_ids[0]
    prompt = list(range(100, 110))
    # A stop id set to every token the greedy run produces shows that min_tokens masks stop ids too.
    plain = generate(
        runner, [NewRequestData("m", prompt, SamplingParams(temperature=0.0), [0], 0, 10, 0)], 4
    )["m"]
    sp = SamplingParams(temperature=0.0, min_tokens=4, max_tokens=8, stop_token_ids=sorted(set(plain)))
    held = generate(runner, [NewRequestData("m", prompt, sp, [0], 0, 10, 0)], 4)["m"]
    assert not set(held) & (set(plain) | {eos})


def test_logprobs_in_outputs(runner: ModelRunner) -> None:
    runner.reset()
    sp = SamplingParams(temperature=0.0, logprobs=3)
    out = runner.execute_step(
        DecodeStep(1, new_requests=[NewRequestData("l", [4, 5, 6], sp, [0], 0, 3, 0)])
    ).outputs[0]
    assert out.logprobs is not None and len(out.logprobs.top) == 3
    assert out.logprobs.sampled.token_id == out.sampled_token_id == out.logprobs.top[0].token_id
    assert out.logprobs.top[0].logprob >= out.logprobs.top[1].logprob >= out.logprobs.top[2].logprob


def test_slots_come_from_the_block_table_position_by_position() -> None:
    """The slot mapping, built a block's range at a time, is each position's block * size + offset, for spans
    that start and end anywhere in a block (one token, within one block, across many)."""
    gen = random.Random(5)
    for block_size in (16, 32):
        blocks = gen.sample(range(500), 40)
        for start, end in ((0, 1), (17, 18), (3, 9), (0, block_size), (5, 5 + 3 * block_size + 7), (0, 640)):
            got = [7]
            _extend_slots(got, blocks, start, end, block_size)
            want = [7] + [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]
            assert got == want


def test_warm_up_covers_every_power_of_two_prefill_size_on_cuda() -> None:
    # The fused-MoE tables are keyed by powers of two; each key's tiles compile at the first step near it.
    assert warm_up_token_counts(8192, cuda=True) == [16, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert warm_up_token_counts(3000, cuda=True) == [16, 64, 128, 256, 512, 1024, 2048, 3000]
    assert warm_up_token_counts(8192, cuda=False) == [16]
    assert warm_up_token_counts(8, cuda=False) == [8]


def test_warm_up_runs_its_forwards_and_the_placeholder_gather(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ominix_worker import runner as runner_module

    gathered: list[list[int]] = []

    def spy(ids: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        out = resolve_placeholders(ids, prev_tokens)
        gathered.append(out.tolist())
        return out

    monkeypatch.setattr(runner_module, "resolve_placeholders", spy)
    assert runner.warm_up(64) == [16]
    assert gathered == [[0, 1]]  # the placeholder -1 took the pending id 0; the real id 1 stayed


def test_placeholders_take_the_pending_steps_ids() -> None:
    ids = torch.tensor([-2, 7, -1, -3, 9])
    pending = torch.tensor([100, 200, 300])
    assert resolve_placeholders(ids, pending).tolist() == [200, 7, 100, 300, 9]


def test_a_mixed_warm_up_step_leaves_generation_unchanged(runner: ModelRunner) -> None:
    # The warm-up step writes KV into blocks that real requests reuse; it must leave no state behind.
    request = NewRequestData("w", list(range(3, 40)), SamplingParams(temperature=0.0), [0, 1, 2], 0, 37, 0)
    before = generate(runner, [request], 6)
    runner.reset()
    assert runner.mixed_forward(5, 40, 21)
    assert runner.mixed_forward(1, 300, 21)
    assert not runner.mixed_forward(1, 10_000, 10_000)  # more than the cache holds: nothing runs
    assert generate(runner, [request], 6) == before


def run_steps(runner: ModelRunner, steps: list[DecodeStep]) -> list[tuple[int, list[tuple[str, int | None]]]]:
    """Each step's (step id, [(request, sampled token)]) in the order the runner reports them."""
    runner.reset()
    results = []
    for step in steps:
        result = runner.execute_step(step)
        results += ([result] if result is not None else []) + runner.take_results()
    runner.finish_pending()
    results += runner.take_results()
    return [(r.step_id, [(o.request_id, o.sampled_token_id) for o in r.outputs]) for r in results]


def test_overlapped_eager_steps_match_the_synchronous_ones(runner: ModelRunner) -> None:
    """Prefill and mixed steps launched before the previous step's ids reach the host (``pipeline_eager``):
    a decode row's input is the pending step's placeholder, gathered from its sampled ids. Here on the CPU
    (the pending step's ids are there at once); the same tokens, results once per step and in step order."""
    steps = [
        DecodeStep(1, new_requests=[NewRequestData("a", list(range(10, 30)), seeded(5), [1, 2], 0, 20, 0)]),
        # b's prompt in two chunks beside a's decodes: a mixed step that samples only a, then one that samples both
        DecodeStep(
            2,
            new_requests=[NewRequestData("b", list(range(40, 70)), seeded(6), [3, 4], 0, 16, 0)],
            running_requests=[RunningRequestData("a", [], 1)],
        ),
        DecodeStep(3, running_requests=[RunningRequestData("a", [], 1), RunningRequestData("b", [], 14)]),
        *[
            DecodeStep(s, running_requests=[RunningRequestData("a", [], 1), RunningRequestData("b", [], 1)])
            for s in range(4, 8)
        ],
    ]
    saved = runner.overlap_steps, runner.pipeline_eager
    runner.overlap_steps, runner.pipeline_eager = False, False
    try:
        synchronous = run_steps(runner, steps)
        runner.overlap_steps, runner.pipeline_eager = True, True
        overlapped = run_steps(runner, steps)
        assert runner._pending is None
    finally:
        runner.overlap_steps, runner.pipeline_eager = saved
    assert [step_id for step_id, _ in overlapped] == list(range(1, 8))
    assert overlapped == synchronous
    assert dict(overlapped[1][1])["b"] is None and dict(overlapped[2][1])["b"] is not None
    assert all(token is None or token >= 0 for _, outs in overlapped for _, token in outs)


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_a_mixed_steps_rows_run_prompt_side_first_and_report_in_the_steps_order(
    runner: ModelRunner, overlap: bool
) -> None:
    """The runner runs a mixed step's prompt-side rows before its single-token ones (the paged-attention
    prefill launch then spans only those), whatever order the step lists them in: the tokens are the same for
    either order, and each result lists its requests in its step's order."""

    def steps(decodes_first: bool) -> list[DecodeStep]:
        def mixed(step_id: int, chunk: int) -> DecodeStep:
            running = [RunningRequestData("a", [], 1), RunningRequestData("c", [], 1)]
            rows = [*running, RunningRequestData("b", [], chunk)]
            return DecodeStep(step_id, running_requests=rows if decodes_first else rows[::-1])

        return [
            DecodeStep(
                1,
                new_requests=[
                    NewRequestData("a", list(range(10, 30)), seeded(5), [1, 2], 0, 20, 0),
                    NewRequestData("c", list(range(80, 90)), seeded(8), [7], 0, 10, 0),
                ],
            ),
            DecodeStep(
                2,
                new_requests=[NewRequestData("b", list(range(40, 70)), seeded(6), [3, 4], 0, 10, 0)],
                running_requests=[RunningRequestData("a", [], 1), RunningRequestData("c", [], 1)],
            ),
            mixed(3, 10),
            mixed(4, 10),
            mixed(5, 1),
        ]

    saved = runner.overlap_steps, runner.pipeline_eager
    runner.overlap_steps, runner.pipeline_eager = overlap, overlap
    try:
        rows_seen: list[list[str]] = []
        prepare = runner._prepare_inputs

        def recording_prepare(rows, *args, **kwargs):  # type: ignore[no-untyped-def]
            rows_seen.append([row.request.request_id for row in rows])
            return prepare(rows, *args, **kwargs)

        runner._prepare_inputs = recording_prepare  # type: ignore[method-assign]
        try:
            decodes_first = run_steps(runner, steps(True))
            listed_order = rows_seen[:]
            prompt_first = run_steps(runner, steps(False))
        finally:
            del runner._prepare_inputs
    finally:
        runner.overlap_steps, runner.pipeline_eager = saved
    # Steps 3 and 4 list b's chunks after the decode rows; the rows ran with b first.
    assert listed_order[2:4] == [["b", "a", "c"], ["b", "a", "c"]]

    def by_request(results: list[tuple[int, list[tuple[str, int | None]]]]) -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {}
        for _, outs in results:
            for rid, token in outs:
                if token is not None:
                    tokens.setdefault(rid, []).append(token)
        return tokens

    assert by_request(decodes_first) == by_request(prompt_first)
    assert [len(t) for t in by_request(decodes_first).values()] == [5, 5, 2]  # a, c; b from step 4
    assert [rid for rid, _ in decodes_first[2][1]] == ["a", "c", "b"]
    assert [rid for rid, _ in prompt_first[2][1]] == ["b", "c", "a"]
    assert dict(decodes_first[3][1])["b"] is not None  # b's last chunk (step 4) sampled its first token


def test_a_pending_result_leaves_during_the_next_eager_launch(runner: ModelRunner) -> None:
    """With ``post_result`` set, the step before an overlapped eager step is finished between that step's
    layers, once its ids are on the host (here at once), and handed out before ``execute_step`` returns; the
    results are the synchronous ones, each once and in step order. ``early_results`` off
    (``--no-early-results``): none leaves early."""
    steps = [
        DecodeStep(1, new_requests=[NewRequestData("a", list(range(10, 30)), seeded(5), [1, 2], 0, 20, 0)]),
        DecodeStep(
            2,
            new_requests=[NewRequestData("b", list(range(40, 70)), seeded(6), [3, 4], 0, 30, 0)],
            running_requests=[RunningRequestData("a", [], 1)],
        ),
        *[
            DecodeStep(s, running_requests=[RunningRequestData("a", [], 1), RunningRequestData("b", [], 1)])
            for s in range(3, 6)
        ],
    ]
    saved = runner.overlap_steps, runner.pipeline_eager, runner.early_results, runner.post_result
    posted: list[StepResult] = []
    launching: list[int] = []  # the step in execute_step now
    during: list[int] = []  # the step in execute_step when each early result left

    def record(result: StepResult) -> None:
        posted.append(result)
        during.append(launching[-1])

    try:
        runner.overlap_steps, runner.pipeline_eager = False, False
        synchronous = run_steps(runner, steps)
        runner.overlap_steps, runner.pipeline_eager, runner.post_result = True, True, record
        runner.early_results = True
        runner.reset()
        results: list[StepResult] = []
        for step in steps:
            launching.append(step.step_id)
            assert runner.execute_step(step) is None
            results += runner.take_results()
        runner.finish_pending()
        results += runner.take_results()
        early_ids = [r.step_id for r in posted]
        runner.early_results = False
        late = run_steps(runner, steps)
        assert not posted[len(early_ids) :]  # nothing left early with the switch off
    finally:
        runner.overlap_steps, runner.pipeline_eager, runner.early_results, runner.post_result = saved
        runner.reset()
    assert early_ids == [1, 2, 3, 4]  # each during the launch of the step after it
    assert during == [2, 3, 4, 5]
    assert [r.step_id for r in results] == [5]
    combined = [
        (r.step_id, [(o.request_id, o.sampled_token_id) for o in r.outputs]) for r in posted + results
    ]
    assert combined == synchronous == late


def test_a_placeholder_needs_the_pending_ids(runner: ModelRunner) -> None:
    runner.reset()
    saved = runner.overlap_steps, runner.pipeline_eager
    runner.overlap_steps, runner.pipeline_eager = True, True
    try:
        runner.execute_step(
            DecodeStep(1, new_requests=[NewRequestData("a", [5, 6, 7], seeded(1), [1], 0, 3, 0)])
        )
        assert runner._pending is not None  # a's token is a placeholder until the step is finished
        request = runner.requests["a"]
        assert request.output_token_ids[-1] < 0
        rows = runner._apply_step(DecodeStep(2, running_requests=[RunningRequestData("a", [], 1)]))[1]
        active = [row for row in rows if row is not None]
        with pytest.raises(RuntimeError, match="placeholder"):
            runner._prepare_inputs(active)
    finally:
        runner.overlap_steps, runner.pipeline_eager = saved
        runner.reset()


def test_penalty_and_min_tokens_tensors_are_built_from_each_rows_ids(runner: ModelRunner) -> None:
    """The sampler's rows x vocabulary tensors: output counts (repeats counted), the prompt mask, and the ids
    banned before min_tokens (eos and stop ids within the vocabulary, only in rows still under it)."""
    from ominix_worker.runner import CachedRequest, ScheduledRow

    vocab = runner.vocab_size
    eos = runner.config.eos_token_ids[0]
    penalised = SamplingParams(repetition_penalty=1.3, min_tokens=5, stop_token_ids=[7, vocab + 3])
    rows = [
        ScheduledRow(CachedRequest("a", [5, 6, 6], [9, 9, 4], penalised, [[0]], 6, 0), 5, 6, True),
        ScheduledRow(CachedRequest("b", [8], [], SamplingParams(), [[1]], 1, 0), 0, 1, True),
        ScheduledRow(CachedRequest("c", [2, 3], [1] * 6, penalised, [[2]], 8, 0), 7, 8, True),
    ]
    t = runner._sampling_tensors(rows)
    assert t.output_counts is not None and t.prompt_mask is not None and t.banned_mask is not None
    counts = torch.zeros((3, vocab))
    counts[0, 9], counts[0, 4], counts[2, 1] = 2.0, 1.0, 6.0
    assert torch.equal(t.output_counts, counts)
    assert sorted(t.prompt_mask.nonzero().tolist()) == [[0, 5], [0, 6], [1, 8], [2, 2], [2, 3]]
    # Only "a" is still under its 5 min_tokens (3 out); vocab + 3 is past the vocabulary and dropped.
    assert sorted(t.banned_mask.nonzero().tolist()) == sorted([[0, eos], [0, 7]])
    plain = runner._sampling_tensors(rows[1:2])
    assert plain.output_counts is None and plain.prompt_mask is None and plain.banned_mask is None


def greedy_request(request_id: str, prompt: list[int], blocks: list[int]) -> NewRequestData:
    return NewRequestData(request_id, prompt, SamplingParams(temperature=0.0), blocks, 0, len(prompt), 0)


def state_of(runner: ModelRunner, request_id: str) -> tuple[int, list[int], list[list[int]]]:
    """What a step may change in a request's state: computed tokens, output tokens, block tables."""
    request = runner.requests[request_id]
    return (
        request.num_computed_tokens,
        list(request.output_token_ids),
        [list(t) for t in request.block_tables],
    )


def decode(runner: ModelRunner, step_id: int, *request_ids: str) -> dict[str, int | None]:
    """One ordinary decode step of ``request_ids``; each one's sampled token (no errors expected)."""
    step = DecodeStep(step_id, running_requests=[RunningRequestData(rid, [], 1) for rid in request_ids])
    outputs = runner.execute_step(step).outputs
    assert [o.error_kind for o in outputs] == [None] * len(request_ids), outputs
    return {o.request_id: o.sampled_token_id for o in outputs}


def test_a_request_named_twice_in_a_step_is_refused_and_left_as_it_was(runner: ModelRunner) -> None:
    """A running request listed twice in one step gets one INVALID_ARGUMENT output and no row (it is neither
    computed nor sampled, its block diffs are not applied); its state stays, a well-formed neighbour runs, and
    the request then decodes the tokens it would have without that step."""
    prompt = list(range(20, 29))
    expected = generate(runner, [greedy_request("x", prompt, [0])], 3)["x"]

    runner.reset()
    runner.execute_step(
        DecodeStep(1, new_requests=[greedy_request("x", prompt, [0]), greedy_request("y", [7, 8], [2])])
    )
    before = state_of(runner, "x")
    live = runner.requests["x"]
    twice = [RunningRequestData("x", [1], 1), RunningRequestData("x", [], 1), RunningRequestData("y", [], 1)]
    result = runner.execute_step(DecodeStep(2, running_requests=twice))

    assert [o.request_id for o in result.outputs] == ["x", "y"]  # one output per request id
    refused, neighbour = result.outputs
    assert refused.error_kind == RuntimeErrorKind.INVALID_ARGUMENT and refused.sampled_token_id is None
    assert "named twice" in (refused.error_message or "")
    assert neighbour.error_kind is None and neighbour.sampled_token_id is not None
    assert result.num_tokens == 1  # y's row alone
    assert runner.requests["x"] is live and state_of(runner, "x") == before
    assert [decode(runner, 3, "x")["x"], decode(runner, 4, "x")["x"]] == expected[1:]


@pytest.mark.parametrize(
    "sampling", [SamplingParams(temperature=0.0), SamplingParams(top_p=0.0)], ids=["valid", "invalid"]
)
def test_a_new_request_reusing_a_live_id_is_refused_and_the_live_one_kept(
    runner: ModelRunner, sampling: SamplingParams
) -> None:
    """A new request whose id the worker still holds (not finished by the same step) is refused with
    INVALID_ARGUMENT whether or not it is valid itself; the live request's state is neither replaced nor
    dropped, and it goes on decoding as if that step had not come."""
    prompt = list(range(30, 41))
    expected = generate(runner, [greedy_request("x", prompt, [0])], 3)["x"]

    runner.reset()
    runner.execute_step(DecodeStep(1, new_requests=[greedy_request("x", prompt, [0])]))
    before = state_of(runner, "x")
    live = runner.requests["x"]
    reuse = NewRequestData("x", [9, 9, 9], sampling, [1], 0, 3, 0)
    result = runner.execute_step(DecodeStep(2, new_requests=[reuse]))

    assert len(result.outputs) == 1
    refused = result.outputs[0]
    assert refused.request_id == "x" and refused.error_kind == RuntimeErrorKind.INVALID_ARGUMENT
    assert "already in use" in (refused.error_message or "")
    assert result.num_tokens == 0
    assert runner.requests["x"] is live and state_of(runner, "x") == before
    assert [decode(runner, 3, "x")["x"], decode(runner, 4, "x")["x"]] == expected[1:]


def test_a_new_request_named_twice_adds_no_state(runner: ModelRunner) -> None:
    """Two new requests with one id in a step: one INVALID_ARGUMENT output, and the worker holds nothing
    under that id afterwards."""
    runner.reset()
    result = runner.execute_step(
        DecodeStep(1, new_requests=[greedy_request("z", [4, 5], [0]), greedy_request("z", [6, 7], [1])])
    )
    assert [(o.request_id, o.error_kind) for o in result.outputs] == [
        ("z", RuntimeErrorKind.INVALID_ARGUMENT)
    ]
    assert "z" not in runner.requests and result.num_tokens == 0


def test_an_id_finished_in_the_same_step_may_be_reused(runner: ModelRunner) -> None:
    """A step that finishes a request and starts a new one under its id (a preempted request resent whole)
    runs the new one: finished ids are dropped before new requests are checked."""
    prompt = list(range(50, 58))
    expected = generate(runner, [greedy_request("x", prompt, [1])], 1)["x"]

    runner.reset()
    runner.execute_step(DecodeStep(1, new_requests=[greedy_request("x", [3, 4, 5], [0])]))
    old = runner.requests["x"]
    result = runner.execute_step(
        DecodeStep(2, new_requests=[greedy_request("x", prompt, [1])], finished_request_ids=["x"])
    )
    assert [(o.request_id, o.error_kind) for o in result.outputs] == [("x", None)]
    assert result.outputs[0].sampled_token_id == expected[0]
    assert runner.requests["x"] is not old and runner.requests["x"].prompt_token_ids == prompt


@pytest.mark.parametrize("temperature", [1e-44, 1e-38, 9e-6])
def test_a_temperature_below_the_greedy_threshold_samples_the_greedy_tokens(
    runner: ModelRunner, temperature: float
) -> None:
    """A valid temperature below ``GREEDY_TEMPERATURE`` draws the greedy tokens, alone (the all-greedy path) and
    beside a sampled request (the sampler's per-row choice), rather than overflowing ``logits / temperature``."""
    prompt = list(range(20, 36))
    expected = generate(runner, [greedy_request("g", prompt, [0, 1])], 4)["g"]
    tiny = SamplingParams(temperature=temperature, seed=1).validate(vocab_size=runner.vocab_size)
    assert tiny.is_greedy
    alone = generate(runner, [NewRequestData("t", prompt, tiny, [0, 1], 0, len(prompt), 0)], 4)["t"]
    beside = generate(
        runner,
        [
            NewRequestData("t", prompt, tiny, [0, 1], 0, len(prompt), 0),
            NewRequestData("s", list(range(40, 50)), seeded(3), [2], 0, 10, 0),
        ],
        4,
    )["t"]
    assert alone == expected and beside == expected
