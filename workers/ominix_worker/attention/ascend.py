"""Ascend NPU paged attention through torch_npu's fused ops (KV block size 128, ND layout).

Three ops do the work, each behind one small method of :class:`TorchNpuOps` so everything else here is
plain torch and testable on a CPU:

- KV write: ``torch_npu._npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices)``;
- decode (every request computes one token): ``torch_npu._npu_paged_attention(query, key_cache,
  value_cache, num_kv_heads, num_heads, scale_value, block_table, context_lens, out)``;
- prefill, chunked prefill with a cached prefix, and mixed batches: ``torch_npu.npu_fused_infer_attention_score``
  with ``input_layout="TND"``, a paged K/V (``block_table``, ``block_size``), ``sparse_mode=3``
  (causal aligned to the bottom right, so a chunk sees its whole cached prefix) and the 2048×2048
  compressed causal mask that sparse modes 2-4 take.

Signatures follow vllm-ascend v0.11 (``vllm_ascend/attention/attention_v1.py``, torch_npu 2.7.1 with
CANN 8.3): keyword names as above; the FIA paged path views each cache as (num_blocks, block_size,
num_kv_heads * head_dim); ``actual_seq_lengths`` is cumulative (the end offset of each request's query
rows, TND), ``actual_seq_lengths_kv`` is per request (its context length); ``context_lens`` of the
paged-attention op is an int32 tensor read on the host; block tables and slot indices are int32.

KV layout per layer: (2, num_blocks, 128, num_kv_heads, head_dim); [0] keys, [1] values (what
vllm-ascend uses on A2/A3; the 310P's NZ layout is not supported here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ominix_worker.attention.base import UNIT_KV_SCALES, AttentionMetadata, KVScales, PiecewiseAttention

ASCEND_BLOCK_SIZE = 128
ASCEND_KV_DTYPES = (torch.float16, torch.bfloat16)
# Sparse modes 2, 3 and 4 of npu_fused_infer_attention_score take a fixed 2048×2048 mask whose upper
# triangle (above the diagonal) is masked; the op shifts it per request itself.
FIA_MASK_SIZE = 2048
FIA_SPARSE_MODE_RIGHT_DOWN_CAUSAL = 3
FIA_INPUT_LAYOUT = "TND"


class NpuOps(Protocol):
    """The three torch_npu calls, with the argument names and layouts the ops take."""

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_indices: torch.Tensor,
    ) -> None: ...

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        num_kv_heads: int,
        num_heads: int,
        scale_value: float,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        out: torch.Tensor,
    ) -> None: ...

    def fused_infer_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        atten_mask: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        actual_seq_lengths: list[int],
        actual_seq_lengths_kv: list[int],
        num_heads: int,
        num_key_value_heads: int,
        scale: float,
        sparse_mode: int,
        input_layout: str,
    ) -> torch.Tensor: ...


class TorchNpuOps:
    """The real ops. torch_npu is imported here, on first use of the Ascend path, never at import time."""

    def __init__(self) -> None:
        try:
            import torch_npu  # only an Ascend worker may load it
        except ImportError as exc:
            raise RuntimeError(
                "the Ascend attention backend needs torch_npu (pip install torch-npu matching torch and CANN)"
            ) from exc
        self._npu: Any = torch_npu

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_indices: torch.Tensor,
    ) -> None:
        self._npu._npu_reshape_and_cache(
            key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_indices=slot_indices
        )

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        num_kv_heads: int,
        num_heads: int,
        scale_value: float,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        self._npu._npu_paged_attention(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            num_kv_heads=num_kv_heads,
            num_heads=num_heads,
            scale_value=scale_value,
            block_table=block_table,
            context_lens=context_lens,
            out=out,
        )

    def fused_infer_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        atten_mask: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        actual_seq_lengths: list[int],
        actual_seq_lengths_kv: list[int],
        num_heads: int,
        num_key_value_heads: int,
        scale: float,
        sparse_mode: int,
        input_layout: str,
    ) -> torch.Tensor:
        out, _softmax_lse = self._npu.npu_fused_infer_attention_score(
            query=query,
            key=key,
            value=value,
            atten_mask=atten_mask,
            block_table=block_table,
            input_layout=input_layout,
            block_size=block_size,
            actual_seq_lengths=actual_seq_lengths,
            actual_seq_lengths_kv=actual_seq_lengths_kv,
            num_key_value_heads=num_key_value_heads,
            num_heads=num_heads,
            scale=scale,
            sparse_mode=sparse_mode,
        )
        return out


@dataclass(slots=True)
class AscendInputs:
    """One step's metadata in the forms the torch_npu ops take; built once per step, shared by layers."""

    num_tokens: int
    decode_only: bool
    slot_indices: torch.Tensor  # int32 (T,), on the KV device
    block_tables: torch.Tensor  # int32 (B, block_table_width), on the KV device, padded with block 0
    context_lens: torch.Tensor  # int32 (B,), on the host: _npu_paged_attention reads it there
    actual_seq_lengths_q: list[int]  # cumulative query row ends, (B,), TND
    actual_seq_lengths_kv: list[int]  # context length per request, (B,)
    query_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)


def blocks_needed(seq_len: int, block_size: int = ASCEND_BLOCK_SIZE) -> int:
    return -(-seq_len // block_size)


def pad_block_tables(block_tables: torch.Tensor, width: int, needed: Sequence[int]) -> torch.Tensor:
    """int32 block tables exactly ``width`` columns wide (padded with block 0, which the ops never read
    past a request's context length); refuses a width that would cut a request's blocks."""
    if block_tables.dim() != 2:
        raise ValueError(
            f"block_tables must be 2-D (requests, blocks), got shape {tuple(block_tables.shape)}"
        )
    most = max(needed, default=0)
    if width < most:
        raise ValueError(f"block table width {width} is smaller than the {most} blocks a request needs")
    have = block_tables.shape[1]
    if have < most:
        raise ValueError(f"block_tables has {have} columns but a request needs {most} blocks")
    table = block_tables.to(torch.int32)
    if have >= width:
        return table[:, :width].contiguous()
    pad = torch.zeros((table.shape[0], width - have), dtype=torch.int32, device=table.device)
    return torch.cat([table, pad], dim=1)


def slot_indices_for(
    block_tables: torch.Tensor, query_start: Sequence[int], seq_lens: Sequence[int], block_size: int
) -> torch.Tensor:
    """Flat KV slot (block_id * block_size + offset) of every new token, in query-row order (int32)."""
    slots: list[torch.Tensor] = []
    for i, seq_len in enumerate(seq_lens):
        q_len = query_start[i + 1] - query_start[i]
        positions = torch.arange(seq_len - q_len, seq_len, device=block_tables.device)
        blocks = block_tables[i, positions // block_size].to(torch.int64)
        slots.append(blocks * block_size + positions % block_size)
    if not slots:
        return torch.zeros(0, dtype=torch.int32, device=block_tables.device)
    return torch.cat(slots).to(torch.int32)


def prepare_ascend_inputs(
    meta: AttentionMetadata, block_size: int = ASCEND_BLOCK_SIZE, block_table_width: int | None = None
) -> AscendInputs:
    """Validate one step's metadata and convert it to the ops' forms (pure torch, no device sync beyond
    the host copies the metadata may already carry)."""
    if block_size != ASCEND_BLOCK_SIZE:
        raise ValueError(f"Ascend paged attention uses KV block size {ASCEND_BLOCK_SIZE}, got {block_size}")
    query_start = list(meta.query_start_loc_cpu or meta.query_start_loc.tolist())
    seq_lens = list(meta.seq_lens_cpu or meta.seq_lens.tolist())
    num_requests = len(seq_lens)
    if len(query_start) != num_requests + 1 or (query_start and query_start[0] != 0):
        raise ValueError(
            f"query_start_loc must be [0, ...] with {num_requests + 1} entries, got {query_start}"
        )
    query_lens = [query_start[i + 1] - query_start[i] for i in range(num_requests)]
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if q_len < 1:
            raise ValueError(
                f"request {i} computes {q_len} tokens; every scheduled request computes at least one"
            )
        if q_len > seq_len:
            raise ValueError(f"request {i} has {q_len} new tokens but a context of only {seq_len}")
    num_tokens = query_start[-1] if query_start else 0
    if meta.slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping has {meta.slot_mapping.shape[0]} entries for {num_tokens} tokens")
    needed = [blocks_needed(s, block_size) for s in seq_lens]
    width = block_table_width if block_table_width is not None else max(max(needed, default=1), 1)
    block_tables = pad_block_tables(meta.block_tables, width, needed)
    return AscendInputs(
        num_tokens=num_tokens,
        decode_only=all(q == 1 for q in query_lens),
        slot_indices=meta.slot_mapping[:num_tokens].to(torch.int32),
        block_tables=block_tables,
        context_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cpu"),
        actual_seq_lengths_q=query_start[1:],
        actual_seq_lengths_kv=seq_lens,
        query_lens=query_lens,
    )


def causal_mask(device: torch.device | str) -> torch.Tensor:
    """The compressed mask of FIA sparse modes 2-4: True above the diagonal (masked)."""
    return torch.triu(torch.ones(FIA_MASK_SIZE, FIA_MASK_SIZE, dtype=torch.bool, device=device), diagonal=1)


class AscendPagedAttention:
    """AttentionBackend for ``npu`` devices. ``ops`` defaults to the real torch_npu ops."""

    name = "npu-paged"
    supports_sliding_window = False  # the context is capped at the window instead
    supports_sinks = False  # the fused NPU ops have no softmax sink term
    skips_unset_slots = False  # _npu_reshape_and_cache's handling of slot -1 is not established
    takes_fused_rotary_store = False  # the NPU stores through its own op

    def __init__(
        self,
        block_size: int = ASCEND_BLOCK_SIZE,
        *,
        ops: NpuOps | None = None,
        block_table_width: int | None = None,
    ) -> None:
        if block_size != ASCEND_BLOCK_SIZE:
            raise ValueError(
                f"Ascend paged attention uses KV block size {ASCEND_BLOCK_SIZE}, got {block_size}"
            )
        self.block_size = block_size
        # A fixed width (ceil(max_model_len / 128)) keeps block-table shapes stable for ACL graph capture.
        self.block_table_width = block_table_width
        self.ops: NpuOps = ops if ops is not None else TorchNpuOps()
        self._masks: dict[str, torch.Tensor] = {}
        self._last: tuple[AttentionMetadata, AscendInputs] | None = None

    def piecewise_attention(self) -> PiecewiseAttention | None:
        """Its steps are not captured (no CUDA graphs here)."""
        return None

    def mixed_warm_up_steps(
        self, num_kv_heads: int, max_tokens: int, device: torch.device
    ) -> list[tuple[int, int, int]]:
        return []  # nothing compiles at run time

    def allocate_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> list[torch.Tensor]:
        if dtype not in ASCEND_KV_DTYPES:
            raise ValueError(f"Ascend KV caches are float16 or bfloat16, got {dtype}")
        shape = (2, num_blocks, self.block_size, num_kv_heads, head_dim)
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def prepare(self, meta: AttentionMetadata) -> AscendInputs:
        """The step's AscendInputs, built on the first layer and reused by the others."""
        if self._last is not None and self._last[0] is meta:
            return self._last[1]
        inputs = prepare_ascend_inputs(meta, self.block_size, self.block_table_width)
        self._last = (meta, inputs)
        return inputs

    def write_kv(
        self,
        kv_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: AttentionMetadata,
        kv_scales: KVScales = UNIT_KV_SCALES,  # no FP8 KV on Ascend: the cache is in the run dtype
    ) -> None:
        inputs = self.prepare(meta)
        n = inputs.num_tokens
        self.ops.reshape_and_cache(
            key[:n].to(kv_cache.dtype),
            value[:n].to(kv_cache.dtype),
            kv_cache[0],
            kv_cache[1],
            inputs.slot_indices,
        )

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales = UNIT_KV_SCALES,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sinks is not None:
            raise ValueError("the Ascend attention backend has no attention sinks")
        inputs = self.prepare(meta)
        num_heads = query.shape[1]
        num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        # The fused op rejects padded query rows (query rows must equal the last actual_seq_lengths).
        query = query[: inputs.num_tokens].to(kv_cache.dtype)
        if inputs.decode_only:
            out = torch.empty_like(query)
            self.ops.paged_attention(
                query,
                kv_cache[0],
                kv_cache[1],
                num_kv_heads,
                num_heads,
                scale,
                inputs.block_tables,
                inputs.context_lens,
                out,
            )
            return out
        return self.ops.fused_infer_attention(
            query,
            kv_cache[0].view(num_blocks, block_size, num_kv_heads * head_dim),
            kv_cache[1].view(num_blocks, block_size, num_kv_heads * head_dim),
            atten_mask=self._mask(query.device),
            block_table=inputs.block_tables,
            block_size=block_size,
            actual_seq_lengths=inputs.actual_seq_lengths_q,
            actual_seq_lengths_kv=inputs.actual_seq_lengths_kv,
            num_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            scale=scale,
            sparse_mode=FIA_SPARSE_MODE_RIGHT_DOWN_CAUSAL,
            input_layout=FIA_INPUT_LAYOUT,
        )

    def _mask(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        mask = self._masks.get(key)
        if mask is None:
            mask = self._masks[key] = causal_mask(device)
        return mask


__all__ = [
    "ASCEND_BLOCK_SIZE",
    "AscendInputs",
    "AscendPagedAttention",
    "NpuOps",
    "TorchNpuOps",
    "causal_mask",
    "pad_block_tables",
    "prepare_ascend_inputs",
    "slot_indices_for",
]
