"""FP8 W8A8 GEMMs against bf16: the Triton block-scaled dense GEMM, ``Fp8Linear`` (``torch._scaled_mm`` per
channel), and the fused MoE with FP8 experts, block-scaled and per channel.

Tolerances (relative Frobenius error of the output): against the same GEMM on the dequantized weights the only
difference is the per-token-group activation rounding to e4m3 (2.6% rms per element with round-to-nearest);
bound 5% (the MoE rounds twice: 7%). Against the original bf16 weights, weight rounding adds as much again;
bound 8% (MoE 10%). The kernels equal a float64 emulation of their quantized arithmetic to 1e-6.
Needs an FP8 GPU (compute capability 8.9+); ``TRITON_INTERPRET=1`` runs the Triton kernels on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import conftest  # noqa: F401

from triton_target import INTERPRET, triton_device  # noqa: E402

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
DEVICE = triton_device(FP8_GPU, needs="an FP8 GPU")

from ominix_worker.ops.fp8_gemm import SMALL_M, fp8_linear, w8a8_block_matmul  # noqa: E402
from ominix_worker.ops.fused import silu_and_mul  # noqa: E402
from ominix_worker.ops.fused_moe import (  # noqa: E402
    fused_experts,
    quant_fp8_per_token,
    quant_fp8_per_token_group,
    silu_and_mul_quant_fp8,
)
from ominix_worker.ops.moe_ref import fused_experts_ref, select_experts  # noqa: E402
from ominix_worker.ops.weight_stream import weight_stream_matmul  # noqa: E402
from ominix_worker.parallel import ColumnParallelLinear, RowParallelLinear, ShardRange  # noqa: E402
from ominix_worker.quant.fp8 import (  # noqa: E402
    Fp8ColumnParallelLinear,
    Fp8RowParallelLinear,
    dequantize_fp8,
    quantize_fp8_blocks,
)

pytestmark = pytest.mark.gpu

# The interpreter's float32 -> e4m3 conversion does not round to nearest: twice the activation error.
_SLACK = 2.0 if INTERPRET else 1.0
VS_DEQUANTIZED = 0.05 * _SLACK
VS_BF16 = 0.08 * _SLACK
# The MoE quantizes activations twice (x, then silu(gate)·up).
MOE_VS_DEQUANTIZED = 0.07 * _SLACK
MOE_VS_BF16 = 0.10 * _SLACK
DTYPE = torch.float32 if INTERPRET else torch.bfloat16


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return ((got.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


SHAPES = [(1, 256, 384), (37, 384, 256)] + ([] if INTERPRET else [(512, 4096, 4096), (3, 6144, 2048)])


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_block_scaled_gemm_vs_bf16(m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m + n)
    w = torch.randn((n, k), generator=gen) / k**0.5
    x = torch.randn((m, k), generator=gen)
    q, scale = quantize_fp8_blocks(w, (128, 128))
    got = w8a8_block_matmul(x.to(DTYPE).to(DEVICE), q.to(DEVICE), scale.to(DEVICE), (128, 128))
    assert got.shape == (m, n) and got.dtype == DTYPE
    assert _rel(got, x.double() @ dequantize_fp8(q, scale, (128, 128), torch.float64).T) < VS_DEQUANTIZED
    assert _rel(got, x.double() @ w.double().T) < VS_BF16


# e4m3 widens to bf16 exactly, so the weight-only kernel differs from x @ dequantized W only by the output's
# rounding to the activation dtype and the float32 sum order.
WEIGHT_ONLY_VS_DEQUANTIZED = 1e-5 if INTERPRET else 0.01


@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 200, 384), (3, 200, 384), (SMALL_M, 96, 256)] + ([] if INTERPRET else [(5, 4096, 14336)]),
)
def test_small_batch_weight_only_gemm(block: tuple[int, int] | None, m: int, n: int, k: int) -> None:
    """Decode-sized batches: the e4m3 weight widened in registers, activations unquantized; N and K not
    multiples of the tile (200 columns, a 384-wide K over 256- and 512-wide tiles). 1 token is summed on the
    CUDA cores, more on the tensor cores unless told otherwise; 3 tokens fill 3 of a 4-row CUDA-core tile."""
    gen = torch.Generator().manual_seed(m * n)
    w = torch.randn((n, k), generator=gen) / k**0.5
    x = torch.randn((m, k), generator=gen).to(DTYPE)
    b = block or (1, k)
    q, scale = quantize_fp8_blocks(w, b)
    exact = x.double() @ dequantize_fp8(q, scale, b, torch.float64).T
    got = weight_stream_matmul(x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), b)
    assert got.shape == (m, n) and got.dtype == DTYPE
    assert _rel(got, exact) < WEIGHT_ONLY_VS_DEQUANTIZED
    # fp8_linear takes this path up to SMALL_M tokens, for either scaling.
    via_linear = fp8_linear(x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), b, None)
    torch.testing.assert_close(via_linear, got, rtol=0, atol=0)
    # Either way of summing gives the same product, whichever the token count picked.
    for use_dot in (True, False):
        other = weight_stream_matmul(x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), b, use_dot=use_dot)
        assert _rel(other, exact) < WEIGHT_ONLY_VS_DEQUANTIZED


@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("split_k", [1, 2, 3, 4])
def test_small_batch_gemm_split_k(block: tuple[int, int] | None, split_k: int) -> None:
    """K in slices: the last program of each column tile adds the partial sums, and leaves the tile's arrival
    counter at zero, so the next call (here: three, on new inputs) starts clean. K = 1,408 is 11 blocks of 128:
    the slices are uneven and the last is short."""
    n, k = 72, 1408
    gen = torch.Generator().manual_seed(split_k)
    b = block or (1, k)
    q, scale = quantize_fp8_blocks(torch.randn((n, k), generator=gen) / k**0.5, b)
    dequantized = dequantize_fp8(q, scale, b, torch.float64)
    for m in (1, 3, 9, SMALL_M):
        x = torch.randn((m, k), generator=gen).to(DTYPE)
        for use_dot in (True, False):  # tensor cores, CUDA cores
            got = weight_stream_matmul(
                x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), b, block_n=32, block_k=128, split_k=split_k,
                use_dot=use_dot,
            )  # fmt: skip
            assert _rel(got, x.double() @ dequantized.T) < WEIGHT_ONLY_VS_DEQUANTIZED


def test_small_batch_gemm_refuses_large_batches() -> None:
    q, scale = quantize_fp8_blocks(torch.randn((64, 128)), (1, 128))
    with pytest.raises(ValueError, match="at most"):
        weight_stream_matmul(
            torch.randn((SMALL_M + 1, 128)).to(DEVICE), q.to(DEVICE), scale.to(DEVICE), (1, 128)
        )


@pytest.mark.parametrize("k", [1500, 4096])
def test_per_token_quantization_one_pass_equals_two(k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows read once (held in registers) and rows read twice give the same bits."""
    from ominix_worker.ops import fused_moe

    gen = torch.Generator().manual_seed(k)
    x = (torch.randn((9, k), generator=gen) * torch.rand((9, 1), generator=gen) * 10).to(DTYPE).to(DEVICE)
    one_q, one_scale = quant_fp8_per_token(x)
    monkeypatch.setattr(fused_moe, "ONE_PASS_MAX_K", 0)
    two_q, two_scale = quant_fp8_per_token(x)
    assert torch.equal(one_scale, two_scale)
    assert torch.equal(one_q.view(torch.uint8), two_q.view(torch.uint8))


@pytest.mark.parametrize("n", [768, 1500])
def test_silu_and_mul_quantized_in_one_kernel(n: int) -> None:
    """The gated MLP's product goes straight to e4m3: the same bits as ``silu_and_mul`` then the row
    quantization."""
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn((9, 2 * n), generator=gen) * torch.rand((9, 1), generator=gen) * 4).to(DTYPE).to(DEVICE)
    q, scale = silu_and_mul_quant_fp8(x)
    want_q, want_scale = quant_fp8_per_token(silu_and_mul(x))
    assert q.shape == (9, n) and scale.shape == (9, 1)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("m", [1, 7, 37])
def test_per_token_quantization_in_one_kernel(m: int) -> None:
    """Scales are max|x| / 448 per row (as the torch formula computes them); q · scale reproduces x within e4m3
    rounding."""
    gen = torch.Generator().manual_seed(m)
    x = (torch.randn((m, 1500), generator=gen) * torch.rand((m, 1), generator=gen) * 10).to(DTYPE).to(DEVICE)
    q, scale = quant_fp8_per_token(x)
    assert q.shape == (m, 1500) and scale.shape == (m, 1)
    expected = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 448.0
    torch.testing.assert_close(scale, expected, rtol=1e-6, atol=0)
    assert _rel(q.float() * scale, x.float()) < 0.04 * _SLACK


@pytest.mark.parametrize(("k", "group"), [(768, 768), (768, 4096), (1500, 128), (96, 32)])
def test_group_quantization_of_any_width(k: int, group: int) -> None:
    """The grouped activation quantization of the FP8 GEMMs: power-of-two groups, or a whole row of any width when
    group >= K (as per-channel experts take); scales max|x| / 448 per group."""
    gen = torch.Generator().manual_seed(k + group)
    x = (torch.randn((5, k), generator=gen) * torch.rand((5, 1), generator=gen) * 10).to(DTYPE).to(DEVICE)
    q, scale = quant_fp8_per_token_group(x, group)
    width = min(group, k)
    assert q.shape == (5, k) and scale.shape == (5, -(-k // width))
    padded = torch.nn.functional.pad(x.float(), (0, scale.shape[1] * width - k)).view(5, -1, width)
    expected = padded.abs().amax(dim=-1).clamp(min=1e-10) / 448.0
    torch.testing.assert_close(scale, expected, rtol=1e-6, atol=0)
    per_column = scale.repeat_interleave(width, dim=1)[:, :k]
    assert _rel(q.float() * per_column, x.float()) < 0.04 * _SLACK


@pytest.mark.skipif(not FP8_GPU, reason="torch._scaled_mm needs an FP8 GPU")
@pytest.mark.parametrize("m", [1, 5, 16, 17, 64, 1000])
def test_per_channel_fp8_linear_vs_bf16(m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    linear = ColumnParallelLinear(2048, [3072], [ShardRange(0, 3072)], bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn((3072, 2048), generator=gen) / 2048**0.5)
        linear.bias.copy_(torch.randn(3072, generator=gen) * 0.1)
    linear = linear.to(torch.bfloat16).cuda()
    layer = Fp8ColumnParallelLinear.from_linear(linear, None)
    x = torch.randn((m, 2048), generator=gen).to(torch.bfloat16).cuda()
    with torch.no_grad():
        assert _rel(layer(x), linear(x)) < VS_BF16


@pytest.mark.skipif(not FP8_GPU, reason="torch._scaled_mm needs an FP8 GPU")
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per-channel", "block"])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 300])
def test_gated_down_projection_equals_the_unfused_one(block: tuple[int, int] | None, m: int) -> None:
    """``forward_gated`` (the MLP's down projection fed [gate | up]) gives the bits of ``forward`` on
    ``silu_and_mul``'s output: at every token count and scaling, fused or not."""
    gen = torch.Generator().manual_seed(m)
    linear = RowParallelLinear(1024, 512, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn((512, 1024), generator=gen) / 1024**0.5)
    layer = Fp8RowParallelLinear.from_linear(linear.to(torch.bfloat16).cuda(), block)
    gate_up = torch.randn((m, 2048), generator=gen).to(torch.bfloat16).cuda()
    with torch.no_grad():
        assert torch.equal(layer.forward_gated(gate_up, silu_and_mul), layer(silu_and_mul(gate_up)))


@pytest.mark.parametrize(("block", "tokens", "experts", "top_k"), [((128, 128), 9, 8, 2), (None, 33, 16, 4)])
def test_fp8_fused_experts_vs_bf16(
    block: tuple[int, int] | None, tokens: int, experts: int, top_k: int
) -> None:
    gen = torch.Generator().manual_seed(tokens)
    hidden, inter = 256, 128
    w13 = torch.randn((experts, 2 * inter, hidden), generator=gen) / hidden**0.5
    w2 = torch.randn((experts, hidden, inter), generator=gen) / inter**0.5
    x = torch.randn((tokens, hidden), generator=gen)
    weights, ids = select_experts(torch.randn((tokens, experts), generator=gen), top_k, renormalize=True)
    b13, b2 = block or (1, hidden), block or (1, inter)
    q13, s13 = quantize_fp8_blocks(w13, b13)
    q2, s2 = quantize_fp8_blocks(w2, b2)
    got = fused_experts(
        x.to(DTYPE).to(DEVICE), q13.to(DEVICE), q2.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE),
        s13.to(DEVICE), s2.to(DEVICE), b13, b2,
    )  # fmt: skip
    d13 = dequantize_fp8(q13, s13, b13, torch.float64)
    d2 = dequantize_fp8(q2, s2, b2, torch.float64)
    exact = fused_experts_ref(x.double(), lambda e: (d13[e], d2[e]), experts, weights.double(), ids)
    assert _rel(got, exact) < MOE_VS_DEQUANTIZED
    full = fused_experts_ref(
        x.double(), lambda e: (w13[e].double(), w2[e].double()), experts, weights.double(), ids
    )
    assert _rel(got, full) < MOE_VS_BF16


@pytest.mark.skipif(not FP8_GPU, reason="the whole runner on an FP8 GPU")
@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe"])
def test_fp8_checkpoint_runs_w8a8_on_the_gpu(model: str, tmp_path: Path) -> None:
    """An FP8 checkpoint written from a random model: the CUDA runner (W8A8 GEMMs, fused FP8 MoE, FP8 KV)
    stays within 20% (relative Frobenius norm of the last position's logits) of transformers on the
    dequantized weights; activation and KV rounding are the difference."""
    import transformers

    from ominix_runtime.contract import DecodeStep, NewRequestData, SamplingParams
    from ominix_worker.runner import build_runner
    from ominix_worker.testing import write_fp8_checkpoint, write_tiny_hf_model

    extra = (
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32) if model == "qwen3_moe" else {}
    )
    source = write_tiny_hf_model(tmp_path / "src", arch=model, seed=2, with_tokenizer=False, **extra)
    folder = write_fp8_checkpoint(source, tmp_path / "fp8", "block", block=32)  # 8-bit dots take K >= 32
    runner = build_runner(
        str(folder), device="cuda", dtype=torch.bfloat16, num_blocks=16, kv_cache_dtype="fp8_e4m3"
    )
    rows: list[torch.Tensor] = []
    compute = runner.model.compute_logits

    def record(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)
        rows.append(logits.float().cpu())
        return logits

    runner.model.compute_logits = record  # type: ignore[method-assign]  # records the logits
    tokens = [(13 * i + 4) % 300 + 3 for i in range(27)]
    greedy = SamplingParams(temperature=0.0)
    runner.execute_step(DecodeStep(1, new_requests=[NewRequestData("a", tokens, greedy, [1, 5], 0, 27, 0)]))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder / "dequantized", dtype=torch.float32)
    with torch.no_grad():
        want = reference.eval()(torch.tensor([tokens])).logits[0, -1]
    assert _rel(rows[0][0], want) < 0.2
