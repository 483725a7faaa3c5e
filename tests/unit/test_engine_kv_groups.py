"""KV groups: per-group pools, sliding-window release, prefix hits across groups, and a hypothesis state
machine over mixed layouts (allocate / grow with slide / free / evict), integrity checked after each rule."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ominix_runtime.contract import (
    FAKE_PROFILE,
    NULL_BLOCK_ID,
    AttentionKind,
    KVGroup,
    ModelInfo,
    NewRequestData,
    RunningRequestData,
    SamplingParams,
    stated_profile,
)
from ominix_runtime.contract.capability import BackendKind
from ominix_runtime.contract.step import DecodeStep
from ominix_runtime.engine.kv_registry import IntegrityError, KVRegistry, PrefixHit
from ominix_runtime.wire import capability_from_pb, capability_to_pb, step_from_pb, step_to_pb

BS = 4


def full(num_blocks: int, layers: tuple[int, ...] = (0,)) -> KVGroup:
    return KVGroup(AttentionKind.FULL, layers, BS, num_blocks, bytes_per_token_per_layer=64)


def sliding(num_blocks: int, window: int, layers: tuple[int, ...] = (1,)) -> KVGroup:
    return KVGroup(
        AttentionKind.SLIDING_WINDOW,
        layers,
        BS,
        num_blocks,
        bytes_per_token_per_layer=64,
        sliding_window=window,
    )


def test_a_sliding_group_frees_blocks_behind_the_window_and_keeps_positions() -> None:
    reg = KVRegistry("w", 64, BS, layout=(full(64), sliding(64, window=8)))
    assert reg.allocate("a", 10, num_computed_tokens=0) is not None
    lease = reg.lease("a")
    assert lease is not None
    assert [len(t) for t in lease.block_tables] == [3, 3]
    # Decode up to 30 tokens: a step starting at 29 computed reads positions >= 21, block 5 onwards.
    for computed in range(10, 30):
        assert reg.allocate("a", computed + 1, num_computed_tokens=computed) is not None
        reg.check_integrity()
    full_table, window_table = lease.block_tables
    assert NULL_BLOCK_ID not in full_table and len(full_table) == 8
    assert len(window_table) == 8  # position p still lives in entry p // BS
    assert window_table[:5] == [NULL_BLOCK_ID] * 5 and NULL_BLOCK_ID not in window_table[5:]
    assert reg.available_blocks() == (64 - 8, 64 - 3)
    reg.free("a")
    reg.check_quiescent()


def test_footprint_counts_only_the_window_of_a_sliding_group() -> None:
    reg = KVRegistry("w", 1024, BS, layout=(sliding(1024, window=16, layers=(0, 1)),))
    assert reg.footprint(2048, num_computed_tokens=2000) == (2048 // BS - (2000 - 16) // BS,)
    assert reg.footprint(2048) == (2048 // BS,)
    full_reg = KVRegistry("w", 1024, BS)
    assert full_reg.footprint(2048, num_computed_tokens=2000) == (2048 // BS,)


def _to_front(pool_free: dict[int, None], block_ids: list[int]) -> None:
    """Make these free blocks the next ones handed out (their cached content is evicted then)."""
    for block_id in block_ids:
        pool_free.move_to_end(block_id, last=False)  # type: ignore[attr-defined]


def test_a_prefix_hit_needs_the_full_groups_run_and_only_the_windows_blocks() -> None:
    reg = KVRegistry("w", 16, BS, layout=(full(16), sliding(16, window=4)))
    tokens = list(range(100, 117))  # 17 tokens: 4 full blocks
    assert reg.allocate("a", len(tokens), num_computed_tokens=0) is not None
    a_full, a_window = (list(t) for t in reg.lease("a").block_tables)  # type: ignore[union-attr]
    reg.cache_blocks("a", tokens, len(tokens))
    reg.free("a")
    hit = reg.find_prefix(tokens)
    # The window of position 16 reads block 3 only: the sliding group's earlier blocks come back null.
    assert hit.num_tokens == 16
    assert hit.group_block_ids == (tuple(a_full[:4]), (NULL_BLOCK_ID,) * 3 + (a_window[3],))
    # Evict the sliding group's blocks 0 and 1: the window never reads them, the hit stays whole.
    sliding_pool = reg._pools[1]
    _to_front(sliding_pool.free, a_window[:2])
    assert reg.allocate("p", 2 * BS, num_computed_tokens=0) is not None
    assert reg.find_prefix(tokens).num_tokens == 16
    # Evict block 3, inside the window: the run ends before it, where the window (block 2) is still cached.
    _to_front(sliding_pool.free, [a_window[3]])
    assert reg.allocate("q", BS, num_computed_tokens=0) is not None
    hit = reg.find_prefix(tokens)
    assert hit.num_tokens == 12
    assert hit.group_block_ids == (tuple(a_full[:3]), (NULL_BLOCK_ID,) * 2 + (a_window[2],))
    assert reg.allocate("b", len(tokens), hit, num_computed_tokens=12) is not None
    lease = reg.lease("b")
    assert lease is not None and lease.block_tables[0][:3] == a_full[:3]
    assert lease.block_tables[1][:3] == [NULL_BLOCK_ID, NULL_BLOCK_ID, a_window[2]]
    reg.check_integrity()
    reg.free("b")
    # A full group's gap ends the run: block 1 gone leaves at most block 0, whose window (block 0 of the
    # sliding group) was evicted above, so nothing is left.
    _to_front(reg._pools[0].free, [a_full[1]])
    assert reg.allocate("r", BS, num_computed_tokens=0) is not None
    assert reg.find_prefix(tokens) == PrefixHit(((), ()), 0)
    for rid in ("p", "q", "r"):
        reg.free(rid)
    reg.check_quiescent()


def test_slid_blocks_are_cached_before_they_leave_and_shared_hits_are_ref_counted() -> None:
    reg = KVRegistry("w", 32, BS, layout=(full(32), sliding(32, window=4)))
    tokens = list(range(24))
    for c in range(0, 24, 4):
        assert reg.allocate("a", c + 4, num_computed_tokens=c) is not None
        reg.cache_blocks("a", tokens, c + 4)
    hit = reg.find_prefix(tokens + [7])
    assert hit.num_tokens == 24  # slid blocks stay cached (evictable) after they leave the window
    assert reg.allocate("b", 25, hit, num_computed_tokens=24) is not None
    lease = reg.lease("b")
    assert lease is not None and lease.block_tables[1][0] == NULL_BLOCK_ID
    reg.check_integrity()
    reg.free("a")
    reg.free("b")
    reg.check_quiescent()


def test_layout_checks() -> None:
    with pytest.raises(ValueError, match="compress_ratio > 0"):
        KVRegistry("w", 8, BS, layout=(KVGroup(AttentionKind.COMPRESSED, (0,), BS, 8),))
    with pytest.raises(ValueError, match="block size"):
        KVRegistry("w", 8, BS, layout=(KVGroup(AttentionKind.FULL, (0,), 8, 8),))
    model = ModelInfo("m", 100, 4096, (0,), num_layers=2)
    cap = stated_profile(BackendKind.FAKE, model=model, kv_block_size=BS, kv_num_blocks=8)
    assert cap.problems() == []
    (default,) = cap.kv_layout
    assert default.kind == AttentionKind.FULL and default.layer_indices == (0, 1) and default.num_blocks == 8
    bad = stated_profile(
        BackendKind.FAKE,
        model=model,
        kv_block_size=BS,
        kv_num_blocks=8,
        kv_groups=(full(8, (0, 1)), sliding(8, window=0, layers=(1,))),
    )
    problems = " ".join(bad.problems())
    assert "needs sliding_window > 0" in problems and "belong to two groups" in problems
    compressed = stated_profile(
        BackendKind.FAKE,
        model=model,
        kv_block_size=BS,
        kv_num_blocks=8,
        kv_groups=(full(8, (0,)), KVGroup(AttentionKind.COMPRESSED, (1,), BS, 8, compress_ratio=4)),
    )
    assert any("no full or sliding-window group" in p for p in compressed.problems())


def test_integrity_catches_a_null_entry_in_a_full_group() -> None:
    reg = KVRegistry("w", 8, BS, layout=(full(8), sliding(8, window=4)))
    reg.allocate("a", 8, num_computed_tokens=0)
    lease = reg.lease("a")
    assert lease is not None
    reg._pools[0].unref(lease.block_tables[0][0])
    lease.block_tables[0][0] = NULL_BLOCK_ID
    with pytest.raises(IntegrityError, match="null entry"):
        reg.check_integrity()


def test_groups_and_tables_cross_the_wire() -> None:
    groups = (full(16, (0, 2)), sliding(16, window=8, layers=(1, 3)))
    cap = stated_profile(
        BackendKind.FAKE,
        model=ModelInfo("m", 100, 4096, (0,), num_layers=4),
        kv_block_size=BS,
        kv_num_blocks=16,
        kv_groups=groups,
    )
    assert capability_from_pb(capability_to_pb(cap)) == cap
    assert capability_from_pb(capability_to_pb(FAKE_PROFILE)).kv_groups == ()
    step = DecodeStep(
        1,
        new_requests=[
            NewRequestData(
                "a",
                [1, 2],
                SamplingParams(),
                [NULL_BLOCK_ID, 3],
                0,
                2,
                7,
                group_kv_block_ids=[[NULL_BLOCK_ID, 5]],
            )
        ],
        running_requests=[RunningRequestData("b", [4], 1, new_group_kv_block_ids=[[6]])],
    )
    back = step_from_pb(step_to_pb(step))
    assert back.new_requests[0].kv_block_ids == [NULL_BLOCK_ID, 3]
    assert back.new_requests[0].group_kv_block_ids == [[NULL_BLOCK_ID, 5]]
    assert back.running_requests[0].new_group_kv_block_ids == [[6]]


class MixedGroupsMachine(RuleBasedStateMachine):
    """Random interleavings over a full group plus sliding groups; a model of the worker's KV per group
    checks that every prefix hit is real content and every position a step may still read is intact."""

    @initialize(
        num_blocks=st.integers(4, 24),
        windows=st.lists(st.sampled_from([1, 3, 4, 8, 13]), min_size=1, max_size=2),
        with_full=st.booleans(),
        pool_sizes=st.lists(st.integers(2, 24), min_size=2, max_size=2),
        own_pools=st.booleans(),
    )
    def setup(
        self, num_blocks: int, windows: list[int], with_full: bool, pool_sizes: list[int], own_pools: bool
    ) -> None:
        # own_pools: each sliding group gets a pool of its own size (a worker sizes a window's pool apart
        # from the full group's), else every group has num_blocks.
        sizes = pool_sizes if own_pools else [num_blocks] * len(windows)
        layout = [full(num_blocks, (0,))] if with_full else []
        layout += [sliding(n, w, (i + 1,)) for i, (w, n) in enumerate(zip(windows, sizes, strict=False))]
        self.layout = tuple(layout)
        self.reg = KVRegistry("w", max(g.num_blocks for g in layout), BS, layout=self.layout)
        assert [g.num_blocks for g in self.reg.layout] == [g.num_blocks for g in layout]
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.content: list[dict[int, dict[int, int]]] = [
            {} for _ in layout
        ]  # group -> block -> slot -> token
        self.n = 0
        # Flushes so far; the flush each live request was admitted after, and each (group, block)'s last
        # writer's: a hit may only serve blocks written by requests admitted since the last flush.
        self.epoch = 0
        self.admitted_in: dict[str, int] = {}
        self.written_in: dict[tuple[int, int], int] = {}

    def _write(self, rid: str, upto: int) -> None:
        lease = self.reg.lease(rid)
        assert lease is not None
        toks = self.tokens[rid]
        for g, table in enumerate(lease.block_tables):
            for pos in range(self.computed[rid], upto):
                block = table[pos // BS]
                assert block != NULL_BLOCK_ID, f"group {g}: position {pos} being computed has no block"
                self.content[g].setdefault(block, {})[pos % BS] = toks[pos]
                self.written_in[g, block] = self.admitted_in[rid]
        self.computed[rid] = max(self.computed[rid], upto)

    @rule(
        prompt=st.lists(st.integers(0, 2), min_size=1, max_size=20),
        extra=st.integers(0, 6),
        use_prefix=st.booleans(),
    )
    def admit(self, prompt: list[int], extra: int, use_prefix: bool) -> None:
        rid = f"r{self.n}"
        self.n += 1
        hit = self.reg.find_prefix(prompt) if use_prefix else None
        start = hit.num_tokens if hit else 0
        if self.reg.allocate(rid, len(prompt) + extra, hit, num_computed_tokens=start) is None:
            assert self.reg.lease(rid) is None
            return
        self.tokens[rid] = list(prompt)
        self.computed[rid] = start
        self.admitted_in[rid] = self.epoch
        if hit:
            assert hit.num_tokens < len(prompt)
            for g, blocks in enumerate(hit.group_block_ids):
                assert len(blocks) == hit.num_tokens // BS
                group = self.layout[g]
                readable = group.first_needed_position(hit.num_tokens) // BS  # null only before the window
                assert NULL_BLOCK_ID not in blocks[readable:]
                for i, b in enumerate(blocks):
                    if b == NULL_BLOCK_ID:
                        assert group.is_sliding and i < readable
                        continue
                    written = self.content[g][b]
                    assert [written.get(j) for j in range(BS)] == prompt[i * BS : (i + 1) * BS]
                    assert self.written_in[g, b] == self.epoch, f"group {g}: block {b} predates the flush"
        self._write(rid, len(prompt))
        self.reg.cache_blocks(rid, prompt, len(prompt))

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), grow=st.integers(1, 9))
    def step(self, data: st.DataObject, grow: int) -> None:
        """One step of a running request: slide past its window, grow, write the new positions."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        toks = self.tokens[rid]
        if self.reg.allocate(rid, len(toks) + grow, num_computed_tokens=self.computed[rid]) is None:
            return
        toks.extend(data.draw(st.lists(st.integers(0, 2), min_size=grow, max_size=grow)))
        self._write(rid, len(toks))
        self.reg.cache_blocks(rid, toks, len(toks))

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        del self.tokens[rid]
        del self.computed[rid]
        self.reg.free(rid)

    @rule()
    def flush(self) -> None:
        """Forget the prefix cache while requests run (an operator's flush)."""
        self.reg.reset_prefix_cache()
        self.epoch += 1

    @rule()
    def evict_by_pressure(self) -> None:
        """Grab every available block of the tightest group (evicting cached ones), then give them back."""
        n = min(self.reg.available_blocks())
        if n and self.reg.allocate("__pressure__", n * BS, num_computed_tokens=0) is not None:
            self.reg.free("__pressure__")

    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "reg"):
            return
        self.reg.check_integrity()
        owners: list[dict[int, str]] = [{} for _ in self.layout]
        for rid, toks in self.tokens.items():
            lease = self.reg.lease(rid)
            assert lease is not None
            c = self.computed[rid]
            for g, (group, table) in enumerate(zip(self.layout, lease.block_tables, strict=True)):
                # Every position the next step may read still holds this request's token.
                for pos in range(max(0, c - group.sliding_window) if group.is_sliding else 0, c):
                    block = table[pos // BS]
                    assert block != NULL_BLOCK_ID, f"group {g}: readable position {pos} lost its block"
                    assert self.content[g][block].get(pos % BS) == toks[pos]
                for i, b in enumerate(table):
                    if b != NULL_BLOCK_ID and (i + 1) * BS > lease.num_prefix_hit_tokens:
                        assert b not in owners[g], f"group {g}: block {b} written by {owners[g][b]} and {rid}"
                        owners[g][b] = rid
        snap = self.reg.snapshot()
        assert (
            snap.num_free_blocks + snap.num_cached_evictable_blocks + snap.num_leased_blocks
            == snap.num_blocks
        )


TestMixedGroupsMachine = MixedGroupsMachine.TestCase
TestMixedGroupsMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
