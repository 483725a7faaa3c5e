"""Tensor parallelism on the CPU: shard arithmetic, and TP=2 logits (two gloo rank processes) against TP=1."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from ominix_runtime.config import RuntimeConfig
from ominix_worker.parallel import ShardRange, TensorParallel
from ominix_worker.testing import write_tiny_hf_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from refused_ranks import refusal_lines  # noqa: E402
from tp_logits import batch_logits, load_runner  # noqa: E402

TP_LOGITS = Path(__file__).resolve().parent / "tp_logits.py"
RANK_TIMEOUT_S = 120


def run_group(
    model: Path,
    size: int,
    out: Path,
    device: str = "cpu",
    dtype: str = "float32",
    check: str = "logits",
    moe_parallel: str = "tensor",
) -> Any:
    """Start ``size`` rank processes of tp_logits.py (``check``: logits or graphs; ``moe_parallel``: how MoE
    layers split) and return rank 0's result."""
    from ominix_runtime.bind_probe import free_port

    addr = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in range(size):
        rank_device = device if device == "cpu" else f"cuda:{rank}"
        argv = [
            sys.executable,
            str(TP_LOGITS),
            "--model",
            str(model),
            "--rank",
            str(rank),
            "--size",
            str(size),
        ]
        argv += [
            "--addr",
            addr,
            "--device",
            rank_device,
            "--dtype",
            dtype,
            "--out",
            str(out),
            "--check",
            check,
            "--moe-parallel",
            moe_parallel,
        ]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        outputs = [p.communicate(timeout=RANK_TIMEOUT_S)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{text[-3000:]}"
    return torch.load(out)


# ---- shard arithmetic ------------------------------------------------------------------------------


class _Group:  # stands in for a process group: the arithmetic never touches it
    pass


def tp(rank: int, size: int) -> TensorParallel:
    return TensorParallel(rank, size, _Group())  # type: ignore[arg-type]  # a stand-in process group


def test_even_splits_and_padded_vocabulary() -> None:
    assert [tp(r, 4).split(64) for r in range(4)] == [ShardRange(16 * r, 16) for r in range(4)]
    with pytest.raises(ValueError, match="does not divide into 3"):
        tp(0, 3).split(64)
    # 321 rows over 2 ranks: 161 each, the last rank's final row is padding
    assert [tp(r, 2).padded_split(321) for r in range(2)] == [ShardRange(0, 161), ShardRange(161, 161)]


def test_kv_heads_split_or_replicate_so_every_query_head_meets_its_kv_head() -> None:
    num_heads = 8
    for num_kv_heads, size in ((8, 2), (2, 2), (2, 4), (1, 4), (2, 8)):
        group_size = num_heads // num_kv_heads
        for rank in range(size):
            heads = tp(rank, size).split(num_heads)
            kv = tp(rank, size).kv_heads(num_kv_heads, num_heads)
            needed = {h // group_size for h in range(heads.start, heads.end)}
            assert needed == set(range(kv.start, kv.end)), (num_kv_heads, size, rank)
    with pytest.raises(ValueError, match="cannot be replicated evenly"):
        tp(0, 4).kv_heads(3, 12)
    with pytest.raises(ValueError, match="attention heads"):
        tp(0, 3).kv_heads(1, 4)


def test_a_model_that_does_not_divide_is_refused_with_its_reason(tmp_path: Path) -> None:
    from ominix_runtime.models import resolve_model
    from ominix_worker.attention import get_attention_backend
    from ominix_worker.loader import ModelLoadError, load_model

    folder = write_tiny_hf_model(tmp_path / "m", heads=4, kv_heads=2, with_tokenizer=False)
    backend = get_attention_backend("cpu", 16)
    with pytest.raises(ModelLoadError, match="does not divide into 3"):
        load_model(resolve_model(str(folder)), torch.device("cpu"), torch.float32, backend, tp=tp(0, 3))


# ---- TP=2 against TP=1 --------------------------------------------------------------------------------

CASES = {
    # odd vocabulary (a padded row on rank 1), KV heads split 1 + 1
    "llama-odd-vocab": dict(arch="llama", vocab_size=321),
    # one KV head replicated on both ranks, tied embeddings, QKV bias
    "qwen2-kv-replicated-tied": dict(arch="qwen2", vocab_size=320, kv_heads=1, tie_word_embeddings=True),
    # per-head q/k norms
    "qwen3": dict(arch="qwen3", vocab_size=322),
    # Gemma 3: its own layer structure, an 8-token window on two of three layers (a KV group each kind)
    "gemma3": dict(
        arch="gemma3_text",
        vocab_size=320,
        num_layers=3,
        sliding_window=8,
        sliding_window_pattern=3,
        tie_word_embeddings=True,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_logits_equal_tp1(case: str, tmp_path: Path) -> None:
    folder = write_tiny_hf_model(tmp_path / case, with_tokenizer=False, **CASES[case])
    reference = batch_logits(load_runner(str(folder), "cpu", torch.float32))
    sharded = run_group(folder, 2, tmp_path / "logits.pt")
    assert sharded.shape == reference.shape == (len(reference), CASES[case]["vocab_size"])
    torch.testing.assert_close(sharded, reference, atol=2e-5, rtol=1e-5)
    assert torch.equal(sharded.argmax(-1), reference.argmax(-1))


def test_each_rank_reads_only_its_slices(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 of 2 asks the safetensors files for half of every sharded tensor, never a whole one."""
    from safetensors import safe_open

    import ominix_worker.parallel.weights as weights

    read_elements: dict[str, int] = {}
    original = weights.SafetensorsWeight.read

    def counting_read(
        self: weights.SafetensorsWeight, dim: int = 0, start: int = 0, length: int | None = None
    ):  # noqa: ANN202
        out = original(self, dim, start, length)
        read_elements[self.name] = read_elements.get(self.name, 0) + out.numel()
        return out

    monkeypatch.setattr(weights.SafetensorsWeight, "read", counting_read)
    folder = tiny_model_dir("llama")
    load_runner(str(folder), "cpu", torch.float32, tp(1, 2))
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        full = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118
    for name, shape in full.items():
        numel = int(torch.tensor(shape).prod())
        if "norm" in name:
            assert read_elements[name] == numel, name  # replicated
        else:
            assert read_elements[name] == numel // 2, name  # its half of q/k/v, gate/up, o/down, vocab


def test_steps_reach_the_followers_unchanged() -> None:
    from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData, SamplingParams
    from ominix_worker.rank_group import decode_step, encode_step

    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=11, logprobs=2, stop_token_ids=[4])
    step = DecodeStep(
        42,
        new_requests=[
            NewRequestData("a", [1, 2, 3], sampling, [7, 8], 16, 3, 99, [5, 6], "00-trace-span-01"),
            NewRequestData("b", [9], SamplingParams(), [1], 0, 1, 0),
        ],
        running_requests=[RunningRequestData("c", [3], 1), RunningRequestData("d", [], 4)],
        finished_request_ids=["e", "f"],
    )
    assert decode_step(encode_step(step)) == step
    assert decode_step(encode_step(DecodeStep(1))) == DecodeStep(1)


# ---- joining a group ----------------------------------------------------------------------------------


def _with_worker(**changes: Any) -> RuntimeConfig:
    """The default settings with some worker flags changed (what one rank was started with)."""
    base = RuntimeConfig()
    return replace(base, worker=replace(base.worker, **changes))


@pytest.mark.parametrize(
    ("field", "value", "flag", "default"),
    [
        ("quantization", "fp8", "--quantization", "none"),
        ("kv_cache_dtype", "fp8_e4m3", "--kv-cache-dtype", "auto"),
        ("dtype", "bfloat16", "--dtype", "auto"),  # a shape-deciding flag: the same check
    ],
)
def test_a_rank_started_with_another_setting_is_refused_naming_it_and_both_values(
    field: str, value: str, flag: str, default: str
) -> None:
    from ominix_worker.server import group_settings, settings_disagreement

    leader, follower = group_settings(_with_worker()), group_settings(_with_worker(**{field: value}))
    assert settings_disagreement([leader, leader]) is None
    message = settings_disagreement([leader, follower])
    assert message is not None
    assert f"{flag} is {value!r} on rank 1 but {default!r} on rank 0" in message, message
    assert message.count(" on rank 1 ") == 1, message  # only the setting that differs


def test_the_group_settings_are_named_as_their_flags() -> None:
    """Every compared setting is stated under the flag that sets it (the refusal names what to change)."""
    from ominix_runtime.cli.flags import by_name
    from ominix_worker.server import group_settings

    for name in group_settings(_with_worker()):
        by_name(name)


def test_a_group_whose_ranks_quantize_differently_exits_at_startup_naming_the_flags(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    """Two real worker ranks, rank 1 with FP8 weights and KV: both refuse before loading, in one clear line."""
    extra = {1: ["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"]}
    for line in refusal_lines(tiny_model_dir("llama"), extra, before_loading=True):
        assert "--quantization is 'fp8' on rank 1 but 'none' on rank 0" in line
        assert "--kv-cache-dtype is 'fp8_e4m3' on rank 1 but 'auto' on rank 0" in line
