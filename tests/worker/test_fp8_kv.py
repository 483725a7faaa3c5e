"""FP8 (e4m3) KV cache on the CPU reference path: attention error against a float KV cache, logits against
transformers, and KV block sizing (bytes per block follow the KV dtype; the capability states it).

Bounds (relative Frobenius error): attention output 6% against float KV (4.0% measured on these random K/V:
e4m3 rounds each element with 2.6% rms relative error); model logits 10% against transformers on a float
cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData, SamplingParams
from ominix_worker.attention.base import AttentionMetadata, KVScales
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


# ---- per-layer KV scales (the checkpoint's self_attn.k_scale / v_scale) --------------------------------


def test_the_reference_store_divides_by_the_layer_scales_and_the_read_multiplies_back() -> None:
    backend = TorchReferenceAttention(16)
    cache = backend.allocate_kv_cache(1, 2, 1, 16, torch.float8_e4m3fn, torch.device("cpu"))[0]
    key = torch.linspace(-4000, 4000, 16).reshape(1, 1, 16)
    value = torch.linspace(-1, 1, 16).reshape(1, 1, 16)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([1], dtype=torch.int32),
        block_tables=torch.tensor([[1]], dtype=torch.int32),
        slot_mapping=torch.tensor([16]),  # block 1, position 0
        max_query_len=1,
        max_seq_len=1,
        num_decode_only=True,
    )
    scales = KVScales(k=4.0, v=0.5)
    backend.write_kv(cache, key, value, meta, scales)
    raw = cache.view(torch.uint8)[:, 1, 0, 0].view(torch.float8_e4m3fn).float()
    # K / 4 saturates at ±448 (the e4m3 range); V / 0.5 keeps e4m3 precision (3 mantissa bits)
    assert raw[0].abs().max() == 448.0
    torch.testing.assert_close(raw[0], (key / 4).clamp(-448, 448).reshape(16), rtol=0.07, atol=0)
    torch.testing.assert_close(raw[1], (value / 0.5).reshape(16), rtol=0.07, atol=1e-2)
    # the read multiplies back: a one-key attention returns that key's value
    out = backend.forward(torch.randn(1, 1, 16), cache, meta, 0.25, scales)
    torch.testing.assert_close(out.reshape(16), raw[1] * 0.5)
    assert not torch.allclose(backend.forward(torch.randn(1, 1, 16), cache, meta, 0.25), out)


# Per layer (k, v), as float32 values (what a checkpoint holds): far from 1.0, so a lost scale shows.
KV_SCALES = {
    layer: tuple(float(torch.tensor(x, dtype=torch.float32)) for x in scales)
    for layer, scales in {0: (0.01, 0.02), 1: (0.05, 0.004)}.items()
}


def _with_kv_scales(source: Path, target: Path, names: str = "self_attn.{kv}_scale") -> Path:
    """A copy of ``source`` whose checkpoint carries per-layer KV scales (as FP8 checkpoints ship them)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    for layer, (k, v) in KV_SCALES.items():
        for kv, value in (("k", k), ("v", v)):
            name = f"model.layers.{layer}." + names.format(kv=kv)
            tensors[name] = torch.tensor(value, dtype=torch.float32)
    save_file(tensors, str(target / "model.safetensors"))
    return target


def _prefill(folder: Path, kv_cache_dtype: str, tokens: list[int]) -> tuple[Any, torch.Tensor]:
    runner = build_runner(str(folder), num_blocks=8, kv_cache_dtype=kv_cache_dtype)
    rows: list[torch.Tensor] = []
    compute = runner.model.compute_logits
    runner.model.compute_logits = lambda h: rows.append(compute(h)) or rows[-1]  # type: ignore[method-assign]  # records the logits
    greedy = SamplingParams(temperature=0.0)
    runner.execute_step(
        DecodeStep(1, new_requests=[NewRequestData("a", tokens, greedy, [1, 2], 0, len(tokens), 0)])
    )
    runner.execute_step(DecodeStep(2, running_requests=[RunningRequestData("a", [], 1)]))
    return runner, torch.cat(rows)


@pytest.mark.parametrize("names", ["self_attn.{kv}_scale", "self_attn.{kv}_proj.output_scale"])
def test_checkpoint_kv_scales_quantize_each_layer_with_its_own_scale(
    names: str, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """Layer 0's K/V do not depend on the KV precision: its FP8 cache must hold exactly e4m3(K / k_scale)
    and e4m3(V / v_scale) of the float cache's values. The logits stay as close to the float-cache ones as
    with unit scales (the reads multiply the scales back)."""
    source = tiny_model_dir("llama")
    folder = _with_kv_scales(source, tmp_path / "scaled", names)
    tokens = [(5 * i + 7) % 300 + 3 for i in range(20)]
    fp8, fp8_logits = _prefill(folder, "fp8_e4m3", tokens)
    for layer, (k, v) in KV_SCALES.items():
        assert fp8.model.layers[layer].self_attn.kv_scales == KVScales(k, v)
    full, full_logits = _prefill(folder, "auto", tokens)  # the same checkpoint: a float cache ignores them
    stored = fp8.kv_caches[0].view(torch.uint8)[:, 1:3].view(torch.float8_e4m3fn).float()
    exact = full.kv_caches[0][:, 1:3].float()
    k, v = KV_SCALES[0]
    expected = torch.stack((exact[0] / k, exact[1] / v)).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    positions = len(tokens)  # blocks 1 and 2 hold the 20 prompt tokens and the decoded one
    flat = stored.flatten(1, 2)[:, :positions]
    assert torch.equal(flat, expected.flatten(1, 2)[:, :positions])
    assert flat.abs().max() > 16 * exact.abs().max()  # the stored values are the scaled ones, not raw K/V
    unit, unit_logits = _prefill(source, "fp8_e4m3", tokens)
    assert unit.model.layers[0].self_attn.kv_scales == KVScales()
    scaled_err = ((fp8_logits - full_logits).norm() / full_logits.norm()).item()
    unit_err = ((unit_logits - full_logits).norm() / full_logits.norm()).item()
    assert scaled_err < LOGITS_BOUND and unit_err < LOGITS_BOUND, (scaled_err, unit_err)


def test_a_per_head_or_non_positive_kv_scale_is_refused(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    from ominix_worker.loader import ModelLoadError

    folder = _with_kv_scales(tiny_model_dir("llama"), tmp_path / "bad")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor([0.5, 0.25])
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"layers\.1\.self_attn\.v_scale: .*one scale per layer"):
        build_runner(str(folder), num_blocks=4, kv_cache_dtype="fp8_e4m3")
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor(0.0)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="not a positive number"):
        build_runner(str(folder), num_blocks=4, kv_cache_dtype="fp8_e4m3")
