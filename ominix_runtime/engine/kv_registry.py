"""KV block registry: which worker KV blocks are free, cached or leased to which request.

One registry per worker group, sized from the worker's BackendCapability (kv_num_blocks, kv_block_size).

- Blocks are ref-counted. A block with ref count 0 sits in the free queue (an OrderedDict used as an O(1)
  doubly linked list), front = reused first. Blocks that never held a full hashed block go to the front;
  hashed blocks go to the back, so reuse evicts the least recently freed cached content first (LRU).
- Prefix cache: only FULL blocks are hashed, with chained hashes ``hash((parent_hash, tuple(block_tokens)))``.
  A freed block keeps its hash until it is reused (lazy eviction). A request's blocks are freed tail-first
  so the prefix survives longest.
- A prefix hit is block-aligned and capped at ``len(tokens) - 1`` so the last prompt token is always
  recomputed (the worker needs its logits to sample).
- Invariant (``check_integrity``): free + evictable-cached + leased == total, every block's ref count equals
  the number of live leases holding it, and a block is held by two leases only if it is a cached (hashed)
  block shared through the prefix cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ominix_runtime.contract import KVLease

_ROOT_HASH = 0x5F3759DF  # parent hash of a request's first block


class IntegrityError(AssertionError):
    """The registry's bookkeeping is inconsistent."""


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    # The exact key behind block_hash, compared on every hit so that a hash collision is never a wrong hit.
    hash_key: tuple[int, tuple[int, ...]] | None = None


@dataclass(slots=True)
class _LeaseState:
    lease: KVLease
    num_hashed_blocks: int = 0  # leading blocks already registered in the prefix cache (or skipped)
    last_hash: int = _ROOT_HASH


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Cached leading blocks found for a token sequence (not yet leased)."""

    kv_block_ids: tuple[int, ...] = ()
    num_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RegistrySnapshot:
    num_blocks: int
    block_size: int
    num_leased_blocks: int
    num_free_blocks: int  # ref 0 and no cached content
    num_cached_evictable_blocks: int  # ref 0 with cached content (reusable)
    num_cached_blocks: int  # blocks in the prefix cache (leased or not)
    num_leases: int
    prefix_query_tokens: int
    prefix_hit_tokens: int


class KVRegistry:
    def __init__(
        self, worker_id: str, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be > 0")
        self.worker_id = worker_id
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cache: dict[int, int] = {}  # block hash -> block id
        self._leases: dict[str, _LeaseState] = {}
        self._num_leased = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- queries --------------------------------------------------------------------------------------

    @property
    def num_available_blocks(self) -> int:
        """Blocks that can be handed out now (free or evictable cached)."""
        return len(self._free)

    @property
    def num_leased_blocks(self) -> int:
        return self._num_leased

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def lease(self, request_id: str) -> KVLease | None:
        state = self._leases.get(request_id)
        return state.lease if state else None

    def leased_request_ids(self) -> list[str]:
        return list(self._leases)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix(self, token_ids: Sequence[int], record: bool = False) -> PrefixHit:
        """Longest run of cached full leading blocks, capped so the last token is recomputed."""
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return PrefixHit()
        max_blocks = (len(token_ids) - 1) // self.block_size
        parent = _ROOT_HASH
        hit: list[int] = []
        bs = self.block_size
        for i in range(max_blocks):
            key = (parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            block_hash = hash(key)
            block_id = self._cache.get(block_hash)
            if block_id is None or self._blocks[block_id].hash_key != key:
                break
            hit.append(block_id)
            parent = block_hash
        if record:
            self.prefix_query_tokens += len(token_ids)
            self.prefix_hit_tokens += len(hit) * bs
        return PrefixHit(tuple(hit), len(hit) * bs)

    # ---- allocation -----------------------------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int, prefix: PrefixHit | None = None) -> list[int] | None:
        """Grow ``request_id``'s lease to cover ``num_tokens`` tokens; all or nothing.

        On the first call the lease starts with the ``prefix`` blocks (shared, ref count +1). Returns the
        block ids appended to the lease (prefix blocks included on the first call), or None when there are
        not enough blocks; then nothing changed.
        """
        state = self._leases.get(request_id)
        if (  # fast path: a running request that needs no new block
            state is not None
            and prefix is None
            and -(-num_tokens // self.block_size) <= len(state.lease.kv_block_ids)
        ):
            return []
        if state is not None and prefix is not None and prefix.kv_block_ids:
            raise ValueError("a prefix hit can only start a new lease")
        prefix_ids = prefix.kv_block_ids if (state is None and prefix is not None) else ()
        if any(self._blocks[b].block_hash is None for b in prefix_ids):
            raise ValueError("stale prefix hit: a block was evicted since find_prefix")
        have = len(state.lease.kv_block_ids) if state else len(prefix_ids)
        need = max(self.blocks_for_tokens(num_tokens) - have, 0)
        # Prefix blocks with ref 0 are in the free queue; taking them shrinks what is available.
        prefix_from_free = sum(1 for b in prefix_ids if self._blocks[b].ref_count == 0)
        if need + prefix_from_free > len(self._free):
            return None
        if state is None:
            state = _LeaseState(KVLease(request_id, self.worker_id))
            self._leases[request_id] = state
            for b in prefix_ids:
                self._ref(b)
                state.lease.kv_block_ids.append(b)
            state.lease.num_prefix_hit_tokens = len(prefix_ids) * self.block_size
        added = list(prefix_ids)
        for _ in range(need):
            block_id, _none = self._free.popitem(last=False)
            block = self._blocks[block_id]
            if block.block_hash is not None:  # lazy eviction of the cached content
                if self._cache.get(block.block_hash) == block_id:
                    del self._cache[block.block_hash]
                block.block_hash = None
                block.hash_key = None
            block.ref_count = 1
            self._num_leased += 1
            state.lease.kv_block_ids.append(block_id)
            added.append(block_id)
        state.lease.num_tokens_reserved = len(state.lease.kv_block_ids) * self.block_size
        return added

    def _ref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
            self._num_leased += 1
        block.ref_count += 1

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the lease's full blocks whose tokens are known and computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        state = self._leases.get(request_id)
        if state is None:
            return
        bs = self.block_size
        lease_blocks = state.lease.kv_block_ids
        num_full = min(num_computed_tokens, len(token_ids)) // bs
        if num_full <= state.num_hashed_blocks:
            return
        num_full = min(num_full, len(lease_blocks))
        for i in range(state.num_hashed_blocks, num_full):
            key = (state.last_hash, tuple(token_ids[i * bs : (i + 1) * bs]))
            block_hash = hash(key)
            block = self._blocks[lease_blocks[i]]
            if block.block_hash is None and block_hash not in self._cache:
                block.block_hash = block_hash
                block.hash_key = key
                self._cache[block_hash] = block.block_id
            # A duplicate of content cached elsewhere stays unhashed; the chain continues either way.
            state.last_hash = block_hash
            state.num_hashed_blocks = i + 1

    def free(self, request_id: str) -> list[int]:
        """Release the lease tail-first; returns its block ids (empty when there was none)."""
        state = self._leases.pop(request_id, None)
        if state is None:
            return []
        blocks = state.lease.kv_block_ids
        for block_id in reversed(blocks):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._num_leased -= 1
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)  # no content worth keeping: reuse first
        return list(blocks)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. after the worker restarted and lost its KV tensor)."""
        for block in self._blocks:
            block.block_hash = None
            block.hash_key = None
        self._cache.clear()

    # ---- checks and stats -----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` when the bookkeeping is inconsistent."""
        holders: dict[int, int] = {}
        for rid, state in self._leases.items():
            seen: set[int] = set()
            for b in state.lease.kv_block_ids:
                if not 0 <= b < self.num_blocks:
                    raise IntegrityError(f"lease {rid} holds block {b} outside [0, {self.num_blocks})")
                if b in seen:
                    raise IntegrityError(f"lease {rid} holds block {b} twice")
                seen.add(b)
                holders[b] = holders.get(b, 0) + 1
        num_free = num_evictable = 0
        for block in self._blocks:
            held = holders.get(block.block_id, 0)
            if block.ref_count != held:
                raise IntegrityError(
                    f"block {block.block_id} has ref count {block.ref_count} but {held} live leases hold it"
                )
            if held > 1 and block.block_hash is None:
                raise IntegrityError(
                    f"block {block.block_id} is held by {held} requests but is not a cached block"
                )
            in_free = block.block_id in self._free
            if (block.ref_count == 0) != in_free:
                raise IntegrityError(
                    f"block {block.block_id} ref count {block.ref_count} vs free-queue {in_free}"
                )
            if in_free:
                if block.block_hash is None:
                    num_free += 1
                else:
                    num_evictable += 1
            if block.block_hash is not None and self._cache.get(block.block_hash) != block.block_id:
                raise IntegrityError(f"block {block.block_id} keeps a hash the prefix cache maps elsewhere")
        for block_hash, block_id in self._cache.items():
            if self._blocks[block_id].block_hash != block_hash:
                raise IntegrityError(f"prefix cache entry points at block {block_id} with another hash")
        num_leased = sum(1 for b in self._blocks if b.ref_count > 0)
        if num_leased != self._num_leased:
            raise IntegrityError(f"leased-block counter {self._num_leased} != {num_leased}")
        if num_free + num_evictable + num_leased != self.num_blocks:
            raise IntegrityError(
                f"free {num_free} + evictable {num_evictable} + leased {num_leased} != total {self.num_blocks}"
            )

    def check_quiescent(self) -> None:
        """O(1) check for an idle registry: no lease may be left and every block must be reusable."""
        if self._leases or self._num_leased or len(self._free) != self.num_blocks:
            raise IntegrityError(
                f"idle registry holds {len(self._leases)} leases, {self._num_leased} leased blocks, "
                f"{len(self._free)} of {self.num_blocks} blocks reusable"
            )

    def snapshot(self) -> RegistrySnapshot:
        num_evictable = sum(1 for b in self._free if self._blocks[b].block_hash is not None)
        return RegistrySnapshot(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_leased_blocks=self._num_leased,
            num_free_blocks=len(self._free) - num_evictable,
            num_cached_evictable_blocks=num_evictable,
            num_cached_blocks=len(self._cache),
            num_leases=len(self._leases),
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
        )
