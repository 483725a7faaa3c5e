"""Compressed KV groups (one row per compress_ratio tokens) in the registry and the scheduler: table sizes,
the trailing partial chunk, prefix hits in whole compressed blocks, admission by the real footprint, and a
hypothesis state machine over layouts mixing full, sliding-window and compressed groups."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ominix_runtime.contract import (
    NULL_BLOCK_ID,
    AttentionKind,
    KVGroup,
    ModelInfo,
    OminixError,
    RequestOutput,
    SamplingParams,
    StepResult,
    stated_profile,
)
from ominix_runtime.contract.capability import BackendKind
from ominix_runtime.contract.request import GenerateRequest
from ominix_runtime.engine.config import SchedulerConfig
from ominix_runtime.engine.kv_registry import KVRegistry
from ominix_runtime.engine.scheduler import Scheduler

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


def compressed(num_blocks: int, ratio: int, layers: tuple[int, ...] = (1,)) -> KVGroup:
    return KVGroup(
        AttentionKind.COMPRESSED, layers, BS, num_blocks, bytes_per_token_per_layer=64, compress_ratio=ratio
    )


def test_a_compressed_table_covers_complete_chunks_only() -> None:
    group = compressed(8, ratio=3)
    # 11 tokens: chunks 0..2 complete (rows 0..2), tokens 9 and 10 are the trailing partial chunk.
    assert group.rows_for_tokens(11) == 3 and group.blocks_for_tokens(11) == 1
    assert group.blocks_for_tokens(2) == 0  # no complete chunk yet: no block at all
    assert group.blocks_for_tokens(12) == 1 and group.blocks_for_tokens(15) == 2
    assert group.tokens_per_block == BS * 3
    assert group.tokens_for_blocks(1) == 14  # 4 rows = 12 tokens, plus a partial chunk of 2
    assert group.blocks_for_tokens(group.tokens_for_blocks(1)) == 1
    assert group.blocks_for_tokens(group.tokens_for_blocks(1) + 1) == 2

    reg = KVRegistry("w", 64, BS, layout=(sliding(64, window=8), compressed(64, ratio=3)))
    added = reg.allocate("a", 2, num_computed_tokens=0)
    lease = reg.lease("a")
    assert lease is not None and added == lease.block_tables[0] and len(added) == 1
    assert lease.block_tables[1] == [] and lease.num_tokens_reserved == 2
    for computed in range(2, 40):
        assert reg.allocate("a", computed + 1, num_computed_tokens=computed) is not None
        reg.check_integrity()
        assert len(lease.block_tables[1]) == (computed + 1) // 3 // BS + ((computed + 1) // 3 % BS > 0)
        assert lease.num_tokens_reserved >= computed + 1
    assert NULL_BLOCK_ID not in lease.block_tables[1]  # compressed rows never slide out
    assert lease.block_tables[0][0] == NULL_BLOCK_ID  # the raw window did
    reg.free("a")
    reg.check_quiescent()


def test_footprint_and_capacity_of_a_compressed_group() -> None:
    reg = KVRegistry("w", 10, BS, layout=(sliding(10, window=8, layers=(0, 1)), compressed(10, 4, (1,))))
    # 1,000 tokens decoded from 990: the window keeps 3-4 blocks, the compressed group 250 rows = 63 blocks.
    assert reg.footprint(1000, num_computed_tokens=990) == (250 - (990 - 8) // BS, 63)
    # The compressed pool (10 blocks = 40 rows) bounds a request at 40 chunks plus a partial one.
    assert reg.max_request_tokens(chunk_tokens=8) == (10 * BS + 1) * 4 - 1
    assert reg.allocate("a", 163, num_computed_tokens=0) is None  # 40 rows + 3 tokens: the window still
    assert reg.allocate("a", 40, num_computed_tokens=0) is not None  # grows 40 → 163 step by step
    for computed in range(40, 163, 8):
        assert reg.allocate("a", min(computed + 8, 163), num_computed_tokens=computed) is not None
    assert reg.available_blocks()[1] == 0
    assert reg.allocate("a", 164, num_computed_tokens=163) is None  # chunk 41 would need an 11th block
    reg.check_integrity()


def test_prefix_hits_are_whole_compressed_blocks_and_the_partial_chunk_is_recomputed() -> None:
    layout = (full(32, (0,)), sliding(32, window=6, layers=(1,)), compressed(32, 2, (1,)))
    reg = KVRegistry("w", 32, BS, layout=layout)
    assert reg.hit_granularity == BS * 2
    tokens = list(range(100, 125))  # 25 tokens: 12 complete chunks = 3 compressed blocks, 1 partial token
    for c in range(0, 25, 5):
        assert reg.allocate("a", c + 5, num_computed_tokens=c) is not None
        reg.cache_blocks("a", tokens, c + 5)
    reg.check_integrity()
    hit = reg.find_prefix(tokens)
    assert hit.num_tokens == 24  # 3 whole compressed blocks of 8 tokens each, capped below 25 tokens
    assert [len(h) for h in hit.group_block_ids] == [6, 6, 3]
    # 23 tokens: the last whole-block boundary below 22 is 16 tokens (2 compressed blocks).
    short = reg.find_prefix(tokens[:23])
    assert short.num_tokens == 16 and [len(h) for h in short.group_block_ids] == [4, 4, 2]
    assert reg.allocate("b", 25, hit, num_computed_tokens=24) is not None
    lease = reg.lease("b")
    assert lease is not None and lease.num_prefix_hit_tokens == 24
    assert lease.block_tables[2] == list(hit.group_block_ids[2])  # shared rows, ref counted
    reg.check_integrity()
    reg.free("a")
    reg.free("b")
    reg.check_quiescent()


def test_a_hit_needs_the_compressed_group_too() -> None:
    layout = (sliding(16, window=4, layers=(0,)), compressed(16, 2, (0,)))
    reg = KVRegistry("w", 16, BS, layout=layout)
    tokens = list(range(17))
    assert reg.allocate("a", 17, num_computed_tokens=0) is not None
    reg.cache_blocks("a", tokens, 17)
    reg.free("a")
    assert reg.find_prefix(tokens).num_tokens == 16
    # Evict the compressed group's first cached block: nothing is a hit any more, whatever the window holds.
    pool = reg._pools[1]
    first = reg.find_prefix(tokens).group_block_ids[1][0]
    pool.free.move_to_end(first, last=False)
    assert reg.allocate("p", 2 * BS * 2, num_computed_tokens=0) is not None
    assert reg.find_prefix(tokens).num_tokens == 0
    reg.free("p")
    reg.check_integrity()


def test_layout_rules_for_compressed_groups() -> None:
    model = ModelInfo("m", 100, 4096, (0,), num_layers=3)

    def problems(*groups: KVGroup) -> str:
        cap = stated_profile(
            BackendKind.FAKE, model=model, kv_block_size=BS, kv_num_blocks=8, kv_groups=groups
        )
        return " ".join(cap.problems())

    assert problems(full(8, (0,)), sliding(8, 4, (1, 2)), compressed(8, 4, (1, 2))) == ""
    assert problems(full(8, (0, 1, 2)), compressed(8, 128, (1, 2))) == ""  # full raw KV keeps any chunk
    assert "cannot hold a partial chunk" in problems(sliding(8, 3, (0, 1, 2)), compressed(8, 4, (1,)))
    assert "no full or sliding-window group" in problems(full(8, (0,)), compressed(8, 4, (1,)))
    assert "belong to two groups" in problems(
        sliding(8, 4, (0, 1, 2)), compressed(8, 4, (1,)), compressed(8, 2, (1,))
    )


def _long_context_peaks(groups: tuple[KVGroup, ...], num_blocks: int) -> tuple[int, int]:
    """16 requests of 512 prompt tokens and 256 outputs, chunked 64 tokens a step, driven to the end with a
    fake worker that samples token 7; integrity after every step. Returns (peak running, preemptions)."""
    cap = stated_profile(
        BackendKind.FAKE,
        model=ModelInfo("m", 1000, 1 << 20, (0,), num_layers=2),
        kv_block_size=BS,
        kv_num_blocks=num_blocks,
        kv_groups=groups,
        max_batch_tokens=64,
        max_running_requests=64,
    )
    assert cap.problems() == []
    sched = Scheduler(cap, SchedulerConfig())
    for i in range(16):
        prompt = [(i * 31 + j) % 997 + 3 for j in range(512)]
        sampling = SamplingParams(max_tokens=256, ignore_eos=True)
        sched.add_request(GenerateRequest(f"r{i}", prompt, sampling))
    peak = 0
    for _ in range(10_000):
        step = sched.schedule()
        if step is None:
            break
        sched.check_integrity()
        peak = max(peak, sched.num_running)
        outputs = [
            RequestOutput(e.req.request_id, sampled_token_id=7 if e.expects_sample else None)
            for e in sched._inflight.get(step.step_id, [])
        ]
        sched.update(step, StepResult(step.step_id, outputs))
    assert not sched.has_work()
    sched.registry.check_quiescent()
    return peak, sched.counters.preemptions


def test_admission_counts_the_compressed_footprint() -> None:
    """Long contexts: a window + compressed layout holds a window and one row per 16 tokens per request, so
    all 16 requests run at once in 256 blocks; a full layout of the same blocks runs about two."""
    num_blocks = 256
    full_peak, full_preemptions = _long_context_peaks((full(num_blocks, (0, 1)),), num_blocks)
    hybrid = (sliding(num_blocks, 16, (0, 1)), compressed(num_blocks, 16, (0, 1)))
    hybrid_peak, hybrid_preemptions = _long_context_peaks(hybrid, num_blocks)
    assert full_peak <= 2 and full_preemptions > 0
    assert hybrid_peak == 16 and hybrid_preemptions == 0


def test_a_request_beyond_the_compressed_pool_is_refused_up_front() -> None:
    tight = (sliding(64, 16, (0, 1)), compressed(8, 16, (0, 1)))
    capacity = (8 * BS + 1) * 16 - 1  # 32 rows of 16 tokens plus a partial chunk of 15
    cap = stated_profile(
        BackendKind.FAKE,
        model=ModelInfo("m", 1000, 1 << 20, (0,), num_layers=2),
        kv_block_size=BS,
        kv_num_blocks=64,
        kv_groups=tight,
        max_batch_tokens=64,
    )
    sched = Scheduler(cap, SchedulerConfig())
    assert sched.registry.max_request_tokens(64) == capacity
    fits = GenerateRequest("fits", [5] * (capacity - 8), SamplingParams(max_tokens=8, ignore_eos=True))
    sched.add_request(fits)
    with pytest.raises(OminixError, match="KV"):
        sched.add_request(
            GenerateRequest("too-long", [5] * (capacity - 8), SamplingParams(max_tokens=9, ignore_eos=True))
        )
    while sched.has_work():  # the one that fits runs to its end on the 8 compressed blocks
        step = sched.schedule()
        assert step is not None
        outputs = [
            RequestOutput(e.req.request_id, sampled_token_id=7 if e.expects_sample else None)
            for e in sched._inflight.get(step.step_id, [])
        ]
        sched.update(step, StepResult(step.step_id, outputs))
        sched.check_integrity()
    assert sched.counters.finished == 1
    sched.registry.check_quiescent()


_COMMON_TEXT = [(i * 7) % 3 for i in range(30)]


class CompressedGroupsMachine(RuleBasedStateMachine):
    """Random interleavings of admit (with prefix hits) / step (grow + window slide) / free / evict over a
    layout of one raw group per layer plus compressed groups. A model of the worker's KV per group (a token
    per raw slot, a chunk of tokens per compressed row) checks that every prefix hit is real content, every
    position or row a step may still read is intact, and no block is written by two requests."""

    @initialize(
        num_blocks=st.integers(3, 24),
        raw=st.lists(st.sampled_from([0, 3, 4, 8, 13]), min_size=1, max_size=2),
        ratios=st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=2),
        with_full=st.booleans(),
    )
    def setup(self, num_blocks: int, raw: list[int], ratios: list[int], with_full: bool) -> None:
        layout: list[KVGroup] = [full(num_blocks, (0,))] if with_full else []
        # Layer i + 1 keeps raw KV in a full (0) or sliding group, and compressed rows at ratios[i] if any.
        for i, window in enumerate(raw):
            if window:
                layout.append(sliding(num_blocks, max(window, max(ratios)), (i + 1,)))
            else:
                layout.append(full(num_blocks, (i + 1,)))
        for i, ratio in enumerate(ratios[: len(raw)]):
            layout.append(compressed(num_blocks, ratio, (i + 1,)))
        self.layout = tuple(layout)
        self.reg = KVRegistry("w", num_blocks, BS, layout=self.layout)
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        # group -> block -> slot -> token (raw) or chunk of tokens (compressed)
        self.content: list[dict[int, dict[int, object]]] = [{} for _ in layout]
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
        start = self.computed[rid]
        for g, (group, table) in enumerate(zip(self.layout, lease.block_tables, strict=True)):
            r = group.tokens_per_row
            # Raw: every new position. Compressed: the rows of chunks completed by this step.
            for row in range(start // r, upto // r):
                block = table[row // BS]
                assert block != NULL_BLOCK_ID, f"group {g}: row {row} being written has no block"
                value = toks[row] if not group.is_compressed else tuple(toks[row * r : (row + 1) * r])
                self.content[g].setdefault(block, {})[row % BS] = value
                self.written_in[g, block] = self.admitted_in[rid]
        self.computed[rid] = max(start, upto)

    @rule(
        shared=st.integers(0, 30),
        tail=st.lists(st.integers(0, 2), min_size=1, max_size=8),
        extra=st.integers(0, 6),
        use_prefix=st.booleans(),
    )
    def admit(self, shared: int, tail: list[int], extra: int, use_prefix: bool) -> None:
        """A prompt that starts with ``shared`` tokens of one common text (so prefix hits happen)."""
        prompt = _COMMON_TEXT[:shared] + tail
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
        if hit is not None and hit.num_tokens:
            assert hit.num_tokens < len(prompt) and hit.num_tokens % self.reg.hit_granularity == 0
            for g, (group, blocks) in enumerate(zip(self.layout, hit.group_block_ids, strict=True)):
                r = group.tokens_per_row
                assert len(blocks) == hit.num_tokens // group.tokens_per_block
                for i, b in enumerate(blocks):
                    if b == NULL_BLOCK_ID:  # a sliding group's block before the next token's window
                        assert group.is_sliding and (i + 1) * BS <= hit.num_tokens - group.sliding_window
                        continue
                    for j in range(BS):
                        row = i * BS + j
                        want = (
                            prompt[row] if not group.is_compressed else tuple(prompt[row * r : (row + 1) * r])
                        )
                        assert self.content[g][b].get(j) == want, f"group {g}: a hit on stale content"
                    assert self.written_in[g, b] == self.epoch, f"group {g}: block {b} predates the flush"
        self._write(rid, len(prompt))
        self.reg.cache_blocks(rid, prompt, len(prompt))

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), grow=st.integers(1, 9))
    def step(self, data: st.DataObject, grow: int) -> None:
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
        """Take every available block of the tightest group (evicting cached ones), then give them back."""
        tokens = min(
            g.tokens_for_blocks(n) for g, n in zip(self.layout, self.reg.available_blocks(), strict=True)
        )
        if tokens and self.reg.allocate("__pressure__", tokens, num_computed_tokens=0) is not None:
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
            assert lease.num_tokens_reserved >= c
            for g, (group, table) in enumerate(zip(self.layout, lease.block_tables, strict=True)):
                r = group.tokens_per_row
                first = max(0, c - group.sliding_window) if group.is_sliding else 0
                for row in range(first, c // r):
                    block = table[row // BS]
                    assert block != NULL_BLOCK_ID, f"group {g}: readable row {row} lost its block"
                    want = toks[row] if not group.is_compressed else tuple(toks[row * r : (row + 1) * r])
                    assert self.content[g][block].get(row % BS) == want
                for i, b in enumerate(table):
                    if b != NULL_BLOCK_ID and (i + 1) * group.tokens_per_block > lease.num_prefix_hit_tokens:
                        assert b not in owners[g], f"group {g}: block {b} written by {owners[g][b]} and {rid}"
                        owners[g][b] = rid
        snap = self.reg.snapshot()
        assert (
            snap.num_free_blocks + snap.num_cached_evictable_blocks + snap.num_leased_blocks
            == snap.num_blocks
        )


TestCompressedGroupsMachine = CompressedGroupsMachine.TestCase
TestCompressedGroupsMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
