"""KV layouts: the groups of layers that share one KV block table.

A model whose layers all attend the same way states one full-attention group (or none: the capability then
derives it). Hybrid models state several: e.g. Gemma 3 interleaves sliding-window layers with global ones,
gpt-oss alternates them, DeepSeek-V4 adds compressed rows. Each group has its own block pool and its own
block table per request; a sliding-window group keeps only the blocks its window can still read.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

# An entry of a sliding-window group's block table whose block slid out of the window and was freed. The
# entry stays so that position p still lives in table[p // block_size].
NULL_BLOCK_ID = -1


class AttentionKind(IntEnum):
    """Values match ``ominix.runtime.v1.AttentionKind``."""

    FULL = 1
    SLIDING_WINDOW = 2
    COMPRESSED = 3  # declared for layouts like DeepSeek-V4's; no registry serves it yet


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One group of layers with one attention kind and one block pool."""

    kind: AttentionKind
    layer_indices: tuple[int, ...]
    block_size: int
    num_blocks: int
    bytes_per_token_per_layer: int = 0  # K and V of one token in one layer (0: unknown)
    sliding_window: int = 0  # SLIDING_WINDOW: a token attends to itself and the window - 1 before it
    compress_ratio: int = 0  # COMPRESSED: tokens per stored row

    @property
    def is_sliding(self) -> bool:
        return self.kind == AttentionKind.SLIDING_WINDOW

    def first_needed_position(self, num_computed_tokens: int) -> int:
        """Earliest position a step starting after ``num_computed_tokens`` tokens may still read."""
        if not self.is_sliding:
            return 0
        return max(0, num_computed_tokens - self.sliding_window)

    def problems(self, index: int) -> list[str]:
        out: list[str] = []
        name = f"kv group {index}"
        if self.block_size <= 0 or self.num_blocks <= 0:
            out.append(f"{name}: block_size and num_blocks must be > 0")
        if self.bytes_per_token_per_layer < 0:
            out.append(f"{name}: bytes_per_token_per_layer must be >= 0")
        if len(set(self.layer_indices)) != len(self.layer_indices) or any(i < 0 for i in self.layer_indices):
            out.append(f"{name}: layer indices must be distinct and >= 0")
        if self.is_sliding and self.sliding_window <= 0:
            out.append(f"{name}: a sliding-window group needs sliding_window > 0")
        if not self.is_sliding and self.sliding_window:
            out.append(f"{name}: only a sliding-window group states sliding_window")
        if self.kind == AttentionKind.COMPRESSED:
            if self.compress_ratio <= 0:
                out.append(f"{name}: a compressed group needs compress_ratio > 0")
            else:
                out.append(f"{name}: compressed KV groups are not served yet")
        elif self.compress_ratio:
            out.append(f"{name}: only a compressed group states compress_ratio")
        return out


def layout_problems(groups: tuple[KVGroup, ...], num_layers: int) -> list[str]:
    """Problems of a stated layout as a whole (each group's own, overlaps, one block size)."""
    out: list[str] = []
    seen: set[int] = set()
    for i, g in enumerate(groups):
        out.extend(g.problems(i))
        if seen & set(g.layer_indices):
            out.append(f"kv group {i}: layers {sorted(seen & set(g.layer_indices))} belong to two groups")
        seen |= set(g.layer_indices)
        if num_layers and any(layer >= num_layers for layer in g.layer_indices):
            out.append(f"kv group {i}: layer index beyond the model's {num_layers} layers")
    if len({g.block_size for g in groups}) > 1:
        # Prefix hits and chunk arithmetic are block-aligned across groups.
        out.append("every kv group must use the same block_size")
    return out


__all__ = ["NULL_BLOCK_ID", "AttentionKind", "KVGroup", "layout_problems"]
