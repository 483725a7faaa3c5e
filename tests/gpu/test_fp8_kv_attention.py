"""FP8 (e4m3) KV cache in the Triton paged kernels: attention over an FP8 cache against the same attention over
a bf16 cache (decode, prefill with context, mixed), and the store kernel's quantization.

Bound: relative Frobenius error of the attention output 7% against bf16 KV (e4m3 rounds K and V with 2.6% rms
relative error per element; 4.0% measured on the same kind of data against float32 KV on the CPU reference,
``tests/worker/test_fp8_kv.py``). Runs on CUDA, or with TRITON_INTERPRET=1 on the CPU (whose e4m3 conversion
does not round to nearest: bound doubled)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import conftest  # noqa: F401

from triton_target import INTERPRET, triton_device  # noqa: E402

DEVICE = triton_device()

from ominix_worker.attention.base import AttentionMetadata, KVScales  # noqa: E402
from ominix_worker.attention.triton_paged import TritonPagedAttention  # noqa: E402

pytestmark = pytest.mark.gpu

BOUND = 0.14 if INTERPRET else 0.07
DTYPE = torch.float32 if INTERPRET else torch.bfloat16


def paged_attention(
    kv_dtype: torch.dtype,
    q_lens: list[int],
    seq_lens: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    seed: int,
    host_offsets: bool = True,
) -> torch.Tensor:
    """Writes every token's K/V through ``write_kv`` into shuffled blocks, then attends with the last q_len
    positions of each request as queries. With ``host_offsets`` the step's metadata carries the host copies an
    eager step has (a mixed step's decode rows may then ride in the prefill kernel's launch)."""
    gen = torch.Generator().manual_seed(seed)
    backend = TritonPagedAttention(16)
    blocks = [-(-s // 16) for s in seq_lens]
    perm = torch.randperm(sum(blocks) + 3, generator=gen).tolist()
    cache = backend.allocate_kv_cache(1, len(perm), kv_heads, dim, kv_dtype, torch.device(DEVICE))[0]
    table = torch.zeros((len(seq_lens), 16 * (max(blocks) // 16 + 1)), dtype=torch.int32)
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
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            block_tables=table.to(DEVICE),
            slot_mapping=slot_mapping.to(DEVICE),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            num_decode_only=all(q == 1 for q in q_lens),
            query_start_loc_cpu=qsl if host_offsets else None,
            seq_lens_cpu=list(seq_lens) if host_offsets else None,
        )

    write = meta(torch.cat(slots))
    backend.write_kv(
        cache, torch.cat(keys).to(DTYPE).to(DEVICE), torch.cat(values).to(DTYPE).to(DEVICE), write
    )
    query = torch.cat(queries).to(DTYPE).to(DEVICE)
    step = meta(torch.cat([s[len(s) - q :] for s, q in zip(slots, q_lens, strict=True)]))
    return backend.forward(query, cache, step, dim**-0.5).double().cpu()


CASES = [([1, 1, 1], [40, 7, 130]), ([12, 1, 30], [60, 33, 30]), ([5], [5])]


@pytest.mark.parametrize(("q_lens", "seq_lens"), CASES)
@pytest.mark.parametrize("host_offsets", [True, False])
def test_fp8_kv_attention_error_is_bounded_against_bf16_kv(
    q_lens: list[int], seq_lens: list[int], host_offsets: bool
) -> None:
    shape = dict(heads=8, kv_heads=2, dim=64, seed=sum(seq_lens), host_offsets=host_offsets)
    fp8 = paged_attention(torch.float8_e4m3fn, q_lens, seq_lens, **shape)
    full = paged_attention(DTYPE, q_lens, seq_lens, **shape)
    assert not torch.isnan(fp8).any()
    err = ((fp8 - full).norm() / full.norm()).item()
    assert 0.0 < err < BOUND, err


def test_fp8_kv_store_quantizes_with_the_scale() -> None:
    backend = TritonPagedAttention(16)
    cache = backend.allocate_kv_cache(1, 2, 1, 16, torch.float8_e4m3fn, torch.device(DEVICE))[0]
    key = torch.linspace(-4000, 4000, 16).reshape(1, 1, 16).to(DTYPE).to(DEVICE)
    value = torch.linspace(-1, 1, 16).reshape(1, 1, 16).to(DTYPE).to(DEVICE)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([1], dtype=torch.int32, device=DEVICE),
        block_tables=torch.zeros((1, 16), dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.tensor([17], device=DEVICE),
        max_query_len=1,
        max_seq_len=1,
        num_decode_only=True,
    )
    backend.write_kv(cache, key, value, meta, KVScales(4.0, 0.5))
    stored_k = cache[0, 1, 1, 0].float().cpu()
    stored_v = cache[1, 1, 1, 0].float().cpu()
    # K / 4 saturates at ±448 (the e4m3 range); V / 0.5 keeps e4m3 precision (3 mantissa bits).
    assert stored_k.abs().max() == 448.0
    assert torch.allclose(stored_k, (key.float().cpu() / 4).clamp(-448, 448).reshape(16), rtol=0.07)
    assert torch.allclose(stored_v, (value.float().cpu() / 0.5).reshape(16), rtol=0.07, atol=1e-2)


@pytest.mark.skipif(DEVICE != "cuda", reason="the whole runner on a GPU")
def test_checkpoint_kv_scales_reach_the_triton_store_and_read(tmp_path: Path) -> None:
    """A tiny Llama checkpoint with per-layer k_scale / v_scale (0.01-0.05): layer 0's FP8 cache holds its
    K / k_scale and V / v_scale (the float cache's values, within e4m3 rounding), and the logits stay within
    10% of a bf16 cache's (the kernels multiply the scales back; a lost scale is off by 20-250x)."""
    from safetensors.torch import load_file, save_file

    from ominix_runtime.contract import DecodeStep, NewRequestData, SamplingParams
    from ominix_worker.runner import build_runner
    from ominix_worker.testing import write_tiny_hf_model

    folder = write_tiny_hf_model(tmp_path / "m", arch="llama", vocab_size=320, with_tokenizer=False)
    tensors = load_file(str(folder / "model.safetensors"))
    scales = {0: (0.01, 0.02), 1: (0.05, 0.004)}
    for layer, (k, v) in scales.items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, str(folder / "model.safetensors"))
    tokens = [(5 * i + 7) % 300 + 3 for i in range(20)]

    def prefill(kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
        runner = build_runner(
            str(folder), device="cuda", dtype=torch.bfloat16, num_blocks=8, kv_cache_dtype=kv_cache_dtype
        )
        rows: list[torch.Tensor] = []
        compute = runner.model.compute_logits
        runner.model.compute_logits = lambda h: rows.append(compute(h)) or rows[-1]  # type: ignore[method-assign]  # records the logits
        new = NewRequestData("a", tokens, SamplingParams(temperature=0.0), [1, 2], 0, len(tokens), 0)
        runner.execute_step(DecodeStep(1, new_requests=[new]))
        torch.cuda.synchronize()
        return runner.kv_caches[0][:, 1:3].float().flatten(1, 2)[:, : len(tokens)].cpu(), torch.cat(
            rows
        ).cpu()

    fp8_cache, fp8_logits = prefill("fp8_e4m3")
    full_cache, full_logits = prefill("auto")
    k, v = scales[0]
    torch.testing.assert_close(fp8_cache[0] * k, full_cache[0], rtol=0.07, atol=0.07 * k)
    torch.testing.assert_close(fp8_cache[1] * v, full_cache[1], rtol=0.07, atol=0.07 * v)
    assert ((fp8_logits - full_logits).norm() / full_logits.norm()).item() < 0.10
