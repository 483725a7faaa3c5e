"""KV block registry: which worker KV blocks are free, cached or leased to which request.

One registry per worker group, sized from the worker's BackendCapability (kv_num_blocks, kv_block_size).

- Blocks are ref-counted. A block with ref count 0 sits in the free queue (an OrderedDict used as an O(1)
  doubly linked list), front = reused first. Blocks that never held a full hashed block go to the front;
  hashed blocks go to the back, so reuse evicts the least recently freed cached content first (LRU).
- Prefix cache: only FULL blocks are hashed, with chained SHA-256 digests over the parent's digest and the
  block's tokens. A 64-bit hash such as Python's ``hash`` can be made to collide by anyone who sends prompts
  (a birthday search is ~2**32 steps), and a collision of parents would serve one prompt the KV computed
  after another's; a collision-resistant chain makes equal digests mean equal prefixes.
  A freed block keeps its hash until it is reused (lazy eviction). A request's blocks are freed tail-first
  so the prefix survives longest.
- A prefix hit is block-aligned and capped at ``len(tokens) - 1`` so the last prompt token is always
  recomputed (the worker needs its logits to sample). With ``whole_prompt_hits`` (full-attention groups only)
  a sequence cached whole hits every block: ``num_tokens`` stops one short and the worker computes the last
  token without writing its KV, instead of computing the last block again.
- KV groups (contract.kv_layout): each group of layers has its own block pool, prefix cache and one block
  table per lease; a uniform model has one full-attention group. A sliding-window group frees the blocks
  that slid wholly out of the window (``slide``); their table entries become NULL_BLOCK_ID so positions keep
  their entry. A compressed group (one row per ``compress_ratio`` tokens) holds blocks only for complete
  chunks: its table covers ``rows // block_size`` rounded up, and a block of it covers
  ``block_size * compress_ratio`` tokens; the trailing partial chunk has no row (its tokens live in the
  layer's raw group). A prefix hit is the longest prefix every full or compressed group holds whole and every
  sliding group holds within the window of the next token (its earlier entries come back null), in whole
  blocks of every group: a multiple of the least common multiple of their tokens per block.
- Invariant (``check_integrity``, per group): free + evictable-cached + leased == total, every block's ref
  count equals the number of live leases holding it, and a block is held by two leases only if it is a
  cached (hashed) block shared through the prefix cache, or was one when a flush (``reset_prefix_cache``)
  forgot it while they held it.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ominix_runtime.contract import NULL_BLOCK_ID, AttentionKind, KVGroup, KVLease

_ROOT_HASH = hashlib.sha256(b"ominix-runtime kv prefix root").digest()  # parent digest of a first block
_TOKEN_ARRAY = "q"  # token ids as 8-byte integers in the digested bytes

BlockKey = tuple[bytes, tuple[int, ...]]  # (parent digest, the block's tokens)


def _chain_digest(parent: bytes, block_bytes: bytes) -> bytes:
    return hashlib.sha256(parent + block_bytes).digest()


def _block_bytes(tokens: Sequence[int]) -> bytes:
    return array(_TOKEN_ARRAY, tokens).tobytes()


_UNBOUNDED_TOKENS = 1 << 62  # no KV limit on a request's length (only sliding-window groups)


class IntegrityError(AssertionError):
    """The registry's bookkeeping is inconsistent."""


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    # The exact key behind block_hash, compared on every hit so that a hash collision is never a wrong hit.
    hash_key: BlockKey | None = None


@dataclass(slots=True)
class _LeaseState:
    lease: KVLease
    num_tokens: int = 0  # tokens the tables cover (the most ever allocated)
    # Per group: leading blocks already registered in the prefix cache (or skipped), and the chained hash of
    # the last one.
    num_hashed_blocks: list[int] = field(default_factory=list)
    last_hashes: list[bytes] = field(default_factory=list)
    next_full_tokens: int = 0  # computed tokens at which some group's next block fills up
    # Per group: blocks before this index leave a sliding window to the front of the free queue (reused first,
    # still hittable until then). They lie before the window a hit on all the lease's first known tokens
    # reads, so they serve only hits on a shorter prefix; the window of that full hit and everything after it
    # (outputs, a multi-turn follow-up's prefix) wait their turn at the back.
    cold_blocks: list[int] = field(default_factory=list)
    # False once the prefix cache was flushed during the lease: its blocks filled after the flush are computed
    # over KV from before it (older weights, or a run meant to start cold), so none may be registered.
    registers: bool = True
    # Per group: the leading blocks that came from a prefix hit (the lease's own blocks follow them).
    num_prefix_blocks: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Cached leading blocks found for a token sequence (not yet leased): one tuple per KV group."""

    group_block_ids: tuple[tuple[int, ...], ...] = ()
    num_tokens: int = 0  # tokens the request need not compute
    # Per group: the chained hash of the hit's last block (the parent of the first block after it), so the lease
    # registers its later blocks without hashing the hit's again. Derived from the blocks: not compared.
    group_chain_ends: tuple[bytes, ...] = field(default=(), compare=False)
    # The blocks hold the whole sequence; num_tokens stops one short, as its last token's logits are needed
    # (computed again, its KV not written).
    whole: bool = False

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose KV the hit's blocks hold."""
        return self.num_tokens + 1 if self.whole else self.num_tokens

    @property
    def kv_block_ids(self) -> tuple[int, ...]:
        """Group 0's hit blocks."""
        return self.group_block_ids[0] if self.group_block_ids else ()


class _HashChain:
    """One group's chained block hashes over a token sequence, computed up to the furthest block asked for."""

    def __init__(self, token_ids: Sequence[int], span: int) -> None:
        self._token_ids = token_ids
        self._span = span
        self._keys: list[BlockKey] = []
        self._hashes: list[bytes] = []

    def extend(self, count: int) -> None:
        """Hash the first ``count`` blocks (those not hashed yet) in one pass over their tokens; only whole
        blocks of the sequence are hashed."""
        keys, hashes, span = self._keys, self._hashes, self._span
        done = len(keys)
        if count <= done:
            return
        parent = hashes[-1] if hashes else _ROOT_HASH
        tokens = self._token_ids[done * span : count * span]
        data = _block_bytes(tokens)  # one conversion for the stretch; each block digests its slice
        width = span * array(_TOKEN_ARRAY).itemsize
        start = 0
        for block in zip(*[iter(tokens)] * span, strict=False):  # consecutive span-long tuples
            keys.append((parent, block))
            parent = _chain_digest(parent, data[start : start + width])
            start += width
            hashes.append(parent)

    def link(self, index: int) -> tuple[BlockKey, bytes]:
        """Block ``index``'s key ``(parent hash, its tokens)`` and that key's hash."""
        self.extend(index + 1)
        return self._keys[index], self._hashes[index]

    def cached_run(self, pool: _BlockPool, num_blocks: int) -> list[int]:
        """Ids of ``pool``'s cached blocks for the longest run of this chain's first ``num_blocks`` blocks. The
        chain is hashed one block first, then in doubling stretches: a miss early costs one block's hash, a
        long hit one pass, never more than twice the blocks the run covers."""
        run: list[int] = []
        hashed = 0
        keys, hashes = self._keys, self._hashes
        num_blocks = min(num_blocks, len(self._token_ids) // self._span)  # whole blocks only
        while len(run) < num_blocks:
            i = len(run)
            if i == hashed:
                hashed = min(num_blocks, max(1, 2 * hashed))
                self.extend(hashed)
            block_id = pool.lookup(keys[i], hashes[i])
            if block_id is None:
                break
            run.append(block_id)
        return run

    def parent_of(self, index: int) -> bytes:
        """The parent hash of block ``index``: the chained hash of the blocks before it."""
        return self.link(index - 1)[1] if index else _ROOT_HASH


class _BlockPool:
    """The blocks of one KV group: ref counts, the free queue (front = reused first) and the prefix cache."""

    def __init__(self, group: KVGroup) -> None:
        self.group = group
        self.num_blocks = group.num_blocks
        self.blocks = [_Block(i) for i in range(group.num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(group.num_blocks))
        self.cache: dict[bytes, int] = {}  # block digest -> block id
        self.num_leased = 0

    def take(self) -> int:
        block_id, _none = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # lazy eviction of the cached content
            if self.cache.get(block.block_hash) == block_id:
                del self.cache[block.block_hash]
            block.block_hash = None
            block.hash_key = None
        block.ref_count = 1
        self.num_leased += 1
        return block_id

    def ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
            self.num_leased += 1
        block.ref_count += 1

    def unref(self, block_id: int, reuse_first: bool = False) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.num_leased -= 1
            self.free[block_id] = None
            if block.block_hash is None or reuse_first:  # no content worth keeping (or the least worth it)
                self.free.move_to_end(block_id, last=False)

    def lookup(self, key: BlockKey, block_hash: bytes) -> int | None:
        """The cached block of ``key`` (whose hash is ``block_hash``), if any."""
        block_id = self.cache.get(block_hash)
        if block_id is None or self.blocks[block_id].hash_key != key:
            return None
        return block_id

    def uncache(self, block_id: int) -> bool:
        """Take ``block_id``'s content out of the prefix cache; True when it was cached."""
        block = self.blocks[block_id]
        if block.block_hash is None:
            return False
        if self.cache.get(block.block_hash) == block_id:
            del self.cache[block.block_hash]
        block.block_hash = None
        block.hash_key = None
        if block.ref_count == 0:  # nothing worth keeping: reused first
            self.free.move_to_end(block_id, last=False)
        return True

    def uncache_chains(self, roots: list[int]) -> list[int]:
        """Uncache ``roots`` and every cached block chained on one of them (a child names its parent's digest,
        whichever block held it); returns the blocks uncached. A scan of the pool: only on a failure."""
        children: dict[bytes, list[int]] = {}
        for block in self.blocks:
            if block.hash_key is not None:
                children.setdefault(block.hash_key[0], []).append(block.block_id)
        taken: list[int] = []
        pending = list(roots)
        while pending:
            block_id = pending.pop()
            digest = self.blocks[block_id].block_hash
            if digest is None or not self.uncache(block_id):
                continue
            taken.append(block_id)
            pending.extend(children.get(digest, ()))
        return taken

    def register(self, block_id: int, key: BlockKey, block_hash: bytes) -> None:
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self.cache:
            block.block_hash = block_hash
            block.hash_key = key
            self.cache[block_hash] = block_id
        # A duplicate of content cached elsewhere stays unhashed; the chain continues either way.

    def check(self, tables: dict[str, list[int]], index: int, flushed: frozenset[str] = frozenset()) -> None:
        """Raise IntegrityError when this pool's bookkeeping disagrees with the leases' ``tables``. ``flushed``:
        the leases alive at a prefix-cache flush, which may go on sharing the blocks it forgot (no later lease
        can reach an unhashed block, so a shared one held by any other lease is corruption)."""
        where = f"kv group {index}: "
        holders: dict[int, int] = {}
        held_by_later: set[int] = set()  # blocks some lease not in ``flushed`` holds
        for rid, table in tables.items():
            seen: set[int] = set()
            for b in table:
                if b == NULL_BLOCK_ID:
                    if not self.group.is_sliding:
                        raise IntegrityError(f"{where}lease {rid} has a null entry in a full-attention table")
                    continue
                if not 0 <= b < self.num_blocks:
                    raise IntegrityError(f"{where}lease {rid} holds block {b} outside [0, {self.num_blocks})")
                if b in seen:
                    raise IntegrityError(f"{where}lease {rid} holds block {b} twice")
                seen.add(b)
                holders[b] = holders.get(b, 0) + 1
                if rid not in flushed:
                    held_by_later.add(b)
            if NULL_BLOCK_ID in table:
                last_null = len(table) - 1 - table[::-1].index(NULL_BLOCK_ID)
                if any(b != NULL_BLOCK_ID for b in table[:last_null]):
                    raise IntegrityError(f"{where}lease {rid}: null entries must be a leading run")
        num_free = num_evictable = 0
        for block in self.blocks:
            held = holders.get(block.block_id, 0)
            if block.ref_count != held:
                raise IntegrityError(
                    f"{where}block {block.block_id} has ref count {block.ref_count} but {held} live leases hold it"
                )
            if held > 1 and block.block_hash is None and block.block_id in held_by_later:
                raise IntegrityError(
                    f"{where}block {block.block_id} is held by {held} requests but is not a cached block"
                )
            in_free = block.block_id in self.free
            if (block.ref_count == 0) != in_free:
                raise IntegrityError(
                    f"{where}block {block.block_id} ref count {block.ref_count} vs free-queue {in_free}"
                )
            if in_free:
                if block.block_hash is None:
                    num_free += 1
                else:
                    num_evictable += 1
            if block.block_hash is not None and self.cache.get(block.block_hash) != block.block_id:
                raise IntegrityError(
                    f"{where}block {block.block_id} keeps a hash the prefix cache maps elsewhere"
                )
        for block_hash, block_id in self.cache.items():
            if self.blocks[block_id].block_hash != block_hash:
                raise IntegrityError(
                    f"{where}prefix cache entry points at block {block_id} with another hash"
                )
        num_leased = sum(1 for b in self.blocks if b.ref_count > 0)
        if num_leased != self.num_leased:
            raise IntegrityError(f"{where}leased-block counter {self.num_leased} != {num_leased}")
        if num_free + num_evictable + num_leased != self.num_blocks:
            raise IntegrityError(
                f"{where}free {num_free} + evictable {num_evictable} + leased {num_leased} != total "
                f"{self.num_blocks}"
            )


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
    """Blocks of every KV group of one worker group, and the leases that hold them.

    ``layout`` states the groups (contract.kv_layout); empty means one full-attention group of ``num_blocks``
    blocks. With a layout, ``num_blocks`` caps every group's pool and ``block_size`` must match it.
    """

    def __init__(
        self,
        worker_id: str,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        layout: Sequence[KVGroup] = (),
        whole_prompt_hits: bool = False,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be > 0")
        if not layout:
            layout = (KVGroup(AttentionKind.FULL, (), block_size, num_blocks),)
        for i, group in enumerate(layout):
            if group.block_size != block_size:
                raise ValueError(f"kv group {i} has block size {group.block_size}, not {block_size}")
            if group.is_compressed and group.compress_ratio <= 0:
                raise ValueError(f"kv group {i}: a compressed group needs compress_ratio > 0")
        self.worker_id = worker_id
        self.layout = tuple(replace(g, num_blocks=min(g.num_blocks, num_blocks)) for g in layout)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._pools = [_BlockPool(g) for g in self.layout]
        # Prefix hits are whole blocks of every group.
        self.hit_granularity = math.lcm(*(g.tokens_per_block for g in self.layout))
        # Nothing ever slides without a sliding group: the per-step hot path skips the walk.
        self._slides = any(g.is_sliding for g in self.layout)
        # A sequence cached whole may hit every block (the worker computes its last token again without
        # writing KV): full-attention groups only, where a block's KV is a row per token and nothing slides.
        self.whole_prompt_hits = whole_prompt_hits and all(
            not g.is_sliding and not g.is_compressed for g in self.layout
        )
        self._leases: dict[str, _LeaseState] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- queries --------------------------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self._pools)

    @property
    def num_blocks(self) -> int:
        """Blocks of every group's pool."""
        return sum(p.num_blocks for p in self._pools)

    @property
    def num_available_blocks(self) -> int:
        """Blocks of every group that can be handed out now (free or evictable cached)."""
        return sum(len(p.free) for p in self._pools)

    def available_blocks(self) -> tuple[int, ...]:
        """Per group: blocks that can be handed out now."""
        return tuple(len(p.free) for p in self._pools)

    @property
    def num_leased_blocks(self) -> int:
        """Leased blocks over every group."""
        return sum(p.num_leased for p in self._pools)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def group_usage(self) -> tuple[tuple[int, int], ...]:
        """Per group: (leased blocks, blocks of its pool)."""
        return tuple((p.num_leased, p.num_blocks) for p in self._pools)

    def max_request_tokens(self, chunk_tokens: int) -> int:
        """Longest sequence one request could hold with every block, computing ``chunk_tokens`` per step.

        A sliding group bounds nothing when its pool holds a window plus a chunk (and the block each may
        straddle); one too small to hold even that bounds the context like a full group would.
        """
        limits = []
        for pool in self._pools:
            group = pool.group
            capacity = group.tokens_for_blocks(pool.num_blocks)
            if group.is_sliding and capacity >= group.sliding_window + chunk_tokens + 2 * self.block_size:
                continue
            limits.append(capacity)
        return min(limits) if limits else _UNBOUNDED_TOKENS

    def lease(self, request_id: str) -> KVLease | None:
        state = self._leases.get(request_id)
        return state.lease if state else None

    def leased_request_ids(self) -> list[str]:
        return list(self._leases)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks of ``num_tokens`` tokens in a group that keeps a row per token."""
        return -(-num_tokens // self.block_size)

    def footprint(self, num_tokens: int, num_computed_tokens: int = 0) -> tuple[int, ...]:
        """Per group: blocks a request holds while computing up to ``num_tokens`` from ``num_computed_tokens``.

        A full group holds every block; a sliding group drops the blocks wholly before its window; a
        compressed group holds the blocks of its complete chunks' rows.
        """
        return tuple(
            p.group.blocks_for_tokens(num_tokens) - self._num_slid(p.group, num_computed_tokens)
            for p in self._pools
        )

    def _num_slid(self, group: KVGroup, num_computed_tokens: int) -> int:
        return group.first_needed_position(num_computed_tokens) // self.block_size

    def find_prefix(self, token_ids: Sequence[int], record: bool = False) -> PrefixHit:
        """Longest run of leading blocks every group can serve from its cache, capped so the last token is
        recomputed. A full group must hold every block of the run; a sliding group only the blocks the next
        token's window reads (the others come back as NULL_BLOCK_ID), so a window pool far smaller than the
        prefix still serves it. With ``whole_prompt_hits`` a sequence cached whole hits every block (``whole``):
        only its last token is computed again, not its last block."""
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return PrefixHit()
        step = self.hit_granularity
        may_be_whole = self.whole_prompt_hits and len(token_ids) % step == 0
        limit = len(token_ids) if may_be_whole else self._hit_limit(len(token_ids))
        # Each group chains its hashes over the tokens its blocks cover, as far as a lookup reaches: a prompt
        # with nothing cached hashes one block.
        chains = [_HashChain(token_ids, pool.group.tokens_per_block) for pool in self._pools]
        found: list[dict[int, int | None]] = [{} for _ in self._pools]

        def lookup(g: int, i: int) -> int | None:
            if i not in found[g]:
                found[g][i] = self._pools[g].lookup(*chains[g].link(i))
            return found[g][i]

        num_hit = limit  # tokens, a multiple of step
        runs: dict[int, list[int]] = {}  # full and compressed groups: the leading run's block ids
        for g, pool in enumerate(self._pools):
            if not pool.group.is_sliding:
                span = pool.group.tokens_per_block
                runs[g] = chains[g].cached_run(pool, num_hit // span)
                if len(runs[g]) < num_hit // span:
                    num_hit = len(runs[g]) * span // step * step
        settled = False
        while not settled:  # sliding groups: the window of the run's end; a gap ends the run before it
            settled = True
            for g, pool in enumerate(self._pools):
                if not pool.group.is_sliding:
                    continue
                first = self._num_slid(pool.group, num_hit)
                last_block = num_hit // self.block_size - 1
                gap = next((i for i in range(last_block, first - 1, -1) if lookup(g, i) is None), None)
                if gap is not None:
                    num_hit, settled = gap * self.block_size // step * step, False
        per_group: list[tuple[int, ...]] = []
        for g, pool in enumerate(self._pools):
            first = self._num_slid(pool.group, num_hit)
            count = num_hit // pool.group.tokens_per_block
            ids = [NULL_BLOCK_ID] * first
            if g in runs:  # num_hit only shrank since the run was found
                ids.extend(runs[g][first:count])
            for i in range(len(ids), count):  # sliding groups: looked up while settling
                block_id = lookup(g, i)
                assert block_id is not None  # every group holds the blocks of the run it was settled on
                ids.append(block_id)
            per_group.append(tuple(ids))
        ends = tuple(
            chain.parent_of(num_hit // pool.group.tokens_per_block)
            for chain, pool in zip(chains, self._pools, strict=True)
        )
        whole = num_hit == len(token_ids)
        hit = PrefixHit(tuple(per_group), num_hit - 1 if whole else num_hit, ends, whole)
        if record:
            self.prefix_query_tokens += len(token_ids)
            self.prefix_hit_tokens += hit.num_tokens
        return hit

    # ---- allocation -----------------------------------------------------------------------------------

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        prefix: PrefixHit | None = None,
        num_computed_tokens: int | None = None,
        num_known_tokens: int | None = None,
    ) -> list[int] | None:
        """Grow ``request_id``'s lease to cover ``num_tokens`` tokens in every group; all or nothing.

        On the first call the lease starts with the ``prefix`` blocks (shared, ref count +1). Given
        ``num_computed_tokens`` (tokens already computed before this step), sliding groups first release the
        blocks their window has left (``slide``). Returns group 0's block ids appended to the lease (prefix
        blocks included on the first call; the other groups' are in ``lease.block_tables``), or None when
        some group lacks blocks; then nothing changed but the slide. ``num_known_tokens`` (first call: the
        request's tokens so far) sets which blocks leave a window to be reused first (``_LeaseState``).
        """
        state = self._leases.get(request_id)
        if state is not None and num_computed_tokens is not None and self._slides:
            self.slide(request_id, num_computed_tokens)
        if state is not None and prefix is None and num_tokens <= state.lease.num_tokens_reserved:
            state.num_tokens = max(state.num_tokens, num_tokens)
            return []  # fast path: a running request that needs no new block
        if state is not None and prefix is not None and prefix.num_tokens:
            raise ValueError("a prefix hit can only start a new lease")
        groups_prefix: list[tuple[int, ...]] = [()] * len(self._pools)
        if state is None and prefix is not None and prefix.group_block_ids:
            if len(prefix.group_block_ids) != len(self._pools):
                raise ValueError("prefix hit from another layout")
            groups_prefix = list(prefix.group_block_ids)
        for pool, ids in zip(self._pools, groups_prefix, strict=True):
            if any(b != NULL_BLOCK_ID and pool.blocks[b].block_hash is None for b in ids):
                raise ValueError("stale prefix hit: a block was evicted since find_prefix")
        needs: list[int] = []
        for g, pool in enumerate(self._pools):
            have = len(state.lease.block_tables[g]) if state else len(groups_prefix[g])
            need = max(pool.group.blocks_for_tokens(num_tokens) - have, 0)
            # Prefix blocks with ref 0 are in the free queue; taking them shrinks what is available.
            prefix_from_free = sum(
                1 for b in groups_prefix[g] if b != NULL_BLOCK_ID and pool.blocks[b].ref_count == 0
            )
            if need + prefix_from_free > len(pool.free):
                return None
            needs.append(need)
        if state is None:
            state = _LeaseState(
                KVLease(request_id, self.worker_id, block_tables=[[] for _ in self._pools]),
                num_hashed_blocks=[0] * len(self._pools),
                last_hashes=[_ROOT_HASH] * len(self._pools),
                cold_blocks=[self._cold_blocks(p.group, num_known_tokens or 0) for p in self._pools],
                num_prefix_blocks=[len(ids) for ids in groups_prefix],
            )
            self._leases[request_id] = state
            for pool, table, ids in zip(self._pools, state.lease.block_tables, groups_prefix, strict=True):
                for b in ids:
                    if b != NULL_BLOCK_ID:  # a sliding group's block before the window: not held
                        pool.ref(b)
                    table.append(b)
            state.lease.num_prefix_hit_tokens = prefix.num_kv_tokens if prefix is not None else 0
            if prefix is not None and prefix.group_chain_ends:  # the hit's blocks are registered already
                for g, pool in enumerate(self._pools):
                    state.num_hashed_blocks[g] = prefix.num_kv_tokens // pool.group.tokens_per_block
                    state.last_hashes[g] = prefix.group_chain_ends[g]
        added = list(groups_prefix[0])
        for g, (pool, table) in enumerate(zip(self._pools, state.lease.block_tables, strict=True)):
            for _ in range(needs[g]):
                block_id = pool.take()
                table.append(block_id)
                if g == 0:
                    added.append(block_id)
        state.num_tokens = max(state.num_tokens, num_tokens)
        state.lease.num_tokens_reserved = min(
            p.group.tokens_for_blocks(len(t))
            for p, t in zip(self._pools, state.lease.block_tables, strict=True)
        )
        if num_computed_tokens is not None and self._slides:
            self.slide(request_id, num_computed_tokens)
        return added

    def _cold_blocks(self, group: KVGroup, num_known_tokens: int) -> int:
        """Blocks of a sliding group wholly before the window that a hit on ``num_known_tokens`` reads."""
        if not group.is_sliding or num_known_tokens < 2:
            return 0
        return self._num_slid(group, self._hit_limit(num_known_tokens))

    def _hit_limit(self, num_tokens: int) -> int:
        """The longest hit of whole granules a sequence of ``num_tokens`` can get short of its last token (whose
        logits are needed); a whole-prompt hit (``find_prefix``) goes past it."""
        return (num_tokens - 1) // self.hit_granularity * self.hit_granularity

    def slide(self, request_id: str, num_computed_tokens: int) -> int:
        """Release, in every sliding group, the blocks wholly before the window of the next token.

        Only blocks no step at or after ``num_computed_tokens`` reads or writes go: the worker runs steps in
        order, so a block freed here is reused only by a later step. Returns the number of blocks freed.
        """
        state = self._leases.get(request_id)
        if state is None:
            return 0
        freed = 0
        for pool, table, cold in zip(self._pools, state.lease.block_tables, state.cold_blocks, strict=True):
            upto = min(self._num_slid(pool.group, num_computed_tokens), len(table))
            for i in range(upto - 1, -1, -1):  # newest first: stop at the already-null run
                if table[i] == NULL_BLOCK_ID:
                    break
                pool.unref(table[i], reuse_first=i < cold)
                table[i] = NULL_BLOCK_ID
                freed += 1
        return freed

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> bool:
        """Register the lease's full blocks whose tokens are known and computed in the prefix cache; True when
        some group's registered count moved (``registered_blocks`` then reads the new counts).

        A block is full once every token it covers is computed (a compressed block: ``block_size`` complete
        chunks); each group chains its own hashes over the tokens its blocks cover.
        """
        if not self.enable_prefix_caching:
            return False
        state = self._leases.get(request_id)
        if state is None or not state.registers:
            return False
        known = min(num_computed_tokens, len(token_ids))
        if known < state.next_full_tokens:
            return False  # the common decode step: no block of any group filled up since the last call
        for g, (pool, table) in enumerate(zip(self._pools, state.lease.block_tables, strict=True)):
            span = pool.group.tokens_per_block
            num_full = min(known // span, len(table))
            for i in range(state.num_hashed_blocks[g], num_full):
                block = tuple(token_ids[i * span : (i + 1) * span])
                key = (state.last_hashes[g], block)
                block_hash = _chain_digest(key[0], _block_bytes(block))
                if table[i] != NULL_BLOCK_ID:  # a slid-out block is gone; the chain continues
                    pool.register(table[i], key, block_hash)
                state.last_hashes[g] = block_hash
            state.num_hashed_blocks[g] = max(state.num_hashed_blocks[g], num_full)
        state.next_full_tokens = min(
            (n + 1) * p.group.tokens_per_block
            for n, p in zip(state.num_hashed_blocks, self._pools, strict=True)
        )
        return True

    def registered_blocks(self, request_id: str) -> tuple[int, ...]:
        """Per group: how many of the lease's leading blocks are registered (or skipped) so far."""
        state = self._leases.get(request_id)
        return tuple(state.num_hashed_blocks) if state is not None else ()

    def uncache_unwritten(self, request_id: str, written: Sequence[int]) -> set[tuple[int, int]]:
        """Take out of the prefix cache the blocks ``request_id`` registered itself beyond ``written`` (per
        group: its leading blocks whose steps the worker answered), and every cached block chained on them,
        whoever computed it. For a request the worker failed: blocks are registered when the steps filling
        them are built, and the worker computes nothing more for a request it failed, so such blocks may never
        be written, nor their descendants rightly computed. Returns the blocks taken, as (group, block id)."""
        state = self._leases.get(request_id)
        if state is None:
            return set()
        state.registers = False  # it is ending: nothing more of it is registered
        taken: set[tuple[int, int]] = set()
        for g, (pool, table) in enumerate(zip(self._pools, state.lease.block_tables, strict=True)):
            first = max(state.num_prefix_blocks[g], written[g] if g < len(written) else 0)
            roots = [b for b in table[first:] if b != NULL_BLOCK_ID and pool.blocks[b].block_hash is not None]
            if roots:
                taken.update((g, b) for b in pool.uncache_chains(roots))
        return taken

    def leases_holding(self, blocks: set[tuple[int, int]]) -> list[str]:
        """The requests whose leases hold any of ``blocks`` ((group, block id) pairs)."""
        return [
            rid
            for rid, state in self._leases.items()
            if any((g, b) in blocks for g, table in enumerate(state.lease.block_tables) for b in table)
        ]

    def free(self, request_id: str) -> list[int]:
        """Release the lease tail-first; returns group 0's block ids (empty when there was none)."""
        state = self._leases.pop(request_id, None)
        if state is None:
            return []
        for pool, table in zip(self._pools, state.lease.block_tables, strict=True):
            for block_id in reversed(table):
                if block_id != NULL_BLOCK_ID:
                    pool.unref(block_id)
        return [b for b in state.lease.block_tables[0] if b != NULL_BLOCK_ID]

    def reset_prefix_cache(self) -> None:
        """Forget every cached block: no later lookup hits anything cached before this call. Live leases keep
        their blocks (shared ones too, read but no longer cached) and register none of their later ones."""
        for pool in self._pools:
            for block in pool.blocks:
                block.block_hash = None
                block.hash_key = None
            pool.cache.clear()
        for state in self._leases.values():
            state.registers = False

    # ---- checks and stats -----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` when the bookkeeping of any group is inconsistent."""
        flushed = frozenset(rid for rid, state in self._leases.items() if not state.registers)
        for g, pool in enumerate(self._pools):
            tables: dict[str, list[int]] = {}
            for rid, state in self._leases.items():
                if len(state.lease.block_tables) != len(self._pools):
                    raise IntegrityError(f"lease {rid} has {len(state.lease.block_tables)} block tables")
                tables[rid] = state.lease.block_tables[g]
            pool.check(tables, g, flushed)
        for rid, state in self._leases.items():
            for g, (pool, table) in enumerate(zip(self._pools, state.lease.block_tables, strict=True)):
                want = pool.group.blocks_for_tokens(state.num_tokens)
                if len(table) != want:
                    raise IntegrityError(
                        f"lease {rid}: kv group {g} has {len(table)} blocks for {state.num_tokens} tokens, "
                        f"not {want}"
                    )

    def check_quiescent(self) -> None:
        """O(1) per group check for an idle registry: no lease may be left and every block must be reusable."""
        for g, pool in enumerate(self._pools):
            if self._leases or pool.num_leased or len(pool.free) != pool.num_blocks:
                raise IntegrityError(
                    f"idle registry holds {len(self._leases)} leases; kv group {g}: {pool.num_leased} leased "
                    f"blocks, {len(pool.free)} of {pool.num_blocks} blocks reusable"
                )

    def snapshot(self) -> RegistrySnapshot:
        """Counts over every group (num_blocks is the sum of the groups' pools)."""
        num_evictable = sum(1 for p in self._pools for b in p.free if p.blocks[b].block_hash is not None)
        num_free = sum(len(p.free) for p in self._pools)
        return RegistrySnapshot(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_leased_blocks=self.num_leased_blocks,
            num_free_blocks=num_free - num_evictable,
            num_cached_evictable_blocks=num_evictable,
            num_cached_blocks=sum(len(p.cache) for p in self._pools),
            num_leases=len(self._leases),
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
        )
