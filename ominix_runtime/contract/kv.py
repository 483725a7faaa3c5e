"""KV leases: which blocks a request holds on which worker."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class KVLease:
    request_id: str
    worker_id: str
    kv_block_ids: list[int] = field(default_factory=list)
    num_tokens_reserved: int = (
        0  # tokens whose KV slots the blocks cover (len(blocks) * block_size upper bound)
    )
    num_prefix_hit_tokens: int = 0  # prompt tokens found in the prefix cache at admission to the worker
