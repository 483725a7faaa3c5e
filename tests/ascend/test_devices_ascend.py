"""Ascend device helpers that need no NPU: device parsing, visible devices, dtype rules, capability."""

from __future__ import annotations

import sys

import pytest

from ominix_runtime.contract import BackendKind, ModelInfo
from ominix_worker.devices_ascend import (
    COLLECTIVE_BACKEND,
    AscendDeviceError,
    ascend_capability,
    ascend_dtype_name,
    is_npu_device,
    kv_bytes_per_block,
    npu_available,
    parse_npu_index,
    setup_npu_device,
    visible_npu_ids,
)

MODEL = ModelInfo(name="tiny", vocab_size=1000, max_model_len=4096, eos_token_ids=(2,))


def test_device_parsing() -> None:
    assert is_npu_device("npu:1") and is_npu_device("NPU") and not is_npu_device("cuda:0")
    assert parse_npu_index("npu") == 0 and parse_npu_index("npu:7") == 7
    for bad in ("cuda:0", "npu:x"):
        with pytest.raises(AscendDeviceError):
            parse_npu_index(bad)


def test_visible_devices_env() -> None:
    assert visible_npu_ids({}) is None
    assert visible_npu_ids({"ASCEND_RT_VISIBLE_DEVICES": "4, 5,6"}) == ["4", "5", "6"]


def test_only_half_precision_dtypes() -> None:
    assert ascend_dtype_name("bf16") == "bfloat16" and ascend_dtype_name("float16") == "float16"
    with pytest.raises(AscendDeviceError, match="float16 or bfloat16"):
        ascend_dtype_name("float32")


def test_capability_comes_from_the_ascend_profile() -> None:
    per_block = kv_bytes_per_block(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    assert per_block == 2 * 2 * 128 * 2 * 64 * 2
    cap = ascend_capability(
        worker_id="npu-0",
        device="npu:0",
        dtype="bf16",
        model=MODEL,
        kv_num_blocks=64,
        kv_bytes_per_block=per_block,
    )
    assert cap.kind == BackendKind.ASCEND and cap.kv_block_size == 128 and cap.dtype == "bfloat16"
    assert cap.collective_backend == COLLECTIVE_BACKEND == "hccl" and not cap.custom_all_reduce
    assert cap.problems() == []


def test_setup_without_torch_npu_fails_clearly() -> None:
    if "torch_npu" in sys.modules:
        pytest.skip("torch_npu is present in this process")
    assert not npu_available()
    with pytest.raises(AscendDeviceError, match="torch_npu"):
        setup_npu_device("npu:0", "bfloat16")
    with pytest.raises(AscendDeviceError, match="float16 or bfloat16"):
        setup_npu_device("npu:0", "float32")  # the dtype is refused before touching the device
    assert "torch_npu" not in sys.modules
