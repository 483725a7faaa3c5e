"""Wire values this engine does not know: proto3 enums are open, so a newer worker may send one, and the load
report carries figures from backends; neither may escape as a bare ValueError from the conversions."""

from __future__ import annotations

import pytest

from ominix_runtime import wire
from ominix_runtime.contract import (
    AttentionKind,
    OminixError,
    RuntimeErrorKind,
)
from ominix_runtime.contract.capability import CUDA_PROFILE
from ominix_runtime.engine.stats import LoadSnapshot
from ominix_runtime.pb import common_pb2, worker_pb2

UNKNOWN = 99  # a value no enum of this engine has


def test_an_unknown_worker_error_code_is_internal_and_keeps_the_workers_message() -> None:
    """A per-request error with an unknown code becomes INTERNAL with the worker's message and the code;
    known codes and an unset code read as before."""
    pb = worker_pb2.StepResult(step_id=1)
    pb.outputs.add(request_id="plain", sampled_token_id=7)
    unknown = pb.outputs.add(request_id="unknown")
    unknown.error.code = UNKNOWN  # type: ignore[assignment]
    unknown.error.message = "a failure with a new name"
    known = pb.outputs.add(request_id="known")
    known.error.code = common_pb2.ERROR_CODE_TIMEOUT
    known.error.message = "too slow"
    unset = pb.outputs.add(request_id="unset")
    unset.error.message = "no code"

    plain, unknown_out, known_out, unset_out = wire.step_result_from_pb(pb).outputs
    assert plain.sampled_token_id == 7 and plain.error_kind is None
    assert unknown_out.error_kind == RuntimeErrorKind.INTERNAL
    assert "a failure with a new name" in unknown_out.error_message
    assert str(UNKNOWN) in unknown_out.error_message
    assert (known_out.error_kind, known_out.error_message) == (RuntimeErrorKind.TIMEOUT, "too slow")
    assert (unset_out.error_kind, unset_out.error_message) == (None, "no code")


def _with_kv_group_kind(pb: common_pb2.BackendCapability, value: int) -> None:
    pb.kv_groups.add(kind=value, layer_indices=[0], block_size=16, num_blocks=8)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "set_unknown"),
    [
        ("kind", lambda pb: setattr(pb, "kind", UNKNOWN)),
        ("kv_groups.kind", lambda pb: _with_kv_group_kind(pb, UNKNOWN)),
        ("granularity", lambda pb: setattr(pb, "granularity", UNKNOWN)),
    ],
)
def test_an_unknown_capability_value_is_a_capability_mismatch_naming_it(field: str, set_unknown) -> None:  # noqa: ANN001
    """Describe's answer with an enum value this engine does not know raises CAPABILITY_MISMATCH naming the
    field, the value and the worker (not a ValueError the engine cannot place)."""
    pb = wire.capability_to_pb(CUDA_PROFILE)
    pb.worker_id = "w-new"
    set_unknown(pb)
    with pytest.raises(OminixError) as info:
        wire.capability_from_pb(pb)
    assert info.value.kind == RuntimeErrorKind.CAPABILITY_MISMATCH
    assert f"{field} = {UNKNOWN}" in info.value.message and "w-new" in info.value.message


def test_known_kv_group_kinds_still_read() -> None:
    """The checked conversion leaves known values (and an unset kind, read as FULL) as they were."""
    pb = wire.capability_to_pb(CUDA_PROFILE)
    pb.kv_groups.add(kind=common_pb2.ATTENTION_KIND_SLIDING_WINDOW, layer_indices=[1], sliding_window=4)
    pb.kv_groups.add(layer_indices=[0])
    kinds = [g.kind for g in wire.capability_from_pb(pb).kv_groups]
    assert kinds == [AttentionKind.SLIDING_WINDOW, AttentionKind.FULL]


def test_backend_load_to_pb_clamps_counts_to_their_fields() -> None:
    """Negative figures read as 0 and figures past an unsigned field's range as its maximum, so one backend's
    odd report cannot fail GetLoad; the total is clamped the same way."""
    odd = LoadSnapshot(
        worker_id="odd",
        queued_requests=-1,
        running_requests=1 << 40,
        waiting_tokens=-5,
        kv_bytes_used=-128,
        kv_bytes_capacity=1 << 70,
        estimated_decode_tokens_per_second=0.0,
        healthy=True,
        timestamp_ms=-1,
    )
    pb = wire.backend_load_to_pb(odd)
    assert (pb.queued_requests, pb.waiting_tokens, pb.kv_bytes_used, pb.timestamp_ms) == (0, 0, 0, 0)
    assert pb.running_requests == (1 << 32) - 1
    assert pb.kv_bytes_capacity == (1 << 64) - 1
    total = wire.total_load_to_pb([pb, pb], timestamp_ms=1)
    assert total.running_requests == (1 << 32) - 1 and total.kv_bytes_capacity == (1 << 64) - 1
