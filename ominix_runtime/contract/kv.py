"""KV leases: which blocks a request holds on which worker."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class KVLease:
    request_id: str
    worker_id: str
    # One block table per KV group (see contract.kv_layout), in the capability's group order. A sliding-window
    # group's table keeps NULL_BLOCK_ID where a block slid out of the window, so position p stays in entry
    # p // block_size.
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    # Most tokens every group's blocks can hold (a full or sliding table: len * block_size; a compressed one:
    # its rows' complete chunks plus a partial one).
    num_tokens_reserved: int = 0
    # Tokens whose KV the prefix hit's blocks held at admission (read, never written by this request).
    num_prefix_hit_tokens: int = 0

    @property
    def kv_block_ids(self) -> list[int]:
        """Block table of group 0 (the only one of a uniform layout)."""
        return self.block_tables[0]
