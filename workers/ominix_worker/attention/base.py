"""The attention backend interface every device path implements (torch reference, Triton, Ascend).

KV layout per layer: one tensor of shape (2, num_blocks, block_size, num_kv_heads, head_dim); [0] holds K,
[1] holds V. Token t of a request lives in block ``block_table[t // block_size]`` at offset
``t % block_size``; its flat slot is ``block_id * block_size + offset``.

A step's tokens are flattened: request i owns query rows ``query_start_loc[i]:query_start_loc[i+1]``,
which are its last ``q_len_i`` positions out of ``seq_lens[i]`` (so context before them is already in
the cache: prefix hit, earlier chunk, or earlier decode steps). Attention is causal within those rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class KVScales:
    """One layer's FP8 KV scales: an FP8 cache holds K / k and V / v in e4m3 and reads back q · k and q · v.
    From the checkpoint (``self_attn.k_scale`` / ``v_scale``), 1.0 when it has none; ignored by a cache in
    the run dtype."""

    k: float = 1.0
    v: float = 1.0


UNIT_KV_SCALES = KVScales()

# The FP8 KV cache dtypes: a store divides K and V by the layer's scales and saturates at the e4m3 range (±448).
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class AttentionMetadata:
    """Built once per step and KV group by the runner; shared by the layers of that group, and never changed
    after it is built (a backend may work out a plan once per metadata and reuse it for every layer).

    A hybrid layout (e.g. Gemma 3: sliding-window and global layers) has one per KV group: the same query
    and sequence shape, the group's own block tables, slots and window.
    """

    query_start_loc: torch.Tensor  # int32 (B+1,), cumulative new-token counts
    seq_lens: torch.Tensor  # int32 (B,), context length including this step's tokens
    block_tables: torch.Tensor  # int32 (B, max_blocks_per_seq), padded with 0
    slot_mapping: torch.Tensor  # int64 (T,), flat KV slot of each new token
    max_query_len: int
    max_seq_len: int
    num_decode_only: bool  # every request computes exactly one token (graph-capturable)
    # Host copies for backends that need them (torch reference, Ascend's actual_seq_lengths); may be None on
    # the fast path.
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # > 0: a query row at position p attends to keys at positions (p - sliding_window, p] only (the group's
    # layers attend within that window); set only for a backend that supports_sliding_window. Block table
    # entries before the window may be stale or -1 (the engine freed them) and must not be read.
    sliding_window: int = 0
    # Every request computes at least two tokens (a captured single-prompt prefill graph): no single-token
    # request needs the decode path, which backends may then skip without host query offsets.
    no_single_token_requests: bool = False
    # Some slot_mapping entries are -1 outside a captured graph (a whole-prompt hit's cached last token): a
    # store that cannot skip them by itself filters them out.
    has_unset_slots: bool = False

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens.shape[0])


# A layer's attention call as ``AttentionBackend.forward`` receives it: (query, kv_cache, meta, scale, kv_scales,
# sinks) -> output.
AttentionCall = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata, float, KVScales, torch.Tensor | None], torch.Tensor
]


class PiecewiseAttention(Protocol):
    """What a backend offers the piecewise CUDA graphs of prefill and mixed steps
    (``piecewise_graph.PiecewiseGraphs``): its KV store is capturable and skips slot -1 (a padding row); while
    ``cut`` is set, ``forward`` hands each call to it instead of attending (the capture ends a piece there);
    ``forward_into`` attends into a caller's buffer between the replayed pieces."""

    cut: AttentionCall | None

    def forward_into(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        kv_scales: KVScales = UNIT_KV_SCALES,
        sinks: torch.Tensor | None = None,
    ) -> None: ...


class AttentionBackend(Protocol):
    name: str
    block_size: int
    supports_sliding_window: bool  # honours AttentionMetadata.sliding_window
    supports_sinks: bool  # takes forward(..., sinks=)
    # write_kv stores nothing for slot -1 on every path (a padding row, or the cached last token of a prompt
    # found whole in the prefix cache).
    skips_unset_slots: bool
    # The model may rotate Q and K and store K and V in one kernel (``ops.fused.rotary_store_kv``) in place of
    # its rotary and ``write_kv``: the cache has the layout above, in the run dtype or FP8 (K / k_scale and V /
    # v_scale, saturated), and slot -1 is stored nowhere.
    takes_fused_rotary_store: bool

    def piecewise_attention(self) -> PiecewiseAttention | None:
        """This backend as the piecewise graphs of prefill and mixed steps use it; None: those steps stay eager."""
        ...

    def mixed_warm_up_steps(
        self, num_kv_heads: int, max_tokens: int, device: torch.device
    ) -> list[tuple[int, int, int]]:
        """(decode rows, their context, prompt tokens) of the eager mixed steps a worker runs before serving so
        that every kernel variant a mixed step can take is built then, not in the middle of a run; [] when the
        backend builds nothing at run time. ``max_tokens``: the most tokens a step holds."""
        ...

    def allocate_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> list[torch.Tensor]:
        """One tensor per layer, shape (2, num_blocks, block_size, num_kv_heads, head_dim)."""
        ...

    def write_kv(
        self,
        kv_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: AttentionMetadata,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> None:
        """Store this step's K/V ((T, num_kv_heads, head_dim) each) into their slots (an FP8 cache divides them
        by the layer's ``kv_scales``)."""
        ...

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales = UNIT_KV_SCALES,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query (T, num_heads, head_dim) → output (T, num_heads, head_dim), after write_kv of this layer (with
        the same ``kv_scales``).

        ``sinks`` (num_heads,), a layer's attention sinks (gpt-oss): per head a logit, in the units of the
        scaled scores, that joins the softmax denominator and contributes no value. None: no sinks."""
        ...
