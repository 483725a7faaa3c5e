"""FP8 (e4m3) KV cache on the CPU reference path: attention error against a float KV cache, logits against
transformers, and KV block sizing (bytes per block follow the KV dtype; the capability states it).

Bounds (relative Frobenius error): attention output 6% against float KV (4.0% measured on these random K/V:
e4m3 rounds each element with 2.6% rms relative error); model logits 10% against transformers on a float
cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData, SamplingParams
from ominix_worker.attention.base import AttentionMetadata
from ominix_worker.attention.torch_ref import TorchReferenceAttention
from ominix_worker.config import load_hf_config
from ominix_worker.kv_cache import kv_bytes_per_block, resolve_kv_cache_dtype
from ominix_worker.runner import build_runner

ATTENTION_BOUND = 0.06
LOGITS_BOUND = 0.10


def _attention(kv_dtype: torch.dtype, q_lens: list[int], seq_lens: list[int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 8, 2, 64
    backend = TorchReferenceAttention(16)
    blocks = [-(-s // 16) for s in seq_lens]
    perm = torch.randperm(sum(blocks) + 3, generator=gen).tolist()
    cache = backend.allocate_kv_cache(1, len(perm), kv_heads, dim, kv_dtype, torch.device("cpu"))[0]
    table = torch.zeros((len(seq_lens), max(blocks)), dtype=torch.int32)
    slots, queries, keys, values = [], [], [], []
    cursor = 0
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        ids = perm[cursor : cursor + blocks[i]]
        cursor += blocks[i]
        table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(seq_len)
        slots.append(torch.tensor(ids)[pos // 16] * 16 + pos % 16)
        keys.append(torch.randn((seq_len, kv_heads, dim), generator=gen) * 2.0)
        values.append(torch.randn((seq_len, kv_heads, dim), generator=gen))
        queries.append(torch.randn((q_len, heads, dim), generator=gen))
    qsl = [0]
    for q_len in q_lens:
        qsl.append(qsl[-1] + q_len)

    def meta(slot_mapping: torch.Tensor) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=table,
            slot_mapping=slot_mapping,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            num_decode_only=all(q == 1 for q in q_lens),
        )

    backend.write_kv(cache, torch.cat(keys), torch.cat(values), meta(torch.cat(slots)))
    step = meta(torch.cat([s[len(s) - q :] for s, q in zip(slots, q_lens, strict=True)]))
    return backend.forward(torch.cat(queries), cache, step, dim**-0.5)


@pytest.mark.parametrize(("q_lens", "seq_lens"), [([1, 1, 1], [40, 7, 130]), ([12, 1, 30], [60, 33, 30])])
def test_fp8_kv_attention_error_is_bounded(q_lens: list[int], seq_lens: list[int]) -> None:
    fp8 = _attention(torch.float8_e4m3fn, q_lens, seq_lens, sum(seq_lens))
    full = _attention(torch.float32, q_lens, seq_lens, sum(seq_lens))
    err = ((fp8 - full).norm() / full.norm()).item()
    assert 0.0 < err < ATTENTION_BOUND, err


def test_fp8_kv_model_logits_stay_close_to_transformers(tiny_model_dir: Callable[[str], Path]) -> None:
    folder = tiny_model_dir("qwen3_moe")
    runner = build_runner(str(folder), num_blocks=16, kv_cache_dtype="fp8_e4m3")
    assert runner.kv_caches[0].dtype == torch.float8_e4m3fn
    rows: list[torch.Tensor] = []
    compute = runner.model.compute_logits
    runner.model.compute_logits = lambda h: rows.append(compute(h)) or rows[-1]  # type: ignore[method-assign]  # records the logits
    tokens = [(5 * i + 7) % 300 + 3 for i in range(30)]
    greedy = SamplingParams(temperature=0.0)
    result = runner.execute_step(
        DecodeStep(1, new_requests=[NewRequestData("a", tokens, greedy, [3, 9, 11], 0, 30, 0)])
    )
    for step_id in range(2, 6):
        tokens.append(result.outputs[0].sampled_token_id)
        result = runner.execute_step(DecodeStep(step_id, running_requests=[RunningRequestData("a", [], 1)]))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0, 29:]
    got = torch.cat(rows)
    assert ((got - want).norm() / want.norm()).item() < LOGITS_BOUND


def test_kv_blocks_are_sized_from_the_kv_dtype(tiny_model_dir: Callable[[str], Path]) -> None:
    config = load_hf_config(tiny_model_dir("qwen3_moe"))
    cpu = torch.device("cpu")
    fp8 = resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, cpu)
    assert (
        fp8 == torch.float8_e4m3fn and resolve_kv_cache_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    )
    per_block = 2 * config.num_layers * 16 * config.num_kv_heads * config.head_dim
    assert kv_bytes_per_block(config, 16, fp8) == per_block
    assert kv_bytes_per_block(config, 16, torch.bfloat16) == 2 * per_block
    with pytest.raises(ValueError, match="unknown --kv-cache-dtype"):
        resolve_kv_cache_dtype("int8", torch.bfloat16, cpu)
