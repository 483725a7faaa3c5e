"""Times the Triton paged-attention, KV-store and fused elementwise kernels at W1-like shapes (Llama-3.1-8B:
32 query heads, 8 KV heads, head_dim 128, bf16, block size 16) against torch, and reports achieved bandwidth
against the measured device-to-device copy bandwidth.

    python bench/attention_kernels.py [--json out.json] [--quick] [--prefix-only]
    python bench/attention_kernels.py --overlap-decode   # can a decode step's attention hide under its GEMMs?
    python bench/attention_kernels.py --decode-grid-order   # the decode grid's two program orders, in turn
    python bench/attention_kernels.py --prefill-only 1x1024,8x512 --prefill-tiles '64,32,4,2;128,32,4,3'

Decode cases run the 32 layers of one step back to back from one CUDA graph (each layer owns its KV tensor, as
in the model, so nothing is served from L2 across layers) and report the time per layer. Torch SDPA baselines
read contiguous, unpaged K/V, which is the easier problem.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.* from the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))
import conftest  # noqa: E402,F401  (makes ominix_worker importable from a bare checkout)
from roofline import measure_copy_bandwidth, measure_matmul_rate  # noqa: E402

from bench.gemm_rows import SHAPES as LINEAR_SHAPES  # noqa: E402
from ominix_worker.attention.base import AttentionMetadata  # noqa: E402
from ominix_worker.attention.triton_paged import PREFILL_CONFIG, TritonPagedAttention, decode_num_splits  # noqa: E402
from ominix_worker.ops import fused  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16
KV_BYTES_PER_TOKEN_LAYER = 2 * KV_HEADS * HEAD_DIM * 2
ROWS: list[dict] = []


def _ms(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def _row(kind: str, case: str, ms: float, **extra: object) -> None:
    ROWS.append({"kind": kind, "case": case, "ms": ms, **extra})


def _captured(step: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """``step`` captured in a CUDA graph on a side stream, after one eager run (compiles, settles memory)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
        with torch.cuda.graph(graph, stream=stream):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def _after_prefix_mask(new: int, prefix: int) -> torch.Tensor:
    """SDPA's boolean mask for ``new`` queries after ``prefix`` cached keys (the bottom-right causal mask)."""
    visible_to = prefix + torch.arange(new, device="cuda")
    return torch.arange(prefix + new, device="cuda")[None, :] <= visible_to[:, None]


def paged_batch(q_lens: list[int], seq_lens: list[int], layers: int, gen: torch.Generator):
    """Random K/V in ``layers`` caches behind one random, non-contiguous block table."""
    blocks = [math.ceil(s / BLOCK) for s in seq_lens]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros((len(seq_lens), max(blocks)), dtype=torch.int32)
    slots = []
    cursor = 0
    for i, (q, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        ids = perm[cursor : cursor + blocks[i]]
        cursor += blocks[i]
        table[i, : blocks[i]] = ids.to(torch.int32)
        pos = torch.arange(s - q, s)
        slots.append(ids[pos // BLOCK] * BLOCK + pos % BLOCK)
    caches = [
        torch.randn((2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
        for _ in range(layers)
    ]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=qsl.cuda(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=table.cuda(),
        slot_mapping=torch.cat(slots).cuda(),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_decode_only=all(q == 1 for q in q_lens),
    )
    query = torch.randn((sum(q_lens), HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    return caches, meta, query


def gather_contiguous(
    cache: torch.Tensor, meta: AttentionMetadata, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, KVH, seq_len, D) K and V for equal-length requests, for SDPA and error checks."""
    b = meta.block_tables.shape[0]
    blocks = math.ceil(seq_len / BLOCK)
    k = cache[0][meta.block_tables[:, :blocks].long()].reshape(b, blocks * BLOCK, KV_HEADS, HEAD_DIM)[
        :, :seq_len
    ]
    v = cache[1][meta.block_tables[:, :blocks].long()].reshape(b, blocks * BLOCK, KV_HEADS, HEAD_DIM)[
        :, :seq_len
    ]
    return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_decode(
    batch: int,
    lo: int,
    hi: int,
    bandwidth: float,
    gen: torch.Generator,
    configs: list[tuple[int, int, int]] | None = None,
) -> None:
    """One decode case; with ``configs``, the graphed time of each (BLOCK_N, num_warps, num_stages) too, and its
    output's error against the default tile's."""
    seq_lens = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
    per_layer_bytes = sum(seq_lens) * KV_BYTES_PER_TOKEN_LAYER
    # 32 layers as in the model, fewer when that would not fit; each layer's KV is far larger than L2 then.
    layers = 32 if per_layer_bytes * 32 < 30e9 else max(2, int(30e9 // per_layer_bytes))
    caches, meta, query = paged_batch([1] * batch, seq_lens, layers, gen)
    backend = TritonPagedAttention(BLOCK)
    scale = HEAD_DIM**-0.5
    outs = [torch.empty_like(query) for _ in range(layers)]
    splits = decode_num_splits(
        batch, KV_HEADS, meta.max_seq_len, torch.cuda.get_device_properties(0).multi_processor_count
    )

    def step() -> None:
        for layer in range(layers):
            backend.forward_into(query, caches[layer], meta, scale, outs[layer])

    step()
    torch.cuda.synchronize()
    eager = _ms(step) / layers
    graphed = _ms(_captured(step).replay) / layers
    extra: dict[str, object] = {}
    if splits > 1:
        # Eager launches cost host time per kernel: compare the unsplit kernel (one launch, no merge).
        backend.decode_splits = 1
        step()
        extra["eager_ms_unsplit"] = _ms(step) / layers
        backend.decode_splits = None
    kv_bytes = per_layer_bytes + 2 * query.numel() * query.element_size()
    case = f"B={batch} ctx={lo}-{hi}" if lo != hi else f"B={batch} ctx={lo}"
    if lo == hi:
        k, v = gather_contiguous(caches[0], meta, lo)
        q4 = query.unsqueeze(2)  # (B, H, 1, D)
        ref = F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
        extra["err_vs_sdpa"] = rel_err(outs[0], ref.squeeze(2))
        sdpa = _ms(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))
        _row("decode", case, sdpa, impl="torch sdpa (contiguous KV, 1 layer)", gbps=kv_bytes / sdpa / 1e6)
    _row(
        "decode", case, graphed, impl=f"triton graph (splits={splits})", eager_ms=eager,
        gbps=kv_bytes / graphed / 1e6, frac_copy_bw=kv_bytes / (graphed * 1e-3) / bandwidth, **extra,
    )  # fmt: skip
    reference = outs[0].clone()
    for config in configs or []:
        backend.decode_config = config
        try:
            step()
            torch.cuda.synchronize()
            err = rel_err(outs[0], reference)
            tuned = _ms(_captured(step).replay) / layers
        except Exception as exc:  # noqa: BLE001 - a tile that does not fit is reported, not fatal
            _row("decode", case, float("nan"), impl=f"tile {config}: {type(exc).__name__}")
            continue
        finally:
            backend.decode_config = None
        _row(
            "decode", case, tuned, impl=f"triton graph, tile {config} (BLOCK_N, warps, stages)",
            gbps=kv_bytes / tuned / 1e6, frac_copy_bw=kv_bytes / (tuned * 1e-3) / bandwidth, err_vs_default=err,
        )  # fmt: skip


def bench_prefill(
    batch: int,
    new: int,
    prefix: int,
    flops: float,
    gen: torch.Generator,
    configs: list[tuple[int, int, int, int] | None],
) -> None:
    """``batch`` prompts of ``new`` tokens after ``prefix`` cached keys each. SDPA on contiguous K/V is the
    reference (eager, one layer timed again and again, so its K/V stays in L2); each tile is timed as a step
    runs it, 32 layers (a cache each, so the KV is not in L2 from the layer before) captured in one CUDA graph,
    per layer. One request's keys split as under capture, which splits shorter contexts than an eager step."""
    layers = 32
    q_lens = [new] * batch
    seq_lens = [prefix + new] * batch
    caches, meta, query = paged_batch(q_lens, seq_lens, layers, gen)
    scale = HEAD_DIM**-0.5
    pairs = batch * sum(prefix + m + 1 for m in range(new))
    work = 4 * HEADS * HEAD_DIM * pairs
    case = f"B={batch} new={new} prefix={prefix}"
    k, v = gather_contiguous(caches[0], meta, prefix + new)
    q4 = query.view(batch, new, HEADS, HEAD_DIM).transpose(1, 2)
    mask = _after_prefix_mask(new, prefix) if prefix else None

    def sdpa_fn() -> torch.Tensor:
        # Fresh prompts take SDPA's fused path (is_causal; cuDNN's kernel on an H200 with torch 2.11); a prefix
        # needs the bottom-right causal mask.
        return F.scaled_dot_product_attention(
            q4, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )

    ref = sdpa_fn()
    sdpa = _ms(sdpa_fn)
    _row("prefill", case, sdpa, impl="torch sdpa (contiguous KV)", tflops=work / sdpa / 1e9)
    if not prefix:
        bench_flash_varlen(case, query, caches, meta, batch, new, scale, work, ref)
    for config in configs:
        backend = TritonPagedAttention(BLOCK)
        backend.prefill_config = config
        out = torch.full_like(query, float("nan"))

        def step(b: TritonPagedAttention = backend, o: torch.Tensor = out) -> None:
            for cache in caches:
                b.forward_into(query, cache, meta, scale, o)

        try:
            graph = _captured(step)
        except Exception as exc:  # noqa: BLE001 - a tile that does not fit is reported, not fatal
            _row("prefill", case, float("nan"), impl=f"triton paged {config}: {type(exc).__name__}")
            continue
        backend.forward_into(query, caches[0], meta, scale, out)
        err = rel_err(out.view(batch, new, HEADS, HEAD_DIM).transpose(1, 2), ref)
        ms = _ms(graph.replay) / layers
        _row(
            "prefill",
            case,
            ms,
            impl="triton paged" if config is None else f"triton paged {config}",
            tflops=work / ms / 1e9,
            frac_matmul=work / (ms * 1e-3) / flops,
            err_vs_sdpa=err,
        )


def bench_flash_varlen(
    case: str,
    query: torch.Tensor,
    caches: list[torch.Tensor],
    meta: AttentionMetadata,
    batch: int,
    new: int,
    scale: float,
    work: float,
    ref: torch.Tensor,
) -> None:
    """Torch's FlashAttention varlen kernel on fresh prompts, timed as the Triton rows are (32 layers, each its
    own packed K/V, one CUDA graph): the kernel a prompt-only step could call with the step's own K and V."""
    flash = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if flash is None:
        _row("prefill", case, float("nan"), impl="torch flash varlen: not in this torch")
        return
    cu = torch.arange(0, (batch + 1) * new, new, device="cuda", dtype=torch.int32)
    packed = [gather_contiguous(cache, meta, new) for cache in caches]
    kv = [(k.transpose(1, 2).reshape(-1, KV_HEADS, HEAD_DIM), v.transpose(1, 2).reshape(-1, KV_HEADS, HEAD_DIM))
          for k, v in packed]  # fmt: skip

    def one(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flash(query, k, v, cu, cu, new, new, 0.0, True, False, scale=scale)[0]

    out = one(*kv[0])
    err = rel_err(out.view(batch, new, HEADS, HEAD_DIM).transpose(1, 2), ref)

    def step() -> None:
        for k, v in kv:
            one(k, v)

    ms = _ms(_captured(step).replay) / len(kv)
    _row("prefill", case, ms, impl="torch flash varlen (packed KV)", tflops=work / ms / 1e9, err_vs_sdpa=err)


# (new tokens, cached prefix) of one request: a prefix-hit suffix of a captured prefill graph.
PREFIX_SUFFIX_CASES = [(16, 2048), (64, 2048), (64, 8192)]


def bench_prefix_suffix(new: int, prefix: int, gen: torch.Generator) -> None:
    """One request's short query after a cached prefix (a prefix-hit suffix, as the captured prefill graphs
    run it): 32 layers from one CUDA graph, unsplit against the split count the backend picks under capture
    and a few fixed ones; time per layer."""
    layers = 32
    caches, meta, query = paged_batch([new], [prefix + new], layers, gen)
    scale = HEAD_DIM**-0.5
    case = f"B=1 new={new} prefix={prefix}"
    k, v = gather_contiguous(caches[0], meta, prefix + new)
    q4 = query.view(1, new, HEADS, HEAD_DIM).transpose(1, 2)
    mask = _after_prefix_mask(new, prefix)
    ref = F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    for splits in (1, None, 2, 4, 8):
        backend = TritonPagedAttention(BLOCK)
        backend.prefill_splits = splits
        outs = [torch.full_like(query, float("nan")) for _ in range(layers)]

        def step(b: TritonPagedAttention = backend, o: list[torch.Tensor] = outs) -> None:
            for layer in range(layers):
                b.forward_into(query, caches[layer], meta, scale, o[layer])

        graph = _captured(step)
        graph.replay()
        torch.cuda.synchronize()
        err = rel_err(outs[0].view(1, new, HEADS, HEAD_DIM).transpose(1, 2), ref)
        ms = _ms(graph.replay) / layers
        label = "picked" if splits is None else str(splits)
        _row("prefix", case, ms, impl=f"triton graph (splits={label})", err_vs_sdpa=err)


def bench_mixed(gen: torch.Generator) -> None:
    """A chunked-prefill step: 240 decode rows at context 512-768 plus two 512-token chunks."""
    q_lens = [1] * 240 + [512, 512]
    seq_lens = torch.randint(512, 769, (240,), generator=gen).tolist() + [512, 1024]
    caches, meta, query = paged_batch(q_lens, seq_lens, 1, gen)
    backend = TritonPagedAttention(BLOCK)
    out = torch.empty_like(query)
    fn = lambda: backend.forward_into(query, caches[0], meta, HEAD_DIM**-0.5, out)  # noqa: E731
    fn()
    _row("mixed", "240 decode + 2x512 chunk", _ms(fn), impl="triton general kernel")


def bench_store(tokens: int, bandwidth: float, gen: torch.Generator) -> None:
    seq_lens = [1] * tokens
    caches, meta, _ = paged_batch([1] * tokens, seq_lens, 1, gen)
    key = torch.randn((tokens, KV_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    value = torch.randn_like(key)
    moved = 2 * 2 * key.numel() * key.element_size()
    for impl, backend in (
        ("triton store", TritonPagedAttention(BLOCK)),
        ("index_copy_", TritonPagedAttention(BLOCK, store_with_index_copy=True)),
    ):
        fn = lambda b=backend: b.write_kv(caches[0], key, value, meta)  # noqa: E731
        fn()
        flat = caches[0].view(2, -1, KV_HEADS, HEAD_DIM)
        assert torch.equal(flat[0, meta.slot_mapping], key) and torch.equal(flat[1, meta.slot_mapping], value)
        ms = _ms(fn)
        _row(
            "write_kv",
            f"T={tokens}",
            ms,
            impl=impl,
            gbps=moved / ms / 1e6,
            frac_copy_bw=moved / (ms * 1e-3) / bandwidth,
        )


def bench_fused(tokens: int, bandwidth: float) -> None:
    hidden, ffn, eps = 4096, 14336, 1e-5
    x = torch.randn((tokens, hidden), dtype=DTYPE, device="cuda")
    residual = torch.randn_like(x)
    weight = torch.randn((hidden,), dtype=DTYPE, device="cuda")

    def torch_norm(v: torch.Tensor) -> torch.Tensor:
        v32 = v.float()
        return weight * (v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + eps)).to(v.dtype)

    def torch_add_norm() -> torch.Tensor:
        s = x + residual
        return torch_norm(s)

    nbytes = x.numel() * 2
    cases = [
        ("rms_norm", lambda: torch_norm(x), lambda: fused.rms_norm(x, weight, eps), 2 * nbytes),
        (
            "add+rms_norm",
            torch_add_norm,
            lambda: fused.fused_add_rms_norm(x, residual.clone(), weight, eps),
            4 * nbytes,
        ),
    ]
    gate_up = torch.randn((tokens, 2 * ffn), dtype=DTYPE, device="cuda")
    g, u = gate_up.split(ffn, dim=-1)
    cases.append(
        ("silu_and_mul", lambda: F.silu(g) * u, lambda: fused.silu_and_mul(gate_up), 3 * tokens * ffn * 2)
    )
    q = torch.randn((tokens, HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    k = torch.randn((tokens, KV_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
    emb = torch.outer(torch.arange(8192, device="cuda").float(), inv)
    emb = torch.cat((emb, emb), -1)
    cos_sin = torch.stack((emb.cos(), emb.sin())).contiguous()

    def torch_rope() -> tuple[torch.Tensor, torch.Tensor]:
        cos = cos_sin[0, positions].unsqueeze(1).to(q.dtype)
        sin = cos_sin[1, positions].unsqueeze(1).to(q.dtype)

        def rot(t: torch.Tensor) -> torch.Tensor:
            h = t.shape[-1] // 2
            return torch.cat((-t[..., h:], t[..., :h]), dim=-1)

        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    def triton_rope() -> None:
        fused.rotary_in_place(q, positions, cos_sin)
        fused.rotary_in_place(k, positions, cos_sin)

    cases.append(("rotary q+k", torch_rope, triton_rope, 2 * (q.numel() + k.numel()) * 2))
    # Correctness against the torch formulas before timing.
    err_norm = rel_err(fused.rms_norm(x, weight, eps), torch_norm(x))
    err_silu = rel_err(fused.silu_and_mul(gate_up), F.silu(g) * u)
    qr, kr = torch_rope()
    fused.rotary_in_place(q, positions, cos_sin)
    fused.rotary_in_place(k, positions, cos_sin)
    err_rope = max(rel_err(q, qr), rel_err(k, kr))
    errs = {"rms_norm": err_norm, "add+rms_norm": err_norm, "silu_and_mul": err_silu, "rotary q+k": err_rope}
    for name, torch_fn, triton_fn, moved in cases:
        t_ms = _ms(torch_fn)
        f_ms = _ms(triton_fn)
        _row("fused", f"{name} T={tokens}", t_ms, impl="torch")
        _row(
            "fused", f"{name} T={tokens}", f_ms, impl="triton", speedup=t_ms / f_ms,
            frac_copy_bw=moved / (f_ms * 1e-3) / bandwidth, err_vs_torch=errs[name],
        )  # fmt: skip


def _print_rows() -> None:
    print(f"{'kind':9} {'case':32} {'impl':34} {'ms':>9}  extra")
    for r in ROWS:
        extra = {
            k: (round(v, 4) if isinstance(v, float) else v)
            for k, v in r.items()
            if k not in ("kind", "case", "ms", "impl")
        }
        print(f"{r['kind']:9} {r['case']:32} {r['impl']:34} {r['ms']:9.4f}  {extra}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write every row to this file")
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    tiles = parser.add_mutually_exclusive_group()
    tiles.add_argument("--sweep-prefill", action="store_true", help="time several prefill tile configs")
    tiles.add_argument(
        "--prefill-tiles",
        default=None,
        metavar="TILES",
        help="time these prefill tiles beside the default, e.g. '64,32,4,2;128,32,4,3' "
        "(BLOCK_M,BLOCK_N,warps,stages; quoted: ; ends a shell command)",
    )
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--prefix-only", action="store_true", help="only the prefix-hit suffix cases")
    only.add_argument(
        "--prefill-only",
        default=None,
        metavar="CASES",
        help="only these prefill cases, e.g. 1x1024,4x1024,12x512,1x512+2048 (requests x prompt tokens, + "
        "cached prefix tokens); with --sweep-prefill or --prefill-tiles, each over those tiles",
    )
    only.add_argument(
        "--overlap-decode",
        action="store_true",
        help="only a decode step's two halves (B=256, 32 layers): its attention, its layer GEMMs, and both "
        "launched at once on two streams, as two micro-batches would overlap them",
    )
    only.add_argument(
        "--decode-grid-order",
        action="store_true",
        help="only the batch-256 decode cases, each timed with the KV heads of one request launched together "
        "and with one KV head of every request together, alternately",
    )
    only.add_argument(
        "--sweep-decode",
        action="store_true",
        help="only the batch-256 decode cases, each with several (BLOCK_N, num_warps, num_stages) tiles, and "
        "the read-only bandwidth of a reduction beside the copy bandwidth",
    )
    args = parser.parse_args(argv)
    prefill_cases = parse_prefill_cases(parser, args.prefill_only) if args.prefill_only is not None else []
    tile_list = parse_prefill_tiles(parser, args.prefill_tiles) if args.prefill_tiles is not None else None
    if tile_list and (args.prefix_only or args.sweep_decode or args.overlap_decode):
        parser.error("--prefill-tiles times prefill cases: the default run's or --prefill-only's")
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(0)
    bandwidth = measure_copy_bandwidth()
    flops = measure_matmul_rate()
    print(
        f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.3f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s"
    )
    if args.sweep_decode:
        sweep_decode(bandwidth, gen)
    elif args.decode_grid_order:
        for lo, hi in [(536, 536), (640, 640), (768, 768), (512, 768)]:
            decode_grid_order(256, lo, hi, bandwidth, gen)
    elif args.overlap_decode:
        overlap_decode(gen)
    elif prefill_cases:
        for batch, new, prefix in prefill_cases:
            bench_prefill(batch, new, prefix, flops, gen, prefill_configs(args.sweep_prefill, tile_list))
    elif args.prefix_only:
        for new, prefix in PREFIX_SUFFIX_CASES:
            bench_prefix_suffix(new, prefix, gen)
    else:
        run_all(args, bandwidth, flops, gen, tile_list)
    _print_rows()
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "bandwidth": bandwidth, "flops": flops}
        Path(args.json).write_text(json.dumps({**meta, "rows": ROWS}, indent=2))
    return 0


DECODE_TILES: list[tuple[int, int, int]] = [
    (block_n, warps, stages) for block_n in (32, 64, 128) for warps in (2, 4, 8) for stages in (2, 3, 4)
]


def sweep_decode(bandwidth: float, gen: torch.Generator) -> None:
    """The W1 decode shapes with every tile of DECODE_TILES, and what a plain read reaches on this card."""
    data = torch.empty(2 << 30, dtype=torch.uint8, device="cuda").view(torch.bfloat16).normal_()
    read = _ms(lambda: data.sum(dtype=torch.float32))
    _row("read", "2 GiB bf16 sum", read, impl="torch sum (read only)", gbps=(2 << 30) / read / 1e6)
    data = torch.empty(0, device="cuda")  # frees the 2 GiB before the decode cases
    for batch, lo, hi in [(256, 512, 768), (256, 768, 768)]:
        bench_decode(batch, lo, hi, bandwidth, gen, DECODE_TILES)


def decode_grid_order(
    batch: int, lo: int, hi: int, bandwidth: float, gen: torch.Generator, layers: int = 32, rounds: int = 2
) -> None:
    """The decode kernel with its programs in either order, ``rounds`` times each, alternately: heads first (the
    KV heads of one request run together, so together they read its tokens' whole K/V rows) or requests first
    (one KV head of many requests together, each reading a slice of every row). The outputs must agree
    exactly: each program computes the same thing in either order."""
    seq_lens = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
    caches, meta, query = paged_batch([1] * batch, seq_lens, layers, gen)
    kv_bytes = sum(seq_lens) * KV_BYTES_PER_TOKEN_LAYER
    backend = TritonPagedAttention(BLOCK)
    backend.decode_splits = 1
    outs = [torch.empty_like(query) for _ in range(layers)]

    def step() -> None:
        for layer in range(layers):
            backend.forward_into(query, caches[layer], meta, HEAD_DIM**-0.5, outs[layer])

    graphs: dict[bool, torch.cuda.CUDAGraph] = {}
    results: dict[bool, torch.Tensor] = {}
    for heads_first in (True, False):
        backend.decode_heads_first = heads_first
        for out in outs:  # a launch that wrote nothing would keep the other order's values otherwise
            out.fill_(float("nan"))
        step()
        torch.cuda.synchronize()
        results[heads_first] = outs[0].clone()
        graphs[heads_first] = _captured(step)
    backend.decode_heads_first = True
    case = f"B={batch} ctx={lo}-{hi}" if lo != hi else f"B={batch} ctx={lo}"
    mismatch = (results[True] != results[False]).sum().item()  # NaN never equals: an unwritten row counts
    for r in range(rounds):
        for heads_first, graph in graphs.items():
            ms = _ms(graph.replay) / layers
            _row(
                "decode", case, ms, impl=f"{'heads' if heads_first else 'requests'} first, round {r + 1}",
                gbps=kv_bytes / ms / 1e6, frac_copy_bw=kv_bytes / (ms * 1e-3) / bandwidth,
                elements_differing=mismatch,
            )  # fmt: skip


def overlap_decode(
    gen: torch.Generator, batch: int = 256, layers: int = 32, lo: int = 512, hi: int = 768
) -> None:
    """Whether a decode step's two halves can overlap: its paged attention reads the KV at the card's bandwidth,
    its layer GEMMs (M = batch) are nearer the tensor cores' rate, and a step split into two micro-batches could
    run one half's attention beside the other half's GEMMs. Times, each from one CUDA graph of ``layers``
    layers (distinct weights and KV per layer, as in the model): the attention alone, the GEMMs alone (at M =
    batch and at two M = batch / 2), and the attention and the GEMMs launched at once on two streams with no
    dependency between them (an upper bound on what the split could hide; the real one also waits per layer).
    ``hidden`` is the share of the shorter part that the concurrent run saved."""
    seq_lens = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
    caches, meta, query = paged_batch([1] * batch, seq_lens, layers, gen)
    backend = TritonPagedAttention(BLOCK)
    scale = HEAD_DIM**-0.5
    outs = [torch.empty_like(query) for _ in range(layers)]
    weights = [
        [torch.randn(n, k, device="cuda", dtype=DTYPE) / k**0.5 for _, n, k in LINEAR_SHAPES]
        for _ in range(layers)
    ]
    xs = {
        m: [torch.randn(m, k, device="cuda", dtype=DTYPE) for _, _, k in LINEAR_SHAPES]
        for m in (batch, batch // 2)
    }

    def attention() -> None:
        for layer in range(layers):
            backend.forward_into(query, caches[layer], meta, scale, outs[layer])

    def gemms(m: int) -> Callable[[], None]:
        def run() -> None:
            for layer in range(layers):
                for x, w in zip(xs[m], weights[layer], strict=True):
                    torch.nn.functional.linear(x, w)

        return run

    def halves() -> None:
        gemms(batch // 2)()
        gemms(batch // 2)()

    side = torch.cuda.Stream()

    def concurrent() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            attention()
        gemms(batch)()
        torch.cuda.current_stream().wait_stream(side)

    attention()
    torch.cuda.synchronize()
    a = _ms(_captured(attention).replay)
    g = _ms(_captured(gemms(batch)).replay)
    g2 = _ms(_captured(halves).replay)
    both = _ms(_captured(concurrent).replay)
    case = f"B={batch} ctx={lo}-{hi}, {layers} layers"
    _row("overlap", case, a, impl="paged attention alone")
    _row("overlap", case, g, impl=f"layer GEMMs alone, M={batch}")
    _row("overlap", case, g2, impl=f"layer GEMMs alone, 2 x M={batch // 2}")
    _row("overlap", case, a + g, impl="attention then GEMMs (sum)")
    _row(
        "overlap", case, both, impl="attention beside GEMMs, two streams",
        hidden=(a + g - both) / min(a, g),
    )  # fmt: skip


def _is_count(text: str) -> bool:
    """ASCII digits, spaces around them allowed (``str.isdigit`` alone also takes digits ``int`` refuses)."""
    text = text.strip()
    return text.isascii() and text.isdigit()


def parse_prefill_cases(parser: argparse.ArgumentParser, spec: str) -> list[tuple[int, int, int]]:
    """``1x1024,12x512,1x512+2048`` -> [(1, 1024, 0), (12, 512, 0), (1, 512, 2048)] (requests x prompt tokens,
    + cached prefix tokens); a malformed case is a usage error."""
    cases = []
    for case in spec.split(","):
        shape, _, prefix = case.partition("+")
        parts = shape.split("x")
        if (
            len(parts) != 2
            or not all(_is_count(p) and int(p) > 0 for p in parts)
            or (prefix and not _is_count(prefix))
        ):
            parser.error(
                f"--prefill-only: {case!r} is not REQUESTSxTOKENS[+PREFIX], e.g. 4x1024 or 1x512+2048"
            )
        cases.append((int(parts[0]), int(parts[1]), int(prefix or 0)))
    return cases


def parse_prefill_tiles(parser: argparse.ArgumentParser, spec: str) -> list[tuple[int, int, int, int]]:
    """``64,32,4,2;128,32,4,3`` -> [(64, 32, 4, 2), (128, 32, 4, 3)]; a malformed tile is a usage error."""
    tiles = []
    for tile in spec.split(";"):
        parts = tile.split(",")
        if len(parts) != 4 or not all(_is_count(p) and int(p) > 0 for p in parts):
            parser.error(f"--prefill-tiles: {tile!r} is not BLOCK_M,BLOCK_N,WARPS,STAGES, e.g. 64,32,4,2")
        tiles.append((int(parts[0]), int(parts[1]), int(parts[2]), int(parts[3])))
    return tiles


def prefill_configs(
    sweep: bool, chosen: list[tuple[int, int, int, int]] | None = None
) -> list[tuple[int, int, int, int] | None]:
    """The prefill tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) to time, None for the backend's default:
    the default, then ``chosen`` or with ``sweep`` every other tile of the sweep."""
    configs: list[tuple[int, int, int, int] | None] = [None]
    configs += [tile for tile in dict.fromkeys(chosen or []) if tile != PREFILL_CONFIG]  # the default once
    if sweep:
        configs += [
            (block_m, block_n, warps, stages)
            for block_m in (64, 128)
            for block_n in (32, 64, 128)
            for warps in (4, 8)
            for stages in (1, 2, 3)
            if (block_m, block_n, warps, stages) != PREFILL_CONFIG  # the default, timed as None
        ]
    return configs


def run_all(
    args: argparse.Namespace,
    bandwidth: float,
    flops: float,
    gen: torch.Generator,
    tiles: list[tuple[int, int, int, int]] | None = None,
) -> None:
    decode_cases = [(1, 512, 512), (64, 768, 768), (256, 768, 768)]
    if not args.quick:
        decode_cases = [(1, 512, 512), (1, 768, 768), (64, 512, 512), (64, 768, 768), (256, 512, 512)]
        decode_cases += [(256, 768, 768), (256, 512, 768), (32, 4096, 4096)]
    for batch, lo, hi in decode_cases:
        bench_decode(batch, lo, hi, bandwidth, gen)
    configs = prefill_configs(args.sweep_prefill, tiles)
    for batch, new, prefix in [(1, 512, 0), (16, 512, 0), (1, 512, 2048), (16, 512, 2048)]:
        bench_prefill(batch, new, prefix, flops, gen, configs)
    for new, prefix in PREFIX_SUFFIX_CASES:
        bench_prefix_suffix(new, prefix, gen)
    bench_mixed(gen)
    for tokens in (256, 8192):
        bench_store(tokens, bandwidth, gen)
        bench_fused(tokens, bandwidth)


if __name__ == "__main__":
    sys.exit(main())
