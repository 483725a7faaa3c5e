"""Triton fused RMSNorm / add+RMSNorm / SiLU-and-mul / rotary / per-head Q-K norm + rotary vs float64 references
on random inputs."""

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
from ominix_worker.ops.fused import (  # noqa: E402
    fused_add_rms_norm,
    qk_norm_rotary_in_place,
    rms_norm,
    rotary_in_place,
    rotary_store_kv,
    silu_and_mul,
)

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return ((got.double().cpu() - ref).norm() / ref.norm()).item()


def _rand(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [576, 4096])
def test_rms_norm_and_residual(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = _rand(gen, 37, hidden, dtype=dtype)
    residual = _rand(gen, 37, hidden, dtype=dtype)
    weight = (1 + 0.1 * _rand(gen, hidden, dtype=torch.float32)).to(dtype)
    eps = 1e-5

    def ref_norm(v: torch.Tensor) -> torch.Tensor:
        v = v.double().cpu()
        return weight.double().cpu() * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)

    assert _rel(rms_norm(x, weight, eps), ref_norm(x)) < TOLERANCE[dtype]
    summed = (x + residual).clone()
    res = residual.clone()
    out = fused_add_rms_norm(x, res, weight, eps)
    assert torch.equal(res, summed), "residual must hold x + residual after the call"
    assert _rel(out, ref_norm(summed)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up = _rand(gen, 19, 2 * 1500, dtype=dtype)
    ref = gate_up.double().cpu()
    gate, up = ref[:, :1500], ref[:, 1500:]
    expected = gate * torch.sigmoid(gate) * up
    out = torch.full((19, 1500), float("nan"), dtype=dtype, device=DEVICE)
    silu_and_mul(gate_up, out)
    assert _rel(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,head_dim", [(32, 128), (8, 128), (9, 64)])
def test_rotary_in_place(dtype: torch.dtype, heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(heads * head_dim)
    emb, cos_sin = _rope_tables(head_dim)
    positions = torch.randint(0, emb.shape[0], (23,), generator=gen)
    x = _rand(gen, 23, heads, head_dim, dtype=dtype)
    expected = _rotated(x.double().cpu(), emb, positions)
    rotary_in_place(x, positions.to(DEVICE), cos_sin)
    assert _rel(x, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("q_heads,k_heads,head_dim", [(32, 4, 128), (4, 4, 64), (5, 1, 128)])
def test_qk_norm_rotary_in_place(dtype: torch.dtype, q_heads: int, k_heads: int, head_dim: int) -> None:
    """Q and K heads as views of a fused QKV row (V after them, untouched): each head normalised by its own
    weight, then rotated; against float64 and against the two unfused kernels it replaces."""
    gen = torch.Generator().manual_seed(q_heads * k_heads + head_dim)
    emb, cos_sin = _rope_tables(head_dim)
    tokens, eps = 19, 1e-6
    positions = torch.randint(0, emb.shape[0], (tokens,), generator=gen)
    qkv = _rand(gen, tokens, (q_heads + 2 * k_heads) * head_dim, dtype=dtype)
    q_w = (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype).to(DEVICE)
    k_w = (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype).to(DEVICE)
    heads = qkv[:, : (q_heads + k_heads) * head_dim].view(tokens, q_heads + k_heads, head_dim)
    v_before = qkv[:, (q_heads + k_heads) * head_dim :].clone()
    x64 = heads.double().cpu()
    w64 = torch.cat((q_w.double().cpu().expand(q_heads, -1), k_w.double().cpu().expand(k_heads, -1)))
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64
    expected = _rotated(normed, emb, positions)
    unfused = heads.clone()
    for part, weight in ((unfused[:, :q_heads], q_w), (unfused[:, q_heads:], k_w)):
        part.copy_(rms_norm(part.reshape(-1, head_dim), weight, eps).view(part.shape))
    rotary_in_place(unfused, positions.to(DEVICE), cos_sin)
    qk_norm_rotary_in_place(heads, positions.to(DEVICE), cos_sin, q_heads, q_w, k_w, eps)
    assert _rel(heads, expected) < TOLERANCE[dtype]
    # Rounded where the unfused kernels round; the sum of squares is added up in another order, so a normalised
    # element may land one unit in the last place away, which the rotation carries into both outputs it feeds.
    ulp = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-24}[dtype]
    gap = (heads.float() - unfused.float()).abs().max().item()
    assert gap <= 4 * ulp * unfused.float().abs().max().item()
    torch.testing.assert_close(qkv[:, (q_heads + k_heads) * head_dim :], v_before, rtol=0, atol=0)


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float8_e4m3fn),
        (torch.float16, torch.float8_e5m2),
    ],
    ids=str,
)
@pytest.mark.parametrize("q_heads,k_heads,head_dim", [(32, 8, 128), (5, 1, 64), (12, 3, 96)])
def test_rotary_store_kv(
    dtype: torch.dtype, cache_dtype: torch.dtype, q_heads: int, k_heads: int, head_dim: int
) -> None:
    """One launch against the two it replaces (``rotary_in_place`` over Q and K, then the backend's
    ``write_kv``): Q rotated in place and the cache's K and V bit for bit the same, FP8 scales included; slot -1
    (a padding row, a whole-prompt hit's cached token) stores nothing, and no other slot is touched. The FP8
    cases' values reach past the e4m3 range once scaled, so the store's saturation is compared too."""
    gen = torch.Generator().manual_seed(q_heads * 7 + k_heads + head_dim)
    emb, cos_sin = _rope_tables(head_dim)
    tokens, block_size, num_blocks = 21, 16, 6
    positions = torch.randint(0, emb.shape[0], (tokens,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[3, 11, 20]] = -1
    fp8 = cache_dtype.itemsize == 1
    qkv = _rand(gen, tokens, (q_heads + 2 * k_heads) * head_dim, dtype=dtype) * (200 if fp8 else 1)
    scales = KVScales(k=0.75, v=0.5) if fp8 else KVScales()
    sentinel = torch.full((2, num_blocks, block_size, k_heads, head_dim), 3.0).to(cache_dtype).to(DEVICE)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(tokens + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.ones(tokens, dtype=torch.int32, device=DEVICE),
        block_tables=torch.zeros((tokens, 1), dtype=torch.int32, device=DEVICE),
        slot_mapping=slots.to(DEVICE),
        max_query_len=1,
        max_seq_len=1,
        num_decode_only=True,
    )

    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        heads = x[:, : (q_heads + k_heads) * head_dim].view(tokens, q_heads + k_heads, head_dim)
        value = x[:, (q_heads + k_heads) * head_dim :].view(tokens, k_heads, head_dim)
        return heads, value

    unfused_qkv, unfused_cache = qkv.clone(), sentinel.clone()
    heads, value = split(unfused_qkv)
    rotary_in_place(heads, positions.to(DEVICE), cos_sin)
    TritonPagedAttention(block_size).write_kv(unfused_cache, heads[:, q_heads:], value, meta, scales)

    fused_qkv, fused_cache = qkv.clone(), sentinel.clone()
    heads, value = split(fused_qkv)
    rotary_store_kv(
        heads,
        value,
        positions.to(DEVICE),
        cos_sin,
        q_heads,
        fused_cache,
        meta.slot_mapping,
        scales.k,
        scales.v,
    )
    q_width = q_heads * head_dim
    assert torch.equal(fused_qkv[:, :q_width], unfused_qkv[:, :q_width]), "Q rotated in place as before"
    assert torch.equal(fused_qkv[:, q_width:], qkv[:, q_width:]), "K and V left as the projection wrote them"
    assert torch.equal(fused_cache.view(torch.uint8), unfused_cache.view(torch.uint8))
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat = fused_cache.view(2, num_blocks * block_size, -1).float().cpu()
    assert bool((flat[:, ~written] == 3.0).all()), "a slot no token maps to keeps what it held"
    assert bool((flat[:, written] != 3.0).any(dim=-1).all()), "every token's K and V slot was written"
    # Against torch: each stored K (rotated, in the run dtype) and V, divided by its scale and saturated at ±448
    # in an FP8 cache, to its format's precision (e4m3: 3 mantissa bits, e5m2: 2).
    rows = slots >= 0
    rotated_k = unfused_qkv[:, q_width : q_width + k_heads * head_dim].float().cpu()[rows]
    v = qkv[:, q_width + k_heads * head_dim :].float().cpu()[rows]
    stored = fused_cache.view(2, num_blocks * block_size, -1).float().cpu()[:, slots[rows]]
    if fp8 and INTERPRET:
        return  # the interpreter converts float32 to FP8 off by up to a binade (127.3 to 64 in e4m3)
    if fp8:
        assert bool((stored[0].abs() == 448.0).any()) and bool((stored[1].abs() == 448.0).any())
        rtol = 0.07 if cache_dtype == torch.float8_e4m3fn else 0.13
        torch.testing.assert_close(stored[0], (rotated_k / scales.k).clamp(-448, 448), rtol=rtol, atol=0)
        torch.testing.assert_close(stored[1], (v / scales.v).clamp(-448, 448), rtol=rtol, atol=0)
    else:
        assert torch.equal(stored, torch.stack((rotated_k, v)))
    expected_q = _rotated(qkv[:, :q_width].view(tokens, q_heads, head_dim).double().cpu(), emb, positions)
    assert _rel(fused_qkv[:, :q_width].view(tokens, q_heads, head_dim), expected_q) < TOLERANCE[dtype]


def _rope_tables(head_dim: int, max_pos: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    """(max_pos, head_dim) float64 angles, and the float32 (2, max_pos, head_dim) cos/sin table the kernels read."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    freqs = torch.outer(torch.arange(max_pos).double(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb, torch.stack((emb.cos(), emb.sin())).float().to(DEVICE)


def _rotated(x64: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    cos = emb.cos()[positions].unsqueeze(1)
    sin = emb.sin()[positions].unsqueeze(1)
    half = x64.shape[-1] // 2
    return x64 * cos + torch.cat((-x64[..., half:], x64[..., :half]), dim=-1) * sin


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
