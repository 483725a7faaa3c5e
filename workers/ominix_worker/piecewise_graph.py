"""CUDA graphs for the steps decode graphs do not take (prompts, chunks, mixed steps) up to a token budget: each
step's forward captured in pieces cut at the layers' attention calls, once per bucket of token counts.

An eager 1,024-token step launches ~320 kernels and library calls; on the H200 hosts that launch took 12 - 30
ms of host CPU time, longer than the step's device time at low load, where it set the ITL tail
(bench/RESULTS.md, 2026-11-30). Everything in a layer but attention is shaped by the step's token count alone,
so it is captured once per bucket and replayed; attention depends on how the tokens split into requests and
runs eagerly between the pieces with the step's own metadata (its own grid and mixed plan), as in an eager
step. A step of T tokens replays the smallest bucket B >= T: rows T..B-1 are padding (token 0, position 0, KV
slot -1, which the store skips); attention neither reads nor writes them and no output of theirs is sampled.
The GEMMs then run only at bucket row counts, all of which the capture ran, so no first cuBLAS call at a new
count holds the host in the middle of serving either.

Inside the piece before it, each attention call's query is copied into a static buffer (the piece's own
activations are freed for the next bucket's capture); attention writes a static output buffer the next piece
reads, and the last piece copies the final hidden states into a static buffer. Every bucket shares these
buffers and one memory pool: a step replays one bucket's pieces in order on one stream.

Past the last layer's attention only the rows whose logits are sampled are read (``last_layer_rows``). A bucket
larger than ``tail_rows`` (the most rows a step samples, padded as the LM head pads them) is captured with a
static index buffer of that many rows: its last piece gathers them and runs the last layer's o_proj and MLP on
them alone; a step copies its sampled rows' indices in and pads the rest with row 0.

cuBLAS picks its kernels by row count, and some counts run slower than larger ones (1,028 - 1,152 rows of the
Llama-3.1-8B shape's layer GEMMs took 21.45 - 23.85 ms, bench/RESULTS.md, 2026-11-30). ``time_buckets`` times
every bucket's pieces at start and ``set_routes`` sends a step to the fastest captured bucket that holds it:
the attention costs the same whatever the padding, so the pieces alone decide.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ominix_runtime.config import DebugConfig
from ominix_worker.attention.base import AttentionMetadata, KVScales, PiecewiseAttention
from ominix_worker.cuda_graph import padded_size
from ominix_worker.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

# Bucket spacing, the one default of OMINIX_PIECEWISE_TOKEN_STEP (its comment has the measurements behind it).
TOKEN_STEP = DebugConfig().piecewise_token_step

# A larger bucket takes a smaller one's steps only when its pieces ran at least this much faster: timing noise
# must not buy padding rows.
FASTER_BY = 0.02


def token_buckets(max_tokens: int, step: int = TOKEN_STEP) -> tuple[int, ...]:
    """Every multiple of ``step`` below ``max_tokens``, then ``max_tokens`` itself (no step holds more, and the
    KV budget leaves room for that bucket's forward); () when ``max_tokens`` <= 0."""
    if step < 1:
        raise ValueError(f"a bucket spacing must be at least 1 token, got {step}")
    if max_tokens <= 0:
        return ()
    return (*range(step, max_tokens, step), max_tokens)


def fastest_routes(times_ms: Mapping[int, float], faster_by: float = FASTER_BY) -> dict[int, int]:
    """For each timed bucket, the bucket a step padded to it replays: the fastest of the larger buckets when it
    ran more than ``faster_by`` faster than the bucket itself, else the bucket itself (ties go to the smaller).
    A bucket routed elsewhere routes to a bucket that routes to itself."""
    routes: dict[int, int] = {}
    best: int | None = None  # the fastest of the buckets seen, all larger than the next
    for bucket in sorted(times_ms, reverse=True):
        own = times_ms[bucket]
        if best is not None and times_ms[best] < own * (1.0 - faster_by):
            routes[bucket] = best
        else:
            routes[bucket] = bucket
        if best is None or own <= times_ms[best]:
            best = bucket
    return routes


@dataclass(frozen=True, slots=True)
class _Attend:
    """One layer's attention between two pieces, as the capture saw it, with static rows for its query and
    output."""

    query: torch.Tensor  # (bucket, heads, head_dim): rows of a static buffer the piece before fills
    out: torch.Tensor  # the same shape: rows of a static buffer the piece after reads
    kv_cache: torch.Tensor
    group: int  # the KV group whose step metadata it attends with
    scale: float
    kv_scales: KVScales
    sinks: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class _Captured:
    pieces: tuple[torch.cuda.CUDAGraph, ...]  # one more than the attention calls
    attends: tuple[_Attend, ...]

    def __post_init__(self) -> None:
        if len(self.pieces) != len(self.attends) + 1:
            raise RuntimeError(f"{len(self.pieces)} pieces around {len(self.attends)} attention calls")


class PiecewiseGraphs:
    """Piecewise-captured forwards of one model for every bucket of ``buckets`` tokens."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        attention: PiecewiseAttention,
        device: torch.device,
        buckets: Sequence[int],
        kv_windows: Sequence[int] = (0,),
        tail_rows: int = 0,
    ) -> None:
        if not buckets:
            raise ValueError("no token bucket to capture")
        if tail_rows < 0:
            raise ValueError(f"tail_rows must be 0 or more, got {tail_rows}")
        self.model = model
        self.attention = attention
        self.device = device
        self.buckets = tuple(sorted({int(b) for b in buckets if b > 0}))
        self.kv_windows = tuple(kv_windows)
        n = self.max_tokens = self.buckets[-1]
        self.ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((len(self.kv_windows), n), -1, dtype=torch.int64, device=device)
        # The rows a bucket larger than ``tail_rows`` keeps past the last layer's attention (0: all, always).
        self.tail_rows = tail_rows
        self.keep = torch.zeros(tail_rows, dtype=torch.int64, device=device)
        # Static buffers, allocated by the first (uncaptured) pass: final hidden states, and per query shape
        # (heads, head_dim, dtype) the attention's query and output.
        self.hidden: torch.Tensor | None = None
        self._io: dict[tuple[int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._captured: dict[int, _Captured] = {}
        # Buckets whose steps replay a larger, faster bucket (``set_routes``).
        self._routes: dict[int, int] = {}
        # Capture state: the metadata the layers see (one per KV group), the piece being captured, and what
        # the pass has cut so far.
        self._metas: tuple[AttentionMetadata, ...] = ()
        self._graph: torch.cuda.CUDAGraph | None = None
        self._pool: torch.cuda._POOL_HANDLE | None = None  # graph_pool_handle()'s NewType of tuple[int, int]
        self._pieces: list[torch.cuda.CUDAGraph] = []
        self._attends: list[_Attend] = []

    def bucket_for(self, num_tokens: int) -> int | None:
        """The captured bucket a step of ``num_tokens`` tokens replays; None: it runs eagerly."""
        if not self._captured:
            return None
        bucket = padded_size(num_tokens, self.buckets)
        return None if bucket is None else self._routes.get(bucket, bucket)

    # ---- capture ------------------------------------------------------------------------------------

    def _capture_metas(self, bucket: int) -> tuple[AttentionMetadata, ...]:
        """What the layers see while a bucket is captured: the static slots (the KV store is captured); the
        rest is never read, since every attention call is cut."""
        qsl = torch.tensor([0, bucket], dtype=torch.int32, device=self.device)
        lens = torch.tensor([bucket], dtype=torch.int32, device=self.device)
        tables = torch.zeros((1, 1), dtype=torch.int32, device=self.device)
        return tuple(
            AttentionMetadata(
                query_start_loc=qsl,
                seq_lens=lens,
                block_tables=tables,
                slot_mapping=self.slots[g, :bucket],
                max_query_len=bucket,
                max_seq_len=bucket,
                num_decode_only=False,
                query_start_loc_cpu=[0, bucket],
                seq_lens_cpu=[bucket],
                sliding_window=window,
            )
            for g, window in enumerate(self.kv_windows)
        )

    def _io_buffers(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (int(query.shape[1]), int(query.shape[2]), query.dtype)
        buffers = self._io.get(key)
        if buffers is None:
            if self._graph is not None:
                raise RuntimeError("a query shape the uncaptured pass did not see")
            shape = (self.max_tokens, *key[:2])
            buffers = (
                torch.empty(shape, dtype=query.dtype, device=self.device),
                torch.zeros(shape, dtype=query.dtype, device=self.device),
            )
            self._io[key] = buffers
        return buffers

    def _cut(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """A layer's attention call while capturing: the query goes into its static rows, the piece ends, and
        the layer goes on (in the next piece) from the static output rows."""
        rows = query.shape[0]
        group = next((g for g, m in enumerate(self._metas) if m is meta), None)
        if group is None:
            raise RuntimeError("an attention call with metadata that is not its KV group's")
        query_buffer, out_buffer = self._io_buffers(query)
        static_query = query_buffer[:rows]
        static_query.copy_(query)
        out = out_buffer[:rows]
        self._attends.append(_Attend(static_query, out, kv_cache, group, scale, kv_scales, sinks))
        if self._graph is not None:
            self._end_piece()
            self._begin_piece()
        return out

    def _begin_piece(self) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self._pool)

    def _end_piece(self) -> None:
        assert self._graph is not None
        self._graph.capture_end()
        self._pieces.append(self._graph)

    def _abandon_piece(self) -> None:
        """End a capture that failed part-way; the error that stopped it is the one raised."""
        graph, self._graph = self._graph, None
        if graph is not None:
            try:
                graph.capture_end()
            except RuntimeError:
                log.debug("ending a failed capture", exc_info=True)

    def _pass(self, bucket: int, kv_caches: list[torch.Tensor]) -> None:
        """One forward of ``bucket`` padding tokens through the cut layers (captured when a piece is open)."""
        self._attends = []
        keep = self.keep if self._keeps_tail(bucket) else None
        hidden = self.model(self.ids[:bucket], self.positions[:bucket], kv_caches, self._metas, keep)
        if self.hidden is None:
            self.hidden = torch.empty(
                (self.max_tokens, hidden.shape[1]), dtype=hidden.dtype, device=self.device
            )
        self.hidden[: hidden.shape[0]].copy_(hidden)

    def _keeps_tail(self, bucket: int) -> bool:
        """Whether ``bucket`` runs its last layer past attention on ``tail_rows`` rows only."""
        return 0 < self.tail_rows < bucket

    @torch.inference_mode()
    def capture(self, kv_caches: list[torch.Tensor]) -> None:
        """Capture every bucket, largest first (the smaller ones reuse its pool). Raises RuntimeError when the
        model's forward does not cut into one attention call per layer."""
        layers = len(self.model.layers)
        stream = torch.cuda.Stream(self.device)
        between = self.model.between_layers
        try:
            self.model.between_layers = None
            self.attention.cut = self._cut
            self.ids.zero_()
            self.positions.zero_()
            self.slots.fill_(-1)
            self.keep.zero_()
            for bucket in reversed(self.buckets):
                self._metas = self._capture_metas(bucket)
                self._pass(bucket, kv_caches)  # builds kernels and settles the allocator outside the graph
                if len(self._attends) != layers:
                    raise RuntimeError(
                        f"the forward made {len(self._attends)} attention calls for {layers} layers"
                    )
                torch.cuda.synchronize(self.device)
                self._pieces = []
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self._begin_piece()
                    try:
                        self._pass(bucket, kv_caches)
                    except BaseException:
                        self._abandon_piece()
                        raise
                    self._end_piece()
                    self._graph = None
                torch.cuda.current_stream(self.device).wait_stream(stream)
                self._captured[bucket] = _Captured(tuple(self._pieces), tuple(self._attends))
        except BaseException:
            self._captured.clear()
            raise
        finally:
            self.attention.cut = None
            self.model.between_layers = between
            self._metas, self._pieces, self._attends = (), [], []
        torch.cuda.synchronize(self.device)

    # ---- the fastest bucket ---------------------------------------------------------------------------

    def _replay_ms(self, bucket: int, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        """Device ms of one replay of ``bucket``'s pieces back to back, without the attention between them."""
        start.record()
        for piece in self._captured[bucket].pieces:
            piece.replay()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    @torch.inference_mode()
    def time_buckets(self, replays: int = 2, rounds: int = 4) -> tuple[dict[int, float], dict[int, int]]:
        """Each captured bucket's device ms (the best of ``replays`` after one unmeasured), and the routes to
        larger buckets that held when timed again: every route ``fastest_routes`` proposes is re-timed over
        ``rounds`` interleaved replays of both buckets, and kept only when the larger one's best is still
        faster by ``FASTER_BY`` (a bucket's one best against the best of many larger ones favours those by
        noise alone). The largest bucket replays first, unmeasured, so the clocks have risen before any
        time is taken. At start, before serving: the static inputs are reset to padding (slot -1, so no KV
        is written); the attention's output buffers keep what they hold."""
        if replays < 1 or rounds < 1:
            raise ValueError("replays and rounds must be at least 1")
        if not self._captured:
            raise RuntimeError("no captured bucket to time")
        self.ids.zero_()
        self.positions.zero_()
        self.slots.fill_(-1)
        self.keep.zero_()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            self._replay_ms(self.buckets[-1], start, end)
        times: dict[int, float] = {}
        for bucket in self.buckets:
            self._replay_ms(bucket, start, end)
            times[bucket] = min(self._replay_ms(bucket, start, end) for _ in range(replays))
        routes: dict[int, int] = {}
        for bucket, target in fastest_routes(times).items():
            if target == bucket:
                continue
            own, other = math.inf, math.inf
            for _ in range(rounds):
                own = min(own, self._replay_ms(bucket, start, end))
                other = min(other, self._replay_ms(target, start, end))
            if other < own * (1.0 - FASTER_BY):
                routes[bucket] = target
        return times, routes

    def set_routes(self, routes: Mapping[int, int]) -> None:
        """From now on a step padded to bucket ``b`` replays ``routes[b]``, a larger captured bucket (a step's
        attention costs the same in either: padding rows neither read nor write KV)."""
        for bucket, target in routes.items():
            if bucket not in self._captured or target not in self._captured or target <= bucket:
                raise ValueError(
                    f"route {bucket} -> {target}: not a captured bucket to a larger captured one"
                )
        self._routes = dict(routes)

    # ---- replay -------------------------------------------------------------------------------------

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metas: Sequence[AttentionMetadata],
        keep: torch.Tensor,
        between: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Final hidden states of the rows ``keep`` indexes (in its order), for a step whose inputs are padded
        to a captured bucket (``bucket_for``): ids, positions, each group's slots (and, in a bucket larger than
        ``tail_rows``, the kept rows' indices) are copied into the static buffers, then the pieces replay with
        the step's attention between them. ``between`` runs after each layer's attention (host work only, as
        ``LlamaForCausalLM.between_layers``)."""
        rows = int(input_ids.shape[0])
        captured = self._captured.get(rows)
        if captured is None:
            raise ValueError(f"no captured bucket of {rows} tokens")
        assert self.hidden is not None
        kept = int(keep.shape[0])
        tail = self._keeps_tail(rows)
        if tail:
            if kept > self.tail_rows:
                raise ValueError(f"{kept} rows to keep in a bucket captured to keep {self.tail_rows}")
            self.keep[:kept].copy_(keep)
            self.keep[kept:].zero_()  # indices of an earlier, larger bucket would lie past this one's rows
        self.ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        for g, meta in enumerate(metas):
            self.slots[g, :rows].copy_(meta.slot_mapping)
        attention = self.attention
        for piece, attend in zip(captured.pieces, captured.attends, strict=False):  # the last piece follows
            piece.replay()
            attention.forward_into(
                attend.query, attend.kv_cache, metas[attend.group], attend.scale, attend.out,
                attend.kv_scales, attend.sinks,
            )  # fmt: skip
            if between is not None:
                between()
        captured.pieces[-1].replay()
        return self.hidden[:kept] if tail else self.hidden[:rows].index_select(0, keep)
