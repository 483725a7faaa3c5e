"""Expert parallelism in the Triton fused MoE: with an ``expert_map`` (global id → local index or -1) a rank
computes only the assignments routed to the experts it holds, the others add zero, and the ranks' partial
sums add up to the whole layer; align leaves other ranks' assignments out; a captured layer replays new
routings. Tensor-parallel experts (intermediate slices) need no kernel change: their partials add up too.

Runs on CUDA; ``TRITON_INTERPRET=1`` runs the kernels on the CPU (slowly: small shapes only)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_fused_moe's helpers

from triton_target import INTERPRET, triton_device  # noqa: E402

DEVICE = triton_device()

from test_fused_moe import TOLERANCE, _rel, _routing, _weights  # noqa: E402

from ominix_worker.ops.fused_moe import fused_experts, moe_align  # noqa: E402
from ominix_worker.ops.moe_ref import fused_experts_ref  # noqa: E402

pytestmark = pytest.mark.gpu
DTYPE = torch.float32 if INTERPRET else torch.bfloat16


def expert_map(num_experts: int, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank`` of ``size`` holds experts [rank·E/size, (rank+1)·E/size)."""
    share = num_experts // size
    out = torch.full((num_experts,), -1, dtype=torch.int32)
    out[rank * share : (rank + 1) * share] = torch.arange(share, dtype=torch.int32)
    return out


SHAPES = [  # (tokens, experts, top_k, experts used, hidden, intermediate, ranks)
    (1, 8, 2, 8, 64, 32, 2),
    (33, 8, 2, 3, 64, 48, 2),  # every used expert on rank 0: rank 1 computes nothing
    (70, 128, 8, 20, 128, 64, 4),
    (5, 16, 1, 16, 64, 32, 8),  # top-1: most ranks see one or no assignment
]
if not INTERPRET:
    SHAPES += [
        (1, 128, 8, 128, 2048, 768, 2),
        (256, 128, 8, 128, 2048, 768, 4),
        (3000, 128, 8, 128, 2048, 768, 8),
    ]


@pytest.mark.parametrize(("tokens", "experts", "top_k", "used", "hidden", "inter", "ranks"), SHAPES)
def test_each_rank_computes_its_experts_and_the_ranks_add_up_to_the_layer(
    tokens: int, experts: int, top_k: int, used: int, hidden: int, inter: int, ranks: int
) -> None:
    gen = torch.Generator().manual_seed(tokens * 17 + experts + ranks)
    weights, ids = _routing(gen, tokens, experts, top_k, used)
    w13, w2 = (t.to(DTYPE) for t in _weights(gen, experts, hidden, inter))
    x = torch.randn((tokens, hidden), generator=gen).to(DTYPE)
    w13_d, w2_d = w13.double(), w2.double()
    whole = fused_experts_ref(x.double(), lambda e: (w13_d[e], w2_d[e]), experts, weights.double(), ids)
    share = experts // ranks
    total = torch.zeros((tokens, hidden), dtype=torch.float64)
    for rank in range(ranks):
        held = slice(rank * share, (rank + 1) * share)
        mapping = expert_map(experts, rank, ranks)
        got = fused_experts(
            x.to(DEVICE), w13[held].contiguous().to(DEVICE), w2[held].contiguous().to(DEVICE),
            weights.to(DEVICE), ids.to(DEVICE), expert_map=mapping.to(DEVICE),
        )  # fmt: skip
        assert got.shape == (tokens, hidden) and got.dtype == DTYPE
        local_w13, local_w2 = w13_d[held], w2_d[held]
        ref = fused_experts_ref(
            x.double(),
            lambda e, a=local_w13, b=local_w2: (a[e], b[e]),
            share,
            weights.double(),
            mapping[ids.long()],
        )
        if ref.abs().max() == 0:  # no token routed here: exactly zero, not garbage
            assert not got.any(), f"rank {rank}"
        else:
            assert _rel(got, ref) < TOLERANCE[DTYPE], f"rank {rank}"
        total += got.double().cpu()
    assert _rel(total, whole) < TOLERANCE[DTYPE]


def test_tensor_parallel_expert_slices_add_up_to_the_layer() -> None:
    gen = torch.Generator().manual_seed(5)
    tokens, experts, top_k, hidden, inter, ranks = 40, 16, 4, 128, 64, 2
    weights, ids = _routing(gen, tokens, experts, top_k, experts)
    w13, w2 = (t.to(DTYPE) for t in _weights(gen, experts, hidden, inter))
    x = torch.randn((tokens, hidden), generator=gen).to(DTYPE)
    w13_d, w2_d = w13.double(), w2.double()
    whole = fused_experts_ref(x.double(), lambda e: (w13_d[e], w2_d[e]), experts, weights.double(), ids)
    gate, up = w13.split(inter, dim=1)
    step = inter // ranks
    total = torch.zeros((tokens, hidden), dtype=torch.float64)
    for rank in range(ranks):
        rows = slice(rank * step, (rank + 1) * step)
        local_w13 = torch.cat((gate[:, rows], up[:, rows]), dim=1).contiguous()
        local_w2 = w2[:, :, rows].contiguous()
        got = fused_experts(
            x.to(DEVICE), local_w13.to(DEVICE), local_w2.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)
        )
        total += got.double().cpu()
    assert _rel(total, whole) < TOLERANCE[DTYPE]


def test_align_places_only_the_local_assignments() -> None:
    gen = torch.Generator().manual_seed(3)
    tokens, experts, top_k, block_m, ranks = 37, 16, 4, 16, 2
    _, ids = _routing(gen, tokens, experts, top_k, used=experts)
    local = expert_map(experts, 1, ranks)[ids.long()]
    sorted_ids, expert_ids, total = (t.cpu() for t in moe_align(local.to(DEVICE), experts // ranks, block_m))
    flat = local.reshape(-1).long()
    n = flat.numel()
    mine = (flat >= 0).nonzero().flatten().tolist()
    counts = torch.bincount(flat[flat >= 0], minlength=experts // ranks)
    assert int(total) == int(((counts + block_m - 1) // block_m * block_m).sum())
    real = sorted_ids[: int(total)]
    assert sorted(real[real < n].tolist()) == mine  # each local assignment once, no other rank's
    for slot in range(int(total)):
        a = int(real[slot])
        if a < n:
            assert int(expert_ids[slot // block_m]) == int(flat[a])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_captured_expert_parallel_layer_replays_new_routings() -> None:
    from ominix_worker.ops.moe_ref import select_experts

    gen = torch.Generator().manual_seed(11)
    experts, top_k, hidden, inter, tokens, ranks, rank = 128, 8, 512, 256, 16, 4, 2
    share = experts // ranks
    w13, w2 = (t.to(DTYPE) for t in _weights(gen, experts, hidden, inter))
    held = slice(rank * share, (rank + 1) * share)
    w13_l, w2_l = w13[held].contiguous().cuda(), w2[held].contiguous().cuda()
    mapping = expert_map(experts, rank, ranks).cuda()
    router = (torch.randn((experts, hidden), generator=gen) / hidden**0.5).to(DTYPE).cuda()
    x_static = torch.zeros((tokens, hidden), dtype=DTYPE, device="cuda")

    def layer() -> torch.Tensor:
        weights, ids = select_experts(x_static @ router.T, top_k, renormalize=True)
        return fused_experts(x_static, w13_l, w2_l, weights, ids, expert_map=mapping)

    x_static.copy_(torch.randn((tokens, hidden), generator=gen).to(DTYPE))
    layer()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = layer()
    w13_c, w2_c = w13_l.double(), w2_l.double()
    for trial in range(3):
        x_static.copy_(torch.randn((tokens, hidden), generator=gen).to(DTYPE))
        graph.replay()
        weights, ids = select_experts(x_static @ router.T, top_k, renormalize=True)
        ref = fused_experts_ref(
            x_static.double(), lambda e: (w13_c[e], w2_c[e]), share, weights.double(), mapping[ids.long()]
        )
        assert _rel(out_static, ref) < TOLERANCE[DTYPE], f"replay {trial}"
