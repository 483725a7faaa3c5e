"""The KV layout a worker states for its model (contract.kv_layout): which layers share one block table.

A uniform full-attention model states none (the engine assumes one full group). A model whose layers attend
within a window states one sliding-window group over every layer; a compressed-attention model
(``llama_compressed``) adds one compressed group per distinct compress ratio, over the layers with that
ratio. Group 0 is always the raw group whose table the runner's slot mapping and ``block_tables`` use.
"""

from __future__ import annotations

from ominix_runtime.contract import AttentionKind, KVGroup
from ominix_worker.config import ModelConfig


def stated_kv_groups(
    config: ModelConfig, window: int, block_size: int, num_blocks: int, bytes_per_block: int
) -> tuple[KVGroup, ...]:
    """The layout stated to the engine; ``bytes_per_block`` covers every KV tensor of one block set."""
    if not window:
        return ()
    per_token_layer = bytes_per_block // (block_size * config.num_kv_cache_layers)
    groups = [
        KVGroup(
            AttentionKind.SLIDING_WINDOW,
            tuple(range(config.num_layers)),
            block_size,
            num_blocks,
            bytes_per_token_per_layer=per_token_layer,
            sliding_window=window,
        )
    ]
    for ratio in config.compressed_group_ratios:
        layers = tuple(i for i, r in enumerate(config.compress_ratios) if r == ratio)
        groups.append(
            KVGroup(
                AttentionKind.COMPRESSED,
                layers,
                block_size,
                num_blocks,
                bytes_per_token_per_layer=per_token_layer,
                compress_ratio=ratio,
            )
        )
    return tuple(groups)


def kv_capacity_tokens(groups: tuple[KVGroup, ...], block_size: int, num_blocks: int) -> int | None:
    """Longest sequence the layout can hold in ``num_blocks`` per group; None when no group bounds it (a
    sliding window's blocks are reused as it slides)."""
    if not groups:
        return num_blocks * block_size
    bounds = [g.tokens_for_blocks(num_blocks) for g in groups if not g.is_sliding]
    return min(bounds) if bounds else None


__all__ = ["kv_capacity_tokens", "stated_kv_groups"]
