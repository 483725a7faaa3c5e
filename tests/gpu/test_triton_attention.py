"""Triton paged attention vs a float64 attention computed from scratch, on random ragged paged batches.

Runs on CUDA; with TRITON_INTERPRET=1 it also runs (slowly) on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import math
import sys
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import conftest  # noqa: F401  (aliases ominix_worker when run as a plain script)

from triton_target import INTERPRET, triton_device  # noqa: E402

DEVICE = triton_device()

from ominix_worker.attention.base import AttentionMetadata  # noqa: E402
from ominix_worker.attention.triton_paged import TritonPagedAttention, prefill_num_splits  # noqa: E402
from ominix_worker.devices import sm_count  # noqa: E402

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 1.5e-2, torch.float16: 4e-3, torch.float32: 1e-3}


@dataclass(slots=True)
class Batch:
    query: torch.Tensor  # (T, H, D)
    new_key: torch.Tensor  # (T, KVH, D)
    new_value: torch.Tensor
    keys: list[torch.Tensor]  # per request (seq_len, KVH, D), float64
    values: list[torch.Tensor]
    q_lens: list[int]
    seq_lens: list[int]
    kv_cache: torch.Tensor
    meta: AttentionMetadata


def make_batch(
    gen: torch.Generator,
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    backend: TritonPagedAttention,
    num_blocks: int | None = None,
    max_blocks: int | None = None,
) -> Batch:
    """Context tokens go straight into a NaN-poisoned cache through random, non-contiguous block tables;
    this step's tokens go in through ``write_kv``. Any read of an unwritten slot turns the output NaN."""
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = num_blocks or sum(blocks_per_seq) + 7
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max_blocks or max(blocks_per_seq) + 2
    block_tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    cursor = 0
    kv_cache = backend.allocate_kv_cache(1, num_blocks, num_kv_heads, head_dim, dtype, torch.device(DEVICE))[
        0
    ]
    kv_cache.fill_(float("nan"))
    keys, values, queries, new_keys, new_values, slots = [], [], [], [], [], []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        ids = perm[cursor : cursor + blocks_per_seq[i]]
        cursor += blocks_per_seq[i]
        block_tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn((seq_len, num_kv_heads, head_dim), generator=gen).to(dtype)
        v = torch.randn((seq_len, num_kv_heads, head_dim), generator=gen).to(dtype)
        q = torch.randn((q_len, num_heads, head_dim), generator=gen).to(dtype)
        pos = torch.arange(seq_len)
        flat = torch.tensor(ids, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size
        context = seq_len - q_len
        cache_flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
        cache_flat[0, flat[:context].to(DEVICE)] = k[:context].to(DEVICE)
        cache_flat[1, flat[:context].to(DEVICE)] = v[:context].to(DEVICE)
        keys.append(k.double())
        values.append(v.double())
        queries.append(q)
        new_keys.append(k[context:])
        new_values.append(v[context:])
        slots.append(flat[context:])
    qsl = [0]
    for q_len in q_lens:
        qsl.append(qsl[-1] + q_len)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        slot_mapping=torch.cat(slots).to(DEVICE),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_decode_only=all(q == 1 for q in q_lens),
        query_start_loc_cpu=qsl,  # as the runner builds an eager step's metadata
        seq_lens_cpu=list(seq_lens),
    )
    return Batch(
        query=torch.cat(queries).to(DEVICE),
        new_key=torch.cat(new_keys).to(DEVICE),
        new_value=torch.cat(new_values).to(DEVICE),
        keys=keys,
        values=values,
        q_lens=q_lens,
        seq_lens=seq_lens,
        kv_cache=kv_cache,
        meta=meta,
    )


def reference(batch: Batch, scale: float) -> list[torch.Tensor]:
    """Causal attention per request in float64; query row m sits at position seq_len - q_len + m."""
    outs = []
    start = 0
    num_heads = batch.query.shape[1]
    for q_len, seq_len, k, v in zip(batch.q_lens, batch.seq_lens, batch.keys, batch.values, strict=True):
        q = batch.query[start : start + q_len].double().cpu()
        start += q_len
        group = num_heads // k.shape[1]
        kh = k.repeat_interleave(group, dim=1)  # (L, H, D)
        vh = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("mhd,nhd->hmn", q, kh) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        visible = torch.arange(seq_len)[None, :] <= q_pos
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hmn,nhd->mhd", torch.softmax(scores, dim=-1), vh))
    return outs


def check(batch: Batch, out: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any(), "unwritten (poisoned) or NaN output elements"
    ref = reference(batch, 1.0 / math.sqrt(batch.query.shape[-1]))
    start = 0
    got_all = out.double().cpu()
    for i, r in enumerate(ref):
        got = got_all[start : start + r.shape[0]]
        start += r.shape[0]
        err = ((got - r).norm() / r.norm()).item()
        assert err < TOLERANCE[dtype], (
            f"request {i} (q_len {batch.q_lens[i]}, seq_len {batch.seq_lens[i]}): {err:.2e}"
        )


def run_case(
    seed: int,
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    decode_splits: int | None = None,
    force_general: bool = False,
    backend_attrs: dict[str, object] | None = None,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    backend = TritonPagedAttention(block_size=block_size)
    backend.decode_splits = decode_splits
    for name, value in (backend_attrs or {}).items():
        assert hasattr(backend, name), name  # a renamed attribute must not silently test the default
        setattr(backend, name, value)
    batch = make_batch(gen, q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, backend)
    if force_general:
        batch.meta.num_decode_only = False
    backend.write_kv(batch.kv_cache, batch.new_key, batch.new_value, batch.meta)
    flat = batch.kv_cache.view(2, -1, num_kv_heads, head_dim)
    assert torch.equal(flat[0, batch.meta.slot_mapping], batch.new_key)
    assert torch.equal(flat[1, batch.meta.slot_mapping], batch.new_value)
    out = torch.full_like(batch.query, float("nan"))
    backend.forward_into(batch.query, batch.kv_cache, batch.meta, 1.0 / math.sqrt(head_dim), out)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    check(batch, out, dtype)


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _ragged(gen: torch.Generator, n: int, low: int, high: int) -> list[int]:
    return torch.randint(low, high + 1, (n,), generator=gen).tolist()


DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (num_heads, num_kv_heads, head_dim): GQA ratios 1, 4 and 8; the last one is Llama-3.1-8B's.
SHAPES = [(4, 4, 64), (8, 2, 128), (16, 2, 64), (32, 8, 128)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_decode(dtype: torch.dtype, shape: tuple[int, int, int], splits: int | None) -> None:
    seed = zlib.crc32(f"{dtype}{shape}{splits}".encode()) % 10_000
    gen = torch.Generator().manual_seed(seed)
    num_requests = 6 if INTERPRET else 37
    seq_lens = _ragged(gen, num_requests, 1, 90 if INTERPRET else 800)
    seq_lens[0] = 1  # a request whose only token is the new one
    run_case(seed, [1] * num_requests, seq_lens, *shape, block_size=16, dtype=dtype, decode_splits=splits)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "mixed"])
def test_decode_grid_in_requests_first_order(splits: int, mixed: bool) -> None:
    """The comparison order of the decode grid (one KV head of every request first) attends as the default
    does, in a pure decode step and beside a prompt (where the decode kernel serves the single-token rows)."""
    gen = torch.Generator().manual_seed(17 + splits)
    seq_lens = _ragged(gen, 11, 1, 90 if INTERPRET else 700)
    q_lens = [1] * 11
    if mixed:
        q_lens[3], seq_lens[3] = 24, max(seq_lens[3], 24)
    attrs = {"decode_heads_first": False, "decode_rows_in_prefill": False}
    run_case(23, q_lens, seq_lens, 32, 8, 128, 16, torch.bfloat16, decode_splits=splits, backend_attrs=attrs)


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_decode_block_sizes(block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    seq_lens = _ragged(gen, 9, 1, 100 if INTERPRET else 1500)
    run_case(block_size, [1] * 9, seq_lens, 32, 8, 128, block_size, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("long_decode", [False, True], ids=["rows-in-prefill", "decode-kernel"])
def test_mixed_batch(dtype: torch.dtype, shape: tuple[int, int, int], long_decode: bool) -> None:
    """Decode rows, fresh prefills, chunks after a prefix not a multiple of the block size, in one step. With
    ``long_decode`` one decode row's context outgrows every prompt-side request, so the decode kernel serves
    the decode rows; otherwise they ride in the prefill kernel's launch."""
    seed = zlib.crc32(f"{dtype}{shape}mixed{long_decode}".encode()) % 10_000
    gen = torch.Generator().manual_seed(seed)
    scale = 1 if INTERPRET else 4
    q_lens = [1, 1, 37 * scale, 1, 64 * scale, 5, 70 * scale + 3, 1]
    prefix = [0, 13, 0, (200 if long_decode else 90) * scale, 0, 33, 50 * scale + 7, 1]
    prefix = [
        p + (0 if q > 1 or p > 0 else _ragged(gen, 1, 1, 60)[0]) for q, p in zip(q_lens, prefix, strict=True)
    ]
    seq_lens = [p + q for p, q in zip(prefix, q_lens, strict=True)]
    longest_decode = max(s for q, s in zip(q_lens, seq_lens, strict=True) if q == 1)
    longest_prefill = max(s for q, s in zip(q_lens, seq_lens, strict=True) if q > 1)
    assert (longest_decode > longest_prefill) == long_decode
    run_case(seed, q_lens, seq_lens, *shape, block_size=16, dtype=dtype)


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_prefill_with_prefix_block_sizes(block_size: int) -> None:
    gen = torch.Generator().manual_seed(100 + block_size)
    n = 3 if INTERPRET else 5
    q_lens = _ragged(gen, n, 1, 40 if INTERPRET else 300)
    prefix = _ragged(gen, n, 0, 40 if INTERPRET else 700)
    seq_lens = [p + q for p, q in zip(prefix, q_lens, strict=True)]
    run_case(100 + block_size, q_lens, seq_lens, 32, 8, 128, block_size, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_general_path_on_all_decode_batch(dtype: torch.dtype) -> None:
    """A step of single-token requests that the runner did not flag as decode-only."""
    gen = torch.Generator().manual_seed(7)
    seq_lens = _ragged(gen, 11, 1, 90 if INTERPRET else 700)
    run_case(7, [1] * 11, seq_lens, 32, 8, 128, 16, dtype, force_general=True)


PREFILL_CONFIGS = [
    (64, 64, 4, 3),
    (64, 64, 8, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (64, 128, 4, 3),
    (128, 32, 8, 3),
]


@pytest.mark.parametrize("config", PREFILL_CONFIGS, ids=str)
@pytest.mark.parametrize("splits", [None, 4, "in-prefill"])
def test_mixed_batch_tile_configs(config: tuple[int, int, int, int], splits: int | str | None) -> None:
    """Every prefill tile shape the benchmark may pick, with decode rows beside it: split and unsplit in the
    decode kernel, and in the prefill kernel's launch."""
    if INTERPRET and config[0] > 64:
        pytest.skip("slow in the interpreter")
    seed = zlib.crc32(f"{config}{splits}".encode()) % 10_000
    gen = torch.Generator().manual_seed(seed)
    n = 12
    q_lens = [1 if i % 3 else int(q) for i, q in enumerate(_ragged(gen, n, 2, 60 if INTERPRET else 700))]
    prefix = _ragged(gen, n, 0, 80 if INTERPRET else 2100)
    seq_lens = [p + q for p, q in zip(prefix, q_lens, strict=True)]
    in_prefill = splits == "in-prefill"
    if in_prefill:  # no decode row's context longer than the longest prompt-side request's
        longest = max(s for q, s in zip(q_lens, seq_lens, strict=True) if q > 1)
        seq_lens = [min(s, longest) if q == 1 else s for q, s in zip(q_lens, seq_lens, strict=True)]
    attrs: dict[str, object] = {"prefill_config": config, "decode_rows_in_prefill": in_prefill}
    decode_splits = splits if isinstance(splits, int) else None
    run_case(seed, q_lens, seq_lens, 32, 8, 128, 16, torch.float16, decode_splits, backend_attrs=attrs)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_cuda_graph_replays_with_new_lengths_and_tables(splits: int) -> None:
    """One captured decode step stays correct when lengths, block tables, queries and KV change in place."""
    num_requests, block_size, max_len = 8, 16, 600
    num_blocks, max_blocks = (
        num_requests * math.ceil(max_len / block_size) + 7,
        math.ceil(max_len / block_size),
    )
    backend = TritonPagedAttention(block_size=block_size)
    backend.decode_splits = splits
    gen = torch.Generator().manual_seed(splits)

    def batch() -> Batch:
        seq_lens = _ragged(gen, num_requests, 1, max_len)
        shape = (32, 8, 128, block_size, torch.bfloat16, backend, num_blocks, max_blocks)
        b = make_batch(gen, [1] * num_requests, seq_lens, *shape)
        backend.write_kv(b.kv_cache, b.new_key, b.new_value, b.meta)
        return b

    static = batch()
    out = torch.full_like(static.query, float("nan"))
    scale = 1.0 / math.sqrt(128)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward_into(
            static.query, static.kv_cache, static.meta, scale, out
        )  # compile outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            backend.forward_into(static.query, static.kv_cache, static.meta, scale, out)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        fresh = batch()
        static.kv_cache.copy_(fresh.kv_cache)
        static.query.copy_(fresh.query)
        static.meta.seq_lens.copy_(fresh.meta.seq_lens)
        static.meta.block_tables.copy_(fresh.meta.block_tables)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(fresh, out, torch.bfloat16)


def test_padded_decode_slot_is_skipped() -> None:
    """A negative slot (graph filler row) stores nothing; the other rows still land."""
    backend = TritonPagedAttention(block_size=16)
    kv = backend.allocate_kv_cache(1, 4, 2, 64, torch.bfloat16, torch.device(DEVICE))[0]
    kv.fill_(float("nan"))
    key = torch.randn((3, 2, 64)).to(torch.bfloat16).to(DEVICE)
    value = torch.randn((3, 2, 64)).to(torch.bfloat16).to(DEVICE)
    slots = torch.tensor([5, -1, 40], dtype=torch.int64, device=DEVICE)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(4, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.ones(3, dtype=torch.int32, device=DEVICE),
        block_tables=torch.zeros((3, 1), dtype=torch.int32, device=DEVICE),
        slot_mapping=slots,
        max_query_len=1,
        max_seq_len=1,
        num_decode_only=True,
    )
    backend.write_kv(kv, key, value, meta)
    flat = kv.view(2, -1, 2, 64)
    assert torch.equal(flat[0, 5], key[0]) and torch.equal(flat[1, 40], value[2])
    assert int((~torch.isnan(flat.float())).sum()) == 2 * 2 * 2 * 64


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", *sys.argv[1:]]))


# The interpreter computes 16-bit dots wrongly; it checks the split arithmetic in float32.
SPLIT_DTYPE = torch.float32 if INTERPRET else torch.bfloat16


@pytest.mark.parametrize("q_len", [2, 17, 64])
@pytest.mark.parametrize("splits", [None, 2, 4, 16])
def test_single_request_prefill_splits(q_len: int, splits: int | None) -> None:
    """One request's short query over a long prefix, its keys split across programs and merged; 16 splits
    leave some of them without a key. None is the backend's own choice."""
    prefix = 300 if INTERPRET else 2100
    seed = zlib.crc32(f"prefill-split{q_len}{splits}".encode()) % 10_000
    attrs: dict[str, object] = {"prefill_splits": splits}
    run_case(seed, [q_len], [prefix + q_len], 32, 8, 128, 16, SPLIT_DTYPE, backend_attrs=attrs)


def test_split_prefill_leaves_padding_rows_alone() -> None:
    """A captured prefill runs a padded query buffer: rows past the request's query stay unwritten."""
    q_len, padded = 23, 64
    gen = torch.Generator().manual_seed(5)
    backend = TritonPagedAttention(block_size=16)
    backend.prefill_splits = 4
    batch = make_batch(gen, [q_len], [400 + q_len], 32, 8, 128, 16, SPLIT_DTYPE, backend)
    backend.write_kv(batch.kv_cache, batch.new_key, batch.new_value, batch.meta)
    query = torch.zeros((padded, 32, 128), dtype=SPLIT_DTYPE, device=DEVICE)
    query[:q_len] = batch.query
    out = torch.full_like(query, float("nan"))
    batch.meta.max_query_len = padded
    backend.forward_into(query, batch.kv_cache, batch.meta, 1.0 / math.sqrt(128), out)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.isnan(out[q_len:]).all()
    check(batch, out[:q_len], SPLIT_DTYPE)


def test_prefill_split_count_fills_the_gpu_without_short_splits() -> None:
    assert prefill_num_splits(32, 2112, num_sms=132) == 8  # 64 rows x 32 heads: 264 programs wanted
    assert prefill_num_splits(32, 1024, num_sms=132) == 4  # capped at 256 keys a split
    assert prefill_num_splits(32, 200, num_sms=132) == 1  # too short to split
    assert prefill_num_splits(132, 100_000, num_sms=132) == 1  # the programs fill the GPU already
    assert prefill_num_splits(8, 100_000, num_sms=132) == 32  # never more than the merge kernel takes
    assert prefill_num_splits(32, 8192, num_sms=132, min_tokens_per_split=1024) == 8
    for programs in range(1, 140):
        n = prefill_num_splits(programs, 4096, num_sms=132)
        assert (n & (n - 1)) == 0  # a power of two
        assert n == 1 or (programs < 132 and n * 256 <= 4096)


# Decode rows whose programs (2 KV heads each) outnumber the SMs, so the decode kernel keeps them.
_MANY = sm_count(torch.device(DEVICE), off_gpu=132) // 2 + 4


def _count_decode_launches(backend: TritonPagedAttention, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """A list that grows by one each time ``backend`` launches its decode kernel."""
    launched: list[bool] = []
    decode = backend._decode

    def counting_decode(*args: object, **kwargs: object) -> None:
        launched.append(True)
        decode(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(backend, "_decode", counting_decode)
    return launched


@pytest.mark.parametrize(
    ("q_lens", "seq_lens", "decode_launches"),
    [
        ([1, 1, 300, 1, 40], [120, 300, 300, 7, 90], 0),  # every decode row within the longest prompt's reach
        ([1, 1, 300, 1, 40], [120, 301, 300, 7, 90], 1),  # one decode context past it
        ([300, 40], [300, 90], 0),  # no decode row
        ([1] * _MANY + [300], [50] * _MANY + [300], 1),  # more decode programs (2 KV heads) than SMs
    ],
    ids=["within-reach", "one-past-reach", "no-decode-row", "many-decode-rows"],
)
def test_mixed_step_picks_where_decode_rows_attend(
    q_lens: list[int], seq_lens: list[int], decode_launches: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With host offsets, a mixed step's decode rows ride in the prefill kernel's launch unless one of them
    has a longer context than every prompt-side request (an unsplit walk would then outlast the prefill
    kernel) or their programs fill the GPU on their own: then the decode kernel launches. The plan is worked
    out once for the metadata, and the output is right either way."""
    dtype = torch.float32
    gen = torch.Generator().manual_seed(sum(seq_lens))
    backend = TritonPagedAttention(block_size=16)
    batch = make_batch(gen, q_lens, seq_lens, 8, 2, 64, 16, dtype, backend)
    backend.write_kv(batch.kv_cache, batch.new_key, batch.new_value, batch.meta)
    launched = _count_decode_launches(backend, monkeypatch)
    scale = 1.0 / math.sqrt(64)
    for _ in range(2):  # a second layer reuses the plan
        out = torch.full_like(batch.query, float("nan"))
        backend.forward_into(batch.query, batch.kv_cache, batch.meta, scale, out)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        check(batch, out, dtype)
    assert len(launched) == 2 * decode_launches


@pytest.mark.parametrize(
    ("q_lens", "seq_lens", "prefill_grid"),
    [
        ([300, 40] + [1] * _MANY, [300, 90] + [50] * _MANY, 2),  # prompt-side first: the grid spans those
        ([300] + [1] * _MANY + [40], [300] + [50] * _MANY + [90], 2 + _MANY),  # one after a decode row: all
        ([300, 40, 1, 1], [300, 90, 301, 20], 2),  # a decode context past every prompt's: the decode kernel
    ],
    ids=["prompts-first", "prompt-after-decode", "one-past-reach"],
)
def test_prefill_grid_spans_the_leading_prompt_side_requests_when_the_decode_kernel_serves(
    q_lens: list[int], seq_lens: list[int], prefill_grid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the decode kernel attends for a mixed step's single-token requests, the prefill launch covers only
    the prompt-side requests the runner put first (each of a decode row's programs would start only to
    return); when they are not all first, it covers every request. The output is right either way."""
    from ominix_worker.attention import triton_paged

    dtype = torch.float32
    gen = torch.Generator().manual_seed(sum(seq_lens) + len(q_lens))
    backend = TritonPagedAttention(block_size=16)
    batch = make_batch(gen, q_lens, seq_lens, 8, 2, 64, 16, dtype, backend)
    backend.write_kv(batch.kv_cache, batch.new_key, batch.new_value, batch.meta)
    grids: list[tuple[int, ...]] = []
    kernel = triton_paged._prefill_kernel

    class Recording:
        def __getitem__(self, grid: tuple[int, ...]) -> object:
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_paged, "_prefill_kernel", Recording())
    out = torch.full_like(batch.query, float("nan"))
    backend.forward_into(batch.query, batch.kv_cache, batch.meta, 1.0 / math.sqrt(64), out)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    check(batch, out, dtype)
    assert [g[0] for g in grids] == [prefill_grid]


def test_metadata_without_single_token_requests_skips_the_decode_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A captured prefill graph's metadata (one request, 2+ positions, no host query offsets) says no
    single-token request can be in the step: the decode kernel is not launched, and the output is still
    right. Without the flag and without host offsets, both kernels launch (the decode one returns at once)."""
    gen = torch.Generator().manual_seed(23)
    dtype = torch.float32
    backend = TritonPagedAttention(block_size=16)
    batch = make_batch(gen, [40], [300], 8, 2, 64, 16, dtype, backend)
    backend.write_kv(batch.kv_cache, batch.new_key, batch.new_value, batch.meta)
    launched = _count_decode_launches(backend, monkeypatch)
    for flag, want_launches in ((False, 1), (True, 0)):
        launched.clear()
        # A fresh metadata each time, as each step builds its own (backends may plan once per metadata).
        meta = replace(batch.meta, query_start_loc_cpu=None, no_single_token_requests=flag)
        out = torch.full_like(batch.query, float("nan"))
        backend.forward_into(batch.query, batch.kv_cache, meta, 1.0 / math.sqrt(64), out)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        assert len(launched) == want_launches
        check(batch, out, dtype)
