"""negotiate / check_group: every mismatch is CAPABILITY_MISMATCH with a message naming the field."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from ominix_runtime.contract import (
    ASCEND_PROFILE,
    CPU_PROFILE,
    SGLANG_PROFILE,
    BackendCapability,
    ModelInfo,
    OminixError,
    RuntimeErrorKind,
)
from ominix_runtime.engine.negotiation import ServingTerms, check_group, negotiate

MODEL = ModelInfo(name="tiny", vocab_size=1000, max_model_len=4096, eos_token_ids=(2,))


def worker(i: int, **overrides: object) -> BackendCapability:
    base = replace(CPU_PROFILE, worker_id=f"cpu-{i}", model=MODEL, kv_num_blocks=64, kv_bytes_per_block=4096)
    return replace(base, **overrides)


def mismatch(capabilities: list[BackendCapability], **kwargs: Any) -> str:
    with pytest.raises(OminixError) as info:
        check_group(capabilities, **{"model_name": "tiny", **kwargs})
    assert info.value.kind == RuntimeErrorKind.CAPABILITY_MISMATCH
    return info.value.message


def test_a_consistent_group_passes() -> None:
    check_group([worker(0), worker(1)], "tiny", 4096, "float32")
    check_group([worker(0)], "tiny", None, None)


def test_block_size_mismatch() -> None:
    message = mismatch([worker(0), worker(1, kv_block_size=32)])
    assert "kv_block_size" in message and "cpu-1" in message


def test_model_mismatch() -> None:
    assert "model" in mismatch([worker(0)], model_name="other")
    other = worker(1, model=replace(MODEL, name="other"))
    message = mismatch([worker(0), other], model_name="")
    assert "model" in message and "other" in message


def test_max_model_len_too_small() -> None:
    message = mismatch([worker(0)], required_max_model_len=8192)
    assert "max_model_len" in message and "4096" in message and "8192" in message


def test_dtype_mismatch() -> None:
    assert "dtype" in mismatch([worker(0)], dtype="bfloat16")
    assert "dtype" in mismatch([worker(0, dtype="bfloat16")], dtype="float32")


def test_problems_are_reported() -> None:
    message = mismatch([worker(0, kv_num_blocks=0)])
    assert "kv_num_blocks" in message and "cpu-0" in message
    ascend = replace(
        ASCEND_PROFILE,
        worker_id="npu-0",
        model=MODEL,
        kv_num_blocks=8,
        kv_bytes_per_block=1,
        kv_block_size=16,
    )
    assert "block size 128" in mismatch([ascend], dtype="bfloat16")


def test_granularity_and_vocab_mismatch() -> None:
    assert "vocab_size" in mismatch([worker(0), worker(1, model=replace(MODEL, vocab_size=999))])
    sglang = replace(SGLANG_PROFILE, worker_id="sglang@x", device="cuda", model=MODEL, kv_block_size=16)
    assert "granularity" in mismatch([worker(0), sglang])


def test_request_level_backend_need_not_state_tokenizer_facts() -> None:
    unstated = ModelInfo(name="tiny", vocab_size=0, max_model_len=4096, eos_token_ids=())
    sglang = replace(SGLANG_PROFILE, worker_id="sglang@x", device="cuda", model=unstated, dtype="auto")
    check_group([sglang], "tiny", 4096, "bfloat16")  # "auto" dtype: the server decides
    # A step-level worker with the same gaps is refused.
    message = mismatch([worker(0, model=unstated)])
    assert "vocab_size" in message and "eos_token_ids" in message


def test_empty_group() -> None:
    assert "no backends" in mismatch([])


def refused(capabilities: list[BackendCapability], terms: ServingTerms | None = None) -> str:
    with pytest.raises(OminixError) as info:
        negotiate(capabilities, terms)
    assert info.value.kind == RuntimeErrorKind.CAPABILITY_MISMATCH
    return info.value.message


def test_negotiate_accepts_agreeing_backends_on_their_terms() -> None:
    unstated = ModelInfo(name="big", vocab_size=0, max_model_len=8192, eos_token_ids=())
    sglang = replace(SGLANG_PROFILE, worker_id="sglang@x", device="cuda", model=unstated)
    negotiate([worker(0), worker(1), sglang], ServingTerms("tiny", tokenizer_vocab_size=1000))
    negotiate([worker(0), worker(1, model=replace(MODEL, name="other"))])  # no terms: one group per model


def test_negotiate_refuses() -> None:
    assert "same worker_id" in refused([worker(0), worker(0)])
    assert "model mismatch" in refused(
        [worker(0), worker(1, model=replace(MODEL, name="other"))], ServingTerms("tiny")
    )
    assert "model mismatch" in refused([worker(0)], ServingTerms("other"))
    message = refused([worker(0)], ServingTerms("tiny", tokenizer_vocab_size=1001))
    assert "vocabulary" in message and "1001" in message and "cpu-0" in message
    # Workers of one model must agree on what a resumed request sees.
    assert "eos_token_ids" in refused([worker(0), worker(1, model=replace(MODEL, eos_token_ids=(3,)))])
    assert "max_model_len" in refused([worker(0), worker(1, model=replace(MODEL, max_model_len=2048))])
    # Request-level backends of one model are a group too.
    sglang = replace(SGLANG_PROFILE, worker_id="sglang@x", device="cuda", model=MODEL, kv_block_size=16)
    assert "kv_block_size" in refused([sglang, replace(sglang, worker_id="sglang@y", kv_block_size=1)])
