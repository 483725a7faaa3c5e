"""Triton fused RMSNorm / add+RMSNorm / SiLU-and-mul / rotary vs float64 references on random inputs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import conftest  # noqa: F401

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else ("cpu" if INTERPRET else None)
if DEVICE is None:
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from ominix_worker.ops.fused import fused_add_rms_norm, rms_norm, rotary_in_place, silu_and_mul  # noqa: E402

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
    max_pos = 300
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    freqs = torch.outer(torch.arange(max_pos).double(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos_sin = torch.stack((emb.cos(), emb.sin())).float().to(DEVICE)
    positions = torch.randint(0, max_pos, (23,), generator=gen)
    x = _rand(gen, 23, heads, head_dim, dtype=dtype)
    x64 = x.double().cpu()
    cos = emb.cos()[positions].unsqueeze(1)
    sin = emb.sin()[positions].unsqueeze(1)
    half = head_dim // 2
    rotated = torch.cat((-x64[..., half:], x64[..., :half]), dim=-1)
    expected = x64 * cos + rotated * sin
    rotary_in_place(x, positions.to(DEVICE), cos_sin)
    assert _rel(x, expected) < TOLERANCE[dtype]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
