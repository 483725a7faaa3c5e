"""KV registry: unit cases and hypothesis state machines over allocate/grow/cache/free/prefix-hit/evict."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ominix_runtime.engine.kv_registry import IntegrityError, KVRegistry

BS = 4


def test_prefix_hit_is_block_aligned_and_leaves_the_last_token() -> None:
    reg = KVRegistry("w", num_blocks=16, block_size=BS)
    tokens = list(range(100, 112))  # exactly 3 full blocks
    assert reg.allocate("a", len(tokens)) is not None
    reg.cache_blocks("a", tokens, len(tokens))
    reg.free("a")
    hit = reg.find_prefix(tokens)
    assert hit.num_tokens == 8  # 12 - 1 = 11 -> 2 full blocks: the last block is recomputed
    assert reg.find_prefix(tokens + [7]).num_tokens == 12
    assert reg.find_prefix([1] + tokens).num_tokens == 0  # chained: a different first block changes all
    reg.check_integrity()


@pytest.mark.parametrize("cached_blocks", [0, 1, 5, 8, 9, 20])
def test_prefix_lookup_hashes_at_most_twice_the_run_and_finds_all_of_it(
    cached_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chain is hashed in doubling stretches: one block when nothing is cached, never more than twice the
    hit's blocks (plus one), and the run found is the whole cached run, up to the last token's block."""
    from ominix_runtime.engine import kv_registry

    reg = KVRegistry("w", num_blocks=64, block_size=BS)
    tokens = list(range(1000, 1000 + 20 * BS + 3))  # 20 whole blocks and a partial one
    if cached_blocks:
        assert reg.allocate("a", cached_blocks * BS) is not None
        reg.cache_blocks("a", tokens, cached_blocks * BS)
        reg.free("a")
    hashed: list[int] = []
    extend = kv_registry._HashChain.extend

    def counting_extend(chain: kv_registry._HashChain, count: int) -> None:
        before = len(chain._keys)
        extend(chain, count)
        hashed.append(len(chain._keys) - before)

    monkeypatch.setattr(kv_registry._HashChain, "extend", counting_extend)
    hit = reg.find_prefix(tokens)
    assert hit.num_tokens == cached_blocks * BS
    assert len(hit.kv_block_ids) == cached_blocks
    assert 1 <= sum(hashed) <= 2 * cached_blocks + 1
    reg.check_integrity()


def test_free_is_tail_first_and_unhashed_blocks_are_reused_first() -> None:
    reg = KVRegistry("w", num_blocks=6, block_size=BS)
    tokens = list(range(16))
    blocks = reg.allocate("a", 18)  # 5 blocks: 4 full + 1 partial
    assert blocks is not None and len(blocks) == 5
    reg.cache_blocks("a", tokens, 16)
    reg.free("a")
    # The partial block and the never-used block are handed out before any cached block.
    first = reg.allocate("b", 2 * BS)
    assert first is not None and set(first) == {blocks[4], 5}
    # Then cached blocks are evicted tail-first, so the head of the prefix survives longest.
    nxt = reg.allocate("c", BS)
    assert nxt == [blocks[3]]
    assert reg.find_prefix(tokens + [99]).num_tokens == 3 * BS
    reg.check_integrity()


def test_allocate_is_all_or_nothing() -> None:
    reg = KVRegistry("w", num_blocks=4, block_size=BS)
    assert reg.allocate("a", 3 * BS) is not None
    assert reg.allocate("b", 2 * BS) is None
    assert reg.lease("b") is None
    assert reg.num_available_blocks == 1
    reg.check_integrity()


def test_shared_prefix_blocks_are_ref_counted() -> None:
    reg = KVRegistry("w", num_blocks=8, block_size=BS)
    tokens = list(range(9))
    reg.allocate("a", 9)
    reg.cache_blocks("a", tokens, 9)
    hit = reg.find_prefix(tokens)
    assert hit.num_tokens == 8
    added = reg.allocate("b", 9, hit)
    assert added is not None and added[:2] == list(hit.kv_block_ids)
    reg.check_integrity()
    reg.free("a")
    reg.check_integrity()
    lease = reg.lease("b")
    assert lease is not None and lease.num_prefix_hit_tokens == 8
    reg.free("b")
    assert reg.num_leased_blocks == 0
    reg.check_integrity()


def test_a_lease_started_from_a_hit_caches_its_later_blocks_on_the_same_chain() -> None:
    """The hit carries its chain's end, so the lease hashes only the blocks after it; a follow-up prompt that
    extends the second request hits all of them, and a prompt that differs inside the hit hits none after."""
    reg = KVRegistry("w", num_blocks=16, block_size=BS)
    first = list(range(100, 109))  # 2 full blocks + 1 token
    reg.allocate("a", len(first))
    reg.cache_blocks("a", first, len(first))
    second = first[:8] + list(range(200, 209))  # the 2 blocks, then 2 more full blocks + 1 token
    hit = reg.find_prefix(second)
    assert hit.num_tokens == 8 and len(hit.group_chain_ends) == 1
    reg.allocate("b", len(second), hit)
    reg.cache_blocks("b", second, len(second))
    assert reg.find_prefix(second + [1]).num_tokens == 16
    fresh = KVRegistry("w", num_blocks=16, block_size=BS)  # the same blocks hashed from the root
    fresh.allocate("c", len(second))
    fresh.cache_blocks("c", second, len(second))
    assert fresh.find_prefix(second + [1]).num_tokens == 16
    assert reg.find_prefix(second + [1]).group_chain_ends == fresh.find_prefix(second + [1]).group_chain_ends
    changed = [first[0] + 1] + second[1:] + [1]
    assert reg.find_prefix(changed).num_tokens == 0
    reg.check_integrity()


def test_a_flush_forgets_blocks_live_requests_share_and_what_they_compute_after_it() -> None:
    """A flush under load: two live requests share a prefix. Afterwards no prompt hits anything, neither the
    shared blocks nor blocks the live requests fill after the flush (their KV predates it), the registry stays
    consistent while they still share, and it ends quiescent once all are freed."""
    reg = KVRegistry("w", num_blocks=16, block_size=BS)
    tokens = list(range(100, 109))  # 2 full blocks + 1 token
    reg.allocate("a", len(tokens))
    reg.cache_blocks("a", tokens, len(tokens))
    hit = reg.find_prefix(tokens)
    assert hit.num_tokens == 8
    reg.allocate("b", len(tokens), hit)
    reg.reset_prefix_cache()
    reg.check_integrity()  # two leases share blocks that are no longer cached
    assert reg.find_prefix(tokens).num_tokens == 0
    longer = tokens + list(range(200, 207))  # "b" grows past two more full blocks after the flush
    reg.allocate("b", len(longer))
    reg.cache_blocks("b", longer, len(longer))
    assert reg.find_prefix(longer + [1]).num_tokens == 0
    reg.check_integrity()
    reg.free("a")
    reg.check_integrity()
    # "b" is kept live until "c" below: its blocks after the prefix stay in the pool, unregistered.
    # A request admitted after the flush caches its blocks again; the chain it starts does not lead on into
    # the blocks "b" filled after the flush.
    reg.allocate("c", len(tokens))
    reg.cache_blocks("c", tokens, len(tokens))
    assert reg.find_prefix(tokens).num_tokens == 8
    assert reg.find_prefix(longer + [1]).num_tokens == 8
    reg.free("b")
    reg.free("c")
    reg.check_integrity()
    reg.check_quiescent()


def test_integrity_check_catches_corruption() -> None:
    reg = KVRegistry("w", num_blocks=4, block_size=BS)
    reg.allocate("a", BS)
    reg._pools[0].blocks[0].ref_count = 2
    with pytest.raises(IntegrityError):
        reg.check_integrity()


class RegistryMachine(RuleBasedStateMachine):
    """Random interleavings; a model of the worker's KV checks every prefix hit is real content."""

    @initialize(num_blocks=st.integers(2, 24), whole_hits=st.booleans())
    def setup(self, num_blocks: int, whole_hits: bool) -> None:
        self.reg = KVRegistry("w", num_blocks=num_blocks, block_size=BS, whole_prompt_hits=whole_hits)
        self.tokens: dict[str, list[int]] = {}  # live request -> its tokens
        self.computed: dict[str, int] = {}  # positions below hold KV: written, or found whole in the cache
        self.content: dict[int, dict[int, int]] = {}  # block -> slot -> token written (worker's view)
        self.seen: list[tuple[int, ...]] = []  # every admitted request's tokens, as they grew
        self.n = 0
        # Flushes so far; a request is admitted in the current one, and a block was last written by a
        # request of some epoch: a hit may only serve blocks written by requests admitted since the last flush.
        self.epoch = 0
        self.admitted_in: dict[str, int] = {}
        self.written_in: dict[int, int] = {}

    def _write(self, rid: str, upto: int) -> None:
        """The worker writes KV for positions [computed, upto) into the lease's blocks."""
        lease = self.reg.lease(rid)
        assert lease is not None
        toks = self.tokens[rid]
        for pos in range(self.computed[rid], upto):
            self.content.setdefault(lease.kv_block_ids[pos // BS], {})[pos % BS] = toks[pos]
            self.written_in[lease.kv_block_ids[pos // BS]] = self.admitted_in[rid]
        self.computed[rid] = max(self.computed[rid], upto)

    @rule(
        prompt=st.lists(st.integers(0, 2), min_size=1, max_size=20),
        extra=st.integers(0, 8),
        use_prefix=st.booleans(),
    )
    def admit(self, prompt: list[int], extra: int, use_prefix: bool) -> None:
        self._admit(prompt, extra, use_prefix)

    @precondition(lambda self: bool(self.seen))
    @rule(data=st.data(), extra=st.integers(0, 8))
    def admit_again(self, data: st.DataObject, extra: int) -> None:
        """The tokens of an earlier request, prompt and all (whole blocks of them may be cached whole)."""
        self._admit(list(data.draw(st.sampled_from(self.seen))), extra, use_prefix=True)

    def _admit(self, prompt: list[int], extra: int, use_prefix: bool) -> None:
        rid = f"r{self.n}"
        self.n += 1
        hit = self.reg.find_prefix(prompt) if use_prefix else None
        need = len(prompt) + extra
        added = self.reg.allocate(rid, need, hit)
        if added is None:
            assert self.reg.lease(rid) is None
            return
        self.tokens[rid] = list(prompt)
        self.admitted_in[rid] = self.epoch
        # A whole-prompt hit's last token is computed again but not written: its KV is in the shared block.
        self.computed[rid] = hit.num_kv_tokens if hit else 0
        if hit:
            assert hit.num_tokens < len(prompt)
            assert hit.whole == (hit.num_kv_tokens == len(prompt))
            assert not hit.whole or self.reg.whole_prompt_hits
            for i, b in enumerate(hit.kv_block_ids):  # a hit must hold exactly this request's tokens
                written = self.content[b]
                assert [written.get(j) for j in range(BS)] == prompt[i * BS : (i + 1) * BS]
                assert self.written_in[b] == self.epoch, f"block {b} was written before the last flush"
        self._write(rid, len(prompt))
        self.reg.cache_blocks(rid, prompt, len(prompt))
        self.seen.append(tuple(prompt))

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), grow=st.integers(1, 9))
    def append(self, data: st.DataObject, grow: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        toks = self.tokens[rid]
        if self.reg.allocate(rid, len(toks) + grow) is None:
            return
        toks.extend(data.draw(st.lists(st.integers(0, 2), min_size=grow, max_size=grow)))
        self._write(rid, len(toks))
        self.reg.cache_blocks(rid, toks, len(toks))
        self.seen.append(tuple(toks))

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        del self.tokens[rid]
        del self.computed[rid]
        self.reg.free(rid)

    @rule()
    def flush(self) -> None:
        """Forget the prefix cache (an operator's flush, e.g. after new weights), live leases and all."""
        self.reg.reset_prefix_cache()
        self.epoch += 1

    @rule()
    def evict_by_pressure(self) -> None:
        """Grab every available block (evicting cached ones), then give them back."""
        n = self.reg.num_available_blocks
        if n and self.reg.allocate("__pressure__", n * BS) is not None:
            self.reg.free("__pressure__")

    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "reg"):
            return
        self.reg.check_integrity()
        # No block is written by two live requests: shared blocks are only read (prefix hits).
        owners: dict[int, str] = {}
        for rid in self.tokens:
            lease = self.reg.lease(rid)
            assert lease is not None
            for i, b in enumerate(lease.kv_block_ids):
                writes = (i + 1) * BS > lease.num_prefix_hit_tokens
                if writes:
                    assert b not in owners, f"block {b} written by {owners.get(b)} and {rid}"
                    owners[b] = rid
        snap = self.reg.snapshot()
        assert (
            snap.num_free_blocks + snap.num_cached_evictable_blocks + snap.num_leased_blocks
            == snap.num_blocks
        )


TestRegistryMachine = RegistryMachine.TestCase
TestRegistryMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
