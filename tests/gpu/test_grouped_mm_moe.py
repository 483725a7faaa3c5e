"""The prefill MoE path on torch's grouped GEMM (``ops/grouped_mm_moe.py``) vs the float64 reference and vs the
Triton tile path on the same inputs: plain SiLU experts (Qwen3-MoE, Mixtral shapes) and gpt-oss's biased
experts with the clamped SwiGLU, ragged loads and empty experts; when the path is taken.

Runs on a Hopper GPU (the path is Hopper-only); skips elsewhere."""

from __future__ import annotations

from functools import partial

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs a Hopper GPU", allow_module_level=True)
if not hasattr(torch, "_grouped_mm"):
    pytest.skip("this torch has no grouped GEMM", allow_module_level=True)
pytest.importorskip("triton")

from ominix_worker.ops.biased_moe import fused_experts_biased  # noqa: E402
from ominix_worker.ops.fused import silu_and_mul  # noqa: E402
from ominix_worker.ops.fused_moe import fused_experts, pick_config  # noqa: E402
from ominix_worker.ops.grouped_mm_moe import experts_grouped_mm, use_grouped_mm  # noqa: E402
from ominix_worker.ops.moe_ref import clamped_swiglu, fused_experts_ref, select_experts  # noqa: E402

pytestmark = pytest.mark.gpu
TOLERANCE = 2e-2  # bf16 operands, float32 accumulation: relative Frobenius error against float64
SWIGLU = partial(clamped_swiglu, alpha=1.702, limit=7.0)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return ((got.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


def _inputs(
    tokens: int, experts: int, top_k: int, used: int, hidden: int, inter: int, biased: bool
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(tokens * 7 + experts * 3 + top_k)
    logits = torch.randn((tokens, experts), generator=gen)
    logits[:, used:] -= 100.0  # experts past ``used`` get no token
    logits[:, : max(1, used // 4)] += 1.5  # a few hot experts: ragged loads
    weights, ids = select_experts(logits, top_k, renormalize=True)
    scale = 4.0 if biased else 1.0  # gpt-oss: large enough that the SwiGLU clamps engage
    t = {
        "x": torch.randn((tokens, hidden), generator=gen),
        "w13": torch.randn((experts, 2 * inter, hidden), generator=gen) * (scale / hidden**0.5),
        "w2": torch.randn((experts, hidden, inter), generator=gen) / inter**0.5,
        "b13": torch.randn((experts, 2 * inter), generator=gen),
        "b2": torch.randn((experts, hidden), generator=gen),
    }
    out = {k: v.to(torch.bfloat16) for k, v in t.items()}
    out["weights"], out["ids"] = weights, ids
    return out


def _reference(t: dict[str, torch.Tensor], experts: int, biased: bool) -> torch.Tensor:
    w13, w2, b13, b2 = (t[k].double() for k in ("w13", "w2", "b13", "b2"))
    if not biased:
        return fused_experts_ref(
            t["x"].double(), lambda e: (w13[e], w2[e]), experts, t["weights"].double(), t["ids"]
        )
    return fused_experts_ref(
        t["x"].double(), lambda e: (w13[e], w2[e]), experts, t["weights"].double(), t["ids"], SWIGLU,
        lambda e: (b13[e], b2[e]),
    )  # fmt: skip


SHAPES = [  # (tokens, experts, top_k, experts used, hidden, intermediate)
    (1024, 128, 8, 128, 2048, 768),  # Qwen3-30B-A3B
    (3001, 128, 8, 20, 2048, 768),  # 108 empty experts
    (2048, 8, 2, 8, 4096, 1792),  # Mixtral-like
    (17, 8, 2, 3, 256, 128),  # below the threshold when called through fused_experts; direct call here
]


@pytest.mark.parametrize(("tokens", "experts", "top_k", "used", "hidden", "inter"), SHAPES)
def test_grouped_mm_experts_match_the_reference_and_the_triton_path(
    tokens: int, experts: int, top_k: int, used: int, hidden: int, inter: int
) -> None:
    t = _inputs(tokens, experts, top_k, used, hidden, inter, biased=False)
    ref = _reference(t, experts, biased=False)
    dev = {k: v.cuda() for k, v in t.items()}
    got = experts_grouped_mm(dev["x"], dev["w13"], dev["w2"], dev["weights"], dev["ids"], silu_and_mul)
    triton_path = fused_experts(
        dev["x"], dev["w13"], dev["w2"], dev["weights"], dev["ids"],
        config=pick_config(experts, 2 * inter, hidden, tokens, False),
    )  # fmt: skip
    assert got.shape == (tokens, hidden) and got.dtype == torch.bfloat16
    assert _rel(got, ref) < TOLERANCE
    assert _rel(triton_path, ref) < TOLERANCE
    assert _rel(got, triton_path) < TOLERANCE


@pytest.mark.parametrize(("tokens", "used"), [(2048, 32), (1500, 9), (33, 3)])
def test_grouped_mm_biased_experts_match_the_reference(tokens: int, used: int) -> None:
    experts, top_k, hidden, inter = 32, 4, 2880, 2880  # gpt-oss-20b's experts
    t = _inputs(tokens, experts, top_k, used, hidden, inter, biased=True)
    ref = _reference(t, experts, biased=True)
    dev = {k: v.cuda() for k, v in t.items()}
    got = experts_grouped_mm(
        dev["x"], dev["w13"], dev["w2"], dev["weights"], dev["ids"], SWIGLU, dev["b13"], dev["b2"]
    )
    assert _rel(got, ref) < TOLERANCE
    through_entry = fused_experts_biased(
        dev["x"], dev["w13"], dev["w2"], dev["b13"], dev["b2"], dev["weights"], dev["ids"], SWIGLU
    )
    assert _rel(through_entry, ref) < TOLERANCE


def test_the_path_is_taken_for_large_bf16_batches_only() -> None:
    w13 = torch.zeros((8, 64, 32), dtype=torch.bfloat16, device="cuda")
    big = torch.zeros((1024, 32), dtype=torch.bfloat16, device="cuda")
    assert use_grouped_mm(big, w13, min_tokens=1024)
    assert not use_grouped_mm(big[:1023], w13, min_tokens=1024)
    assert not use_grouped_mm(big, w13, min_tokens=0)  # 0 turns it off
    assert not use_grouped_mm(big.float(), w13.float(), min_tokens=1024)
    assert not use_grouped_mm(big.cpu(), w13.cpu(), min_tokens=1024)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    seen: list[bool] = []
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        seen.append(use_grouped_mm(big, w13, min_tokens=1024))
        torch.zeros(1, device="cuda")
    assert seen == [False]  # never inside a capture: decode graphs keep the Triton path
