from __future__ import annotations

import math
from dataclasses import replace

import pytest

from ominix_runtime import wire
from ominix_runtime.contract import (
    ASCEND_PROFILE,
    PROFILES,
    BackendKind,
    DecodeStep,
    InvalidArgument,
    ModelInfo,
    NewRequestData,
    RequestOutput,
    RunningRequestData,
    RuntimeErrorKind,
    SampledLogprobs,
    SamplingParams,
    StepResult,
    TokenLogprob,
    stated_profile,
)
from ominix_runtime.contract.sampling import GREEDY_TEMPERATURE

MODEL = ModelInfo(name="m", vocab_size=1000, max_model_len=2048, eos_token_ids=(2,))


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("temperature", -0.1, "temperature"),
        ("temperature", math.nan, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -5, "top_k"),
        ("min_p", 2.0, "min_p"),
        ("max_tokens", 0, "max_tokens"),
        ("max_tokens", 10**9, "context length"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("frequency_penalty", 3.0, "frequency_penalty"),
        ("presence_penalty", math.inf, "presence_penalty"),
        ("logprobs", 21, "logprobs"),
        ("stop", [""], "stop strings"),
        ("stop_token_ids", [1000], "stop_token_ids"),
        ("stop_token_ids", [5] * 1025, "at most 1024 stop_token_ids"),  # each is looked up every step
        ("min_tokens", 99, "min_tokens"),
    ],
)
def test_out_of_range_sampling_is_rejected_with_the_field_name(
    field: str, value: object, needle: str
) -> None:
    params = replace(SamplingParams(max_tokens=16), **{field: value})
    with pytest.raises(InvalidArgument) as info:
        params.validate(vocab_size=1000, max_model_len=2048)
    assert needle in str(info.value)
    assert info.value.kind == RuntimeErrorKind.INVALID_ARGUMENT


def test_a_thousand_stop_token_ids_are_accepted() -> None:
    SamplingParams(max_tokens=16, stop_token_ids=list(range(1024))).validate(
        vocab_size=2000, max_model_len=2048
    )


def test_valid_sampling_normalises_top_k() -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, top_k=0).validate(
        vocab_size=1000, max_model_len=2048
    )
    assert params.top_k == -1
    assert params.is_greedy


@pytest.mark.parametrize(
    ("temperature", "greedy"),
    [
        (0.0, True),
        (1e-44, True),
        (1e-38, True),
        (GREEDY_TEMPERATURE / 2, True),
        (GREEDY_TEMPERATURE, False),
        (0.7, False),
    ],
)
def test_temperatures_below_the_threshold_are_greedy(temperature: float, greedy: bool) -> None:
    """Every valid temperature below ``GREEDY_TEMPERATURE`` counts as greedy (what the worker samples as the first
    maximum), not only 0; from the threshold on, a request samples."""
    params = SamplingParams(temperature=temperature).validate(vocab_size=1000)
    assert params.is_greedy is greedy


def test_stated_profiles_are_self_consistent_once_filled_in() -> None:
    for kind, profile in PROFILES.items():
        filled = replace(
            profile,
            worker_id=f"{kind.name.lower()}-0",
            device=profile.device or "http://x",
            model=MODEL,
            kv_num_blocks=profile.kv_num_blocks or 64,
            kv_bytes_per_block=profile.kv_bytes_per_block or 4096,
        )
        assert filled.problems() == [], (kind, filled.problems())


def test_ascend_profile_states_block_128_hccl_and_no_custom_allreduce() -> None:
    assert ASCEND_PROFILE.kv_block_size == 128
    assert ASCEND_PROFILE.collective_backend == "hccl"
    assert not ASCEND_PROFILE.custom_all_reduce
    assert set(ASCEND_PROFILE.supported_dtypes) == {"float16", "bfloat16"}
    bad = replace(
        ASCEND_PROFILE, worker_id="npu", model=MODEL, kv_num_blocks=4, kv_bytes_per_block=1, kv_block_size=16
    )
    assert any("128" in p for p in bad.problems())


def test_capability_problems_name_missing_fields() -> None:
    cap = stated_profile(BackendKind.CPU, worker_id="", model=replace(MODEL, eos_token_ids=()))
    problems = " ".join(cap.problems())
    for needle in ("worker_id", "eos_token_ids", "kv_num_blocks"):
        assert needle in problems


def test_wire_round_trips() -> None:
    step = DecodeStep(
        step_id=7,
        new_requests=[
            NewRequestData(
                "a", [1, 2, 3], SamplingParams(seed=5, logprobs=2, stop=["x"]), [4, 9], 0, 3, 11, [7]
            ),
            NewRequestData("w", [1] * 16, SamplingParams(), [4], 15, 1, 3, num_cached_kv_tokens=16),
        ],
        running_requests=[RunningRequestData("b", [12], 1)],
        finished_request_ids=["c"],
    )
    assert wire.step_from_pb(wire.step_to_pb(step)) == step
    result = StepResult(
        7,
        [
            RequestOutput("a", 5, SampledLogprobs(TokenLogprob(5, -0.25), [TokenLogprob(5, -0.25)])),
            RequestOutput("b", None, None, RuntimeErrorKind.INTERNAL, "nan logits"),
        ],
        0.5,
        4,
    )
    assert wire.step_result_from_pb(wire.step_result_to_pb(result)) == result
    cap = stated_profile(
        BackendKind.CUDA, worker_id="w", model=MODEL, kv_num_blocks=10, kv_bytes_per_block=64
    )
    assert wire.capability_from_pb(wire.capability_to_pb(cap)) == cap
    whole = replace(cap, supports_whole_prompt_hits=True)
    assert wire.capability_from_pb(wire.capability_to_pb(whole)) == whole
    assert wire.sampling_from_pb(wire.sampling_to_pb(SamplingParams(temperature=0.0))).temperature == 0.0


def test_request_level_backend_may_leave_tokenizer_facts_unstated() -> None:
    unknown = ModelInfo(name="m", vocab_size=0, max_model_len=4096, eos_token_ids=())
    sglang = replace(
        PROFILES[BackendKind.SGLANG],
        worker_id="sglang@http://h:30000",
        device="http://h:30000",
        model=unknown,
    )
    assert sglang.problems() == []
    step = stated_profile(
        BackendKind.CPU, worker_id="w", model=unknown, kv_num_blocks=4, kv_bytes_per_block=8
    )
    assert {"model.vocab_size must be > 0", "model.eos_token_ids is empty"} <= set(step.problems())


def test_kv_bytes_follow_the_stated_kv_dtype_and_fp8_kv_needs_support() -> None:
    """A worker states its weight and KV dtypes; KV blocks must hold the model's K and V in the KV dtype."""
    model = replace(MODEL, num_layers=4, num_kv_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2)
    bf16_block = 2 * 4 * 16 * 2 * 64 * 2
    cap = stated_profile(
        BackendKind.CUDA, worker_id="w", model=model, kv_num_blocks=10, kv_bytes_per_block=bf16_block // 2,
        weight_dtype="float8_e4m3fn", kv_cache_dtype="fp8_e4m3", supports_fp8_kv=True,
    )  # fmt: skip
    assert cap.problems() == [] and cap.kv_bytes_per_block_for_model() == bf16_block // 2
    assert wire.capability_from_pb(wire.capability_to_pb(cap)) == cap
    too_small = replace(cap, kv_cache_dtype="")  # bf16 KV in half the bytes it needs
    assert any("kv_bytes_per_block" in p for p in too_small.problems())
    unsupported = replace(cap, supports_fp8_kv=False)
    assert any("supports_fp8_kv" in p for p in unsupported.problems())


def test_moe_parallel_is_stated_for_experts_that_divide_and_round_trips() -> None:
    model = replace(MODEL, num_layers=4, num_kv_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2)
    base = stated_profile(
        BackendKind.CUDA, worker_id="w", model=model, kv_num_blocks=10, kv_bytes_per_block=2 * 4 * 16 * 2 * 64 * 2,
        tensor_parallel_size=2, collective_backend="nccl",
    )  # fmt: skip
    for mode in ("tensor", "expert"):
        cap = replace(base, moe_parallel=mode)
        assert cap.problems() == []
        assert wire.capability_from_pb(wire.capability_to_pb(cap)) == cap
    assert any("not one of" in p for p in replace(base, moe_parallel="pipeline").problems())
    assert any(
        "do not divide" in p for p in replace(base, moe_parallel="expert", tensor_parallel_size=3).problems()
    )
    dense = replace(base, model=replace(model, num_experts=0, num_experts_per_tok=0), moe_parallel="tensor")
    assert any("without experts" in p for p in dense.problems())
