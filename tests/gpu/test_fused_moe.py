"""Triton fused MoE vs the torch reference with ragged expert loads (top-k 1/2/8, 8 or 128 experts, experts
that get no token), the device-side align, and a CUDA-graph replay of a MoE layer under new routings.

Runs on CUDA; ``TRITON_INTERPRET=1`` runs the kernels on the CPU (slowly: small shapes only)."""

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

from ominix_worker.ops import fused_moe  # noqa: E402
from ominix_worker.ops.fused_moe import fused_experts, moe_align, moe_sum  # noqa: E402
from ominix_worker.ops.moe_ref import fused_experts_ref, select_experts  # noqa: E402

pytestmark = pytest.mark.gpu

# bf16 inputs and weights, fp32 accumulation: relative Frobenius error against a float64 reference.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-5}
DTYPE = torch.float32 if INTERPRET else torch.bfloat16


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return ((got.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


def _routing(
    gen: torch.Generator, tokens: int, experts: int, top_k: int, used: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits that favour the first ``used`` experts (the rest stay empty when used >= top_k),
    skewed so that loads are ragged."""
    logits = torch.randn((tokens, experts), generator=gen)
    logits[:, used:] -= 100.0
    logits[:, : max(1, used // 4)] += 1.5  # a few hot experts
    return select_experts(logits, top_k, renormalize=True)


def _weights(
    gen: torch.Generator, experts: int, hidden: int, inter: int
) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn((experts, 2 * inter, hidden), generator=gen) / hidden**0.5
    w2 = torch.randn((experts, hidden, inter), generator=gen) / inter**0.5
    return w13, w2


SHAPES = [  # (tokens, experts, top_k, experts used, hidden, intermediate)
    (1, 8, 2, 8, 64, 32),
    (7, 8, 1, 8, 64, 32),
    (33, 8, 2, 3, 64, 48),  # 5 empty experts
    (5, 128, 8, 128, 64, 32),
    (70, 128, 8, 20, 128, 64),  # 108 empty experts
]
if not INTERPRET:
    SHAPES += [(1, 128, 8, 128, 2048, 768), (256, 128, 8, 128, 2048, 768), (3000, 128, 8, 128, 2048, 768),
               (512, 8, 2, 8, 4096, 1792)]  # fmt: skip


@pytest.mark.parametrize(("tokens", "experts", "top_k", "used", "hidden", "inter"), SHAPES)
def test_fused_experts_match_the_reference(
    tokens: int, experts: int, top_k: int, used: int, hidden: int, inter: int
) -> None:
    gen = torch.Generator().manual_seed(tokens * 131 + experts)
    weights, ids = _routing(gen, tokens, experts, top_k, used)
    w13, w2 = _weights(gen, experts, hidden, inter)
    x = torch.randn((tokens, hidden), generator=gen)
    # Reference in float64 from the same (rounded) inputs the kernel sees.
    x_r, w13_r, w2_r = (t.to(DTYPE) for t in (x, w13, w2))
    ref = fused_experts_ref(
        x_r.double(), lambda e: (w13_r[e].double(), w2_r[e].double()), experts, weights.double(), ids
    )
    got = fused_experts(x_r.to(DEVICE), w13_r.to(DEVICE), w2_r.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE))
    assert got.shape == (tokens, hidden) and got.dtype == DTYPE
    assert _rel(got, ref) < TOLERANCE[DTYPE]


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "block_m"),
    # Below and above PARALLEL_ALIGN_MIN_ASSIGNMENTS (one program vs count / scan / scatter kernels).
    [(1, 128, 8, 16), (37, 8, 2, 16), (9, 16, 4, 4), (300, 128, 8, 64), (700, 8, 2, 16)],
)
def test_align_groups_every_assignment_once_in_its_experts_tiles(
    tokens: int, experts: int, top_k: int, block_m: int
) -> None:
    gen = torch.Generator().manual_seed(tokens)
    _, ids = _routing(gen, tokens, experts, top_k, used=min(experts, 6))
    sorted_ids, expert_ids, total = (t.cpu() for t in moe_align(ids.to(DEVICE), experts, block_m))
    flat = ids.reshape(-1).long()
    n = flat.numel()
    counts = torch.bincount(flat, minlength=experts)
    assert int(total) == int(((counts + block_m - 1) // block_m * block_m).sum())
    real = sorted_ids[: int(total)]
    assert sorted(real[real < n].tolist()) == list(range(n))  # each assignment exactly once
    assert (sorted_ids[int(total) :] == n).all()  # padding past the total
    for slot in range(int(total)):
        a = int(real[slot])
        if a < n:
            assert int(expert_ids[slot // block_m]) == int(flat[a])
    assert (expert_ids[-(-int(total) // block_m) :] == -1).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_captured_moe_layer_replays_new_routings() -> None:
    gen = torch.Generator().manual_seed(7)
    experts, top_k, hidden, inter, tokens = 128, 8, 512, 256, 16
    w13, w2 = (t.to(DTYPE).cuda() for t in _weights(gen, experts, hidden, inter))
    router = (torch.randn((experts, hidden), generator=gen) / hidden**0.5).to(DTYPE).cuda()
    x_static = torch.zeros((tokens, hidden), dtype=DTYPE, device="cuda")

    def layer() -> torch.Tensor:
        weights, ids = fused_moe.select_experts(x_static @ router.T, top_k, renormalize=True)
        return fused_experts(x_static, w13, w2, weights, ids)

    x_static.copy_(torch.randn((tokens, hidden), generator=gen).to(DTYPE))
    layer()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = layer()
    w13_c, w2_c = w13.double(), w2.double()
    for trial in range(3):
        x_static.copy_(torch.randn((tokens, hidden), generator=gen).to(DTYPE))
        graph.replay()
        weights, ids = select_experts(x_static @ router.T, top_k, renormalize=True)
        ref = fused_experts_ref(
            x_static.double(), lambda e: (w13_c[e], w2_c[e]), experts, weights.double(), ids
        )
        assert _rel(out_static, ref) < TOLERANCE[DTYPE], f"replay {trial}"


def test_a_stored_tuning_table_is_used_for_the_nearest_token_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from ominix_worker.ops import fused_moe

    monkeypatch.setattr(fused_moe, "CONFIG_DIR", tmp_path)
    fused_moe._stored_table.cache_clear()
    small = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2)
    large = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=2)
    name = fused_moe.config_file_name(8, 64, 64, "bf16")
    (tmp_path / name).write_text(json.dumps({"1": small, "256": large}))
    try:
        assert fused_moe.pick_config(8, 64, 64, 3, use_fp8=False) == small
        assert fused_moe.pick_config(8, 64, 64, 300, use_fp8=False) == large
        assert fused_moe.pick_config(8, 64, 64, 3, use_fp8=True) == fused_moe.default_config(3, True)
        gen = torch.Generator().manual_seed(3)
        weights, ids = _routing(gen, 5, 8, 2, 8)
        w13, w2 = _weights(gen, 8, 64, 32)
        x = torch.randn((5, 64), generator=gen)
        ref = fused_experts_ref(
            x.double(), lambda e: (w13[e].double(), w2[e].double()), 8, weights.double(), ids
        )
        got = fused_experts(
            *(t.to(DTYPE).to(DEVICE) for t in (x, w13, w2)), weights.to(DEVICE), ids.to(DEVICE)
        )
        assert _rel(got, ref) < TOLERANCE[DTYPE] * 2
    finally:
        fused_moe._stored_table.cache_clear()


def test_a_card_without_a_table_takes_its_sm_twins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from ominix_worker.ops import fused_moe

    monkeypatch.setattr(fused_moe, "CONFIG_DIR", tmp_path)
    fused_moe._stored_table.cache_clear()
    h100 = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    h200 = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=4)
    try:
        name = fused_moe.config_file_name(8, 64, 64, "bf16", "NVIDIA_H100_80GB_HBM3")
        (tmp_path / name).write_text(json.dumps({"16": h100}))
        assert fused_moe.stored_table(8, 64, 64, "bf16", "NVIDIA_H200") == {16: h100}
        assert fused_moe.stored_table(8, 64, 64, "fp8", "NVIDIA_H200") is None  # another dtype: no table
        assert fused_moe.stored_table(8, 64, 64, "bf16", "NVIDIA_A100-SXM4-80GB") is None  # no twin listed
        # A card's own table comes first.
        own = fused_moe.config_file_name(8, 64, 64, "bf16", "NVIDIA_H200")
        (tmp_path / own).write_text(json.dumps({"16": h200}))
        fused_moe._stored_table.cache_clear()  # tables are read once; this one is new
        assert fused_moe.stored_table(8, 64, 64, "bf16", "NVIDIA_H200") == {16: h200}
        assert fused_moe.stored_table(8, 64, 64, "bf16", "NVIDIA_H100_80GB_HBM3") == {16: h100}
        # Twins go both ways.
        assert all(
            card in fused_moe.SM_TWINS[twin] for card, twins in fused_moe.SM_TWINS.items() for twin in twins
        )
    finally:
        fused_moe._stored_table.cache_clear()


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 128, 8), (37, 8, 2), (5, 60, 4), (300, 128, 1)])
def test_fused_routing_matches_the_reference(
    scoring: str, renormalize: bool, tokens: int, experts: int, top_k: int
) -> None:
    gen = torch.Generator().manual_seed(tokens * 7 + experts)
    # float32 logits: bf16 ones tie often enough that torch.topk's order among equals would decide the test.
    logits = torch.randn((tokens, experts), generator=gen) * 3
    ref_w, ref_i = select_experts(logits, top_k, renormalize, scoring)
    got_w, got_i = fused_moe.select_experts(logits.to(DEVICE), top_k, renormalize, scoring)
    assert got_w.dtype == torch.float32 and got_i.dtype == torch.int32
    assert got_w.shape == got_i.shape == (tokens, top_k)
    # Random logits have no ties: the same experts in the same (descending) order.
    assert torch.equal(got_i.cpu(), ref_i)
    torch.testing.assert_close(got_w.cpu(), ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_fused_routing_of_nan_logits_stays_within_the_experts(scoring: str) -> None:
    # Uninitialised activations (a graph captured over padding) can be NaN; align indexes by these ids.
    logits = torch.randn((6, 8))
    logits[0] = float("nan")
    logits[1, 3] = float("nan")
    _, ids = fused_moe.select_experts(logits.to(DEVICE), 2, True, scoring)
    assert ((ids >= 0) & (ids < 8)).all()


def test_fused_routing_refuses_an_unknown_scoring_function() -> None:
    with pytest.raises(ValueError, match="scoring function"):
        fused_moe.select_experts(torch.zeros((2, 8), device=DEVICE), 2, True, "relu")


@pytest.mark.parametrize(("tokens", "top_k", "hidden"), [(1, 8, 2048), (13, 2, 100), (256, 4, 64)])
def test_moe_sum_adds_each_tokens_rows(tokens: int, top_k: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    rows = torch.randn((tokens * top_k, hidden), generator=gen).to(DTYPE)
    got = moe_sum(rows.to(DEVICE), tokens, top_k).cpu()
    ref = rows.double().view(tokens, top_k, hidden).sum(dim=1)
    assert got.shape == (tokens, hidden) and got.dtype == DTYPE
    assert _rel(got, ref) < TOLERANCE[DTYPE]


def test_the_card_name_is_read_once_per_card(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every MoE layer of an eager step picks its config by the card's name: torch is asked once per card."""
    from ominix_worker.ops import fused_moe

    asked: list[int | None] = []

    def name_of(index: int | None = None) -> str:
        asked.append(index)
        return f"Card {index}"

    current = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "get_device_name", name_of)
    fused_moe._card_name.cache_clear()
    try:
        assert [fused_moe._device_name() for _ in range(5)] == ["Card_0"] * 5
        current[0] = 1
        assert fused_moe._device_name() == "Card_1" and fused_moe._device_name() == "Card_1"
        assert asked == [0, 1]
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        assert fused_moe._device_name() == "cpu" and asked == [0, 1]  # no card: no lookup
    finally:
        fused_moe._card_name.cache_clear()  # the real card's name again for the tests after this one
