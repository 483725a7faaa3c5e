"""KV layouts: the groups of layers that share one KV block table.

A model whose layers all attend the same way states one full-attention group (or none: the capability then
derives it). Hybrid models state several: e.g. Gemma 3 interleaves sliding-window layers with global ones,
gpt-oss alternates them, DeepSeek-V4 adds compressed rows. Each group has its own block pool and its own
block table per request; a sliding-window group keeps only the blocks its window can still read.

A compressed group stores one KV row per ``compress_ratio`` tokens: row c summarises tokens
``[c * ratio, (c + 1) * ratio)`` (a "chunk") and is written when the chunk's last token is computed. Its blocks
hold ``block_size`` rows, so one block covers ``block_size * compress_ratio`` tokens and row c lives in
``table[c // block_size]`` at offset ``c % block_size``. Only complete chunks have rows: the tokens of the
trailing partial chunk live only in the raw KV of the group each compressed layer also belongs to (a full
group, or a sliding-window group whose window is at least the ratio), which is why a compressed layer must
belong to one such group as well. Prefix hits are aligned to whole blocks of every group, so a compressed
group's hit is always whole chunks and whole blocks of rows.
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
    COMPRESSED = 3  # one row per compress_ratio tokens (DeepSeek-V4's compressed attention)


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

    @property
    def is_compressed(self) -> bool:
        return self.kind == AttentionKind.COMPRESSED

    @property
    def tokens_per_row(self) -> int:
        """Tokens one stored KV row stands for (1 but in a compressed group)."""
        return self.compress_ratio if self.is_compressed else 1

    @property
    def tokens_per_block(self) -> int:
        """Tokens one block covers."""
        return self.block_size * self.tokens_per_row

    def rows_for_tokens(self, num_tokens: int) -> int:
        """Rows the first ``num_tokens`` tokens occupy: every token, or (compressed) every complete chunk."""
        return num_tokens // self.tokens_per_row

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks (from the first) a table needs once ``num_tokens`` tokens are computed."""
        return -(-self.rows_for_tokens(num_tokens) // self.block_size)

    def tokens_for_blocks(self, num_blocks: int) -> int:
        """Most tokens whose rows ``num_blocks`` blocks hold (a partial chunk after them needs no row)."""
        return (num_blocks * self.block_size + 1) * self.tokens_per_row - 1

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
        if self.is_compressed:
            if self.compress_ratio <= 0:
                out.append(f"{name}: a compressed group needs compress_ratio > 0")
        elif self.compress_ratio:
            out.append(f"{name}: only a compressed group states compress_ratio")
        return out


def layout_problems(groups: tuple[KVGroup, ...], num_layers: int) -> list[str]:
    """Problems of a stated layout as a whole (each group's own, overlaps, one block size).

    A layer keeps its raw KV in exactly one full or sliding-window group; a compressed layer also belongs to
    one compressed group, and its raw group must keep the trailing partial chunk (full, or a window of at
    least the ratio).
    """
    out: list[str] = []
    raw: dict[int, KVGroup] = {}  # layer -> the group holding its raw KV
    compressed: dict[int, int] = {}  # layer -> the index of its compressed group
    for i, g in enumerate(groups):
        out.extend(g.problems(i))
        owners = compressed if g.is_compressed else raw
        twice = sorted(set(owners) & set(g.layer_indices))
        if twice:
            out.append(f"kv group {i}: layers {twice} belong to two groups of this kind")
        for layer in g.layer_indices:
            if g.is_compressed:
                compressed.setdefault(layer, i)
            else:
                raw.setdefault(layer, g)
        if num_layers and any(layer >= num_layers for layer in g.layer_indices):
            out.append(f"kv group {i}: layer index beyond the model's {num_layers} layers")
    for layer, i in sorted(compressed.items()):
        ratio = groups[i].compress_ratio
        keeper = raw.get(layer)
        if keeper is None:
            out.append(
                f"kv group {i}: compressed layer {layer} has no full or sliding-window group for its raw KV"
            )
        elif keeper.is_sliding and 0 < keeper.sliding_window < ratio:
            out.append(
                f"kv group {i}: layer {layer}'s window {keeper.sliding_window} cannot hold a partial chunk of "
                f"{ratio} tokens"
            )
    if len({g.block_size for g in groups}) > 1:
        # Prefix hits and chunk arithmetic are block-aligned across groups.
        out.append("every kv group must use the same block_size")
    return out


__all__ = ["NULL_BLOCK_ID", "AttentionKind", "KVGroup", "layout_problems"]
