"""CUDA graphs for pure-decode steps: one captured forward (+ LM head) per batch size, replayed with new inputs.

An eager decode step of an 8B Llama launches over a thousand kernels; on a slow host that takes longer than the
GPU work itself. A graph replays them with one launch. Each captured size reads its inputs from static device
buffers (token ids, positions, KV slots, context lengths, block tables) that are refilled by two host→device
copies from pinned mirrors per step. A batch of B requests replays the smallest captured size S >= B; rows
B..S-1 are padding: slot -1 (the KV store skips it) and context length 0 (attention writes zeros). The decode
kernel derives its split ranges from the live context lengths, so a graph captured once is valid for every
context length (``TritonPagedAttention.decode_splits`` is fixed per size during capture).

A hybrid KV layout (sliding-window and full-attention groups) has one slot row and one block table per KV
group in the static buffers; each graph's attention metadata is one per group, with the group's window.

Block-table rows are cached per row index: in steady decode the batch order is stable, so a step only writes
the blocks a request gained since the previous step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ominix_worker.attention.base import AttentionMetadata
from ominix_worker.devices import sm_count
from ominix_worker.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# Query lengths of the single-request prefill graphs (a short prompt, or a suffix after a prefix-cache hit):
# eagerly such a step waits on hundreds of kernel launches, not on the device.
DEFAULT_PREFILL_SIZES = (16, 32, 64)
# Context length the split count of each captured size is chosen for (only speed depends on it).
CAPTURE_SEQ_LEN = 1024
# The same for the prefill graphs, whose short queries follow a prefix hit: a longer context gets more splits
# of its keys (bench/attention_kernels.py --prefix-only), and splits past a short context end at once.
PREFILL_CAPTURE_SEQ_LEN = 4096


class DecodeRowLike(Protocol):
    """What the graph runner reads of a scheduled row (``runner.ScheduledRow``)."""

    request: Any  # runner.CachedRequest
    start: int
    end: int


def padded_size(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``batch`` rows, or None when none does."""
    for size in sizes:
        if size >= batch:
            return size
    return None


class DecodeGraphs:
    """Captured decode forwards for a fixed set of batch sizes over one model and KV cache."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: Any,
        kv_caches: list[torch.Tensor],
        device: torch.device,
        max_model_len: int,
        batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
        prefill_sizes: Sequence[int] = DEFAULT_PREFILL_SIZES,
        kv_windows: Sequence[int] = (0,),
    ) -> None:
        self.model = model
        # Per KV group: its window (0: full attention), captured into every graph's attention metadata.
        self.kv_windows = tuple(kv_windows)
        self.backend = backend
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = int(backend.block_size)
        self.sizes = sorted({int(s) for s in batch_sizes if s > 0})
        self.max_size = self.sizes[-1]
        self.width = -(-max_model_len // self.block_size)  # block-table columns
        self.prefill_sizes = sorted({int(s) for s in prefill_sizes if s > 1})
        # Rows of the static buffers: a decode batch or a prefill chunk.
        n = self.capacity = max([self.max_size, *self.prefill_sizes])
        groups = len(self.kv_windows)
        # [ids | positions | source rows | slots of each KV group] and [seq_lens | block tables (row, group,
        # column)], device and pinned host. A source row >= 0 says the token id is the previous step's sampled
        # id of that row, still on the device.
        self.dev64 = torch.zeros((3 + groups, n), dtype=torch.int64, device=device)
        self.dev32 = torch.zeros(n + n * groups * self.width, dtype=torch.int32, device=device)
        self.host64 = torch.zeros((3 + groups, n), dtype=torch.int64).pin_memory()
        self.host32 = torch.zeros(n + n * groups * self.width, dtype=torch.int32).pin_memory()
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        np64 = self.host64.numpy()
        np32 = self.host32.numpy()
        self.h_ids, self.h_pos, self.h_src = np64[0], np64[1], np64[2]
        self.h_slots = np64[3:]  # (groups, n)
        # Recorded after each step's host→device copies: the pinned mirrors are rewritten only once they ran
        # (with overlapped steps the host prepares step N+1 while step N may still be queued on the device).
        self.inputs_copied: torch.cuda.Event | None = None
        self.h_seq = np32[:n]
        self.h_bt = np32[n:].reshape(n, groups, self.width)
        self.d_seq = self.dev32[:n]
        self.d_bt = self.dev32[n:].view(n, groups, self.width)
        self.row_request: list[Any] = [None] * n  # which request's blocks row i holds
        self.row_blocks = [0] * n  # how many of them are written
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        # Single-request prefill: query offsets [0, q_len] and the row whose logits are sampled.
        self.d_qsl = torch.zeros(2, dtype=torch.int32, device=device)
        self.d_last = torch.zeros(1, dtype=torch.int64, device=device)
        self.h_qsl = torch.zeros(2, dtype=torch.int32).pin_memory()
        self.h_last = torch.zeros(1, dtype=torch.int64).pin_memory()
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prefill_logits: dict[int, torch.Tensor] = {}

    # ---- capture ------------------------------------------------------------------------------------

    def _meta(self, size: int) -> tuple[AttentionMetadata, ...]:
        """One metadata per KV group: its block tables (strided rows of the static buffer), slots, window."""
        return tuple(
            AttentionMetadata(
                query_start_loc=self.query_start_loc[: size + 1],
                seq_lens=self.d_seq[:size],
                block_tables=self.d_bt[:size, g],
                slot_mapping=self.dev64[3 + g, :size],
                max_query_len=1,
                max_seq_len=CAPTURE_SEQ_LEN,
                num_decode_only=True,
                sliding_window=window,
            )
            for g, window in enumerate(self.kv_windows)
        )

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(self.dev64[0, :size], self.dev64[1, :size], self.kv_caches, self._meta(size))
        return self.model.compute_logits(hidden)

    def _prefill_forward(self, size: int) -> torch.Tensor:
        metas = tuple(
            AttentionMetadata(
                query_start_loc=self.d_qsl,
                seq_lens=self.d_seq[:1],
                block_tables=self.d_bt[:1, g],
                slot_mapping=self.dev64[3 + g, :size],
                max_query_len=size,
                max_seq_len=PREFILL_CAPTURE_SEQ_LEN,
                num_decode_only=False,
                sliding_window=window,
                no_single_token_requests=True,  # fits_prefill: 2 or more positions
            )
            for g, window in enumerate(self.kv_windows)
        )
        hidden = self.model(self.dev64[0, :size], self.dev64[1, :size], self.kv_caches, metas)
        return self.model.compute_logits(hidden.index_select(0, self.d_last))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (the smaller ones reuse its memory pool)."""
        from ominix_worker.attention.triton_paged import decode_num_splits

        saved_splits = getattr(self.backend, "decode_splits", None)
        num_kv_heads = int(self.kv_caches[0].shape[3])
        sms = sm_count(self.device)
        # Padding everywhere: no KV is written and attention reads nothing while capturing.
        self.dev64.zero_()
        self.dev64[3:].fill_(-1)
        self.dev32.zero_()
        pool = None
        try:
            for size in reversed(self.sizes):
                if hasattr(self.backend, "decode_splits"):
                    self.backend.decode_splits = decode_num_splits(size, num_kv_heads, CAPTURE_SEQ_LEN, sms)
                for _ in range(2):  # compiles the kernels and settles the allocator outside the graph
                    self._forward(size)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(size)
                pool = graph.pool()
                self.graphs[size] = graph
                self.logits[size] = logits
            if hasattr(self.backend, "decode_splits"):
                self.backend.decode_splits = 1
            self.d_qsl.zero_()  # q_len 0: the attention kernels return at once while capturing
            self.d_last.zero_()
            for size in reversed(self.prefill_sizes):
                for _ in range(2):
                    self._prefill_forward(size)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._prefill_forward(size)
                self.prefill_graphs[size] = graph
                self.prefill_logits[size] = logits
        finally:
            if hasattr(self.backend, "decode_splits"):
                self.backend.decode_splits = saved_splits
        torch.cuda.synchronize(self.device)
        self.row_request = [None] * self.capacity
        self.row_blocks = [0] * self.capacity

    # ---- replay -------------------------------------------------------------------------------------

    def fits(self, num_rows: int) -> bool:
        return bool(self.graphs) and num_rows <= self.max_size

    def _wait_inputs_copied(self) -> None:
        if self.inputs_copied is not None:
            self.inputs_copied.synchronize()

    def _record_inputs_copied(self) -> None:
        if self.inputs_copied is None:
            self.inputs_copied = torch.cuda.Event()
        self.inputs_copied.record()

    def run(self, rows: Sequence[DecodeRowLike], prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits float32 (len(rows), vocab) of one decode step; every row computes exactly one position.

        A negative input token ``-(1 + j)`` is a placeholder for ``prev_tokens[j]`` (the previous step's
        sampled ids, not yet on the host): it is gathered on the device before the replay.
        """
        batch = len(rows)
        size = padded_size(batch, self.sizes)
        assert size is not None and size in self.graphs, f"no graph holds {batch} rows"
        bs = self.block_size
        self._wait_inputs_copied()
        ids, pos, slots, seq, bt = self.h_ids, self.h_pos, self.h_slots, self.h_seq, self.h_bt
        src = self.h_src
        row_request, row_blocks = self.row_request, self.row_blocks
        num_gathered = 0
        for i, row in enumerate(rows):
            req = row.request
            p = row.start
            prompt_len = len(req.prompt_token_ids)
            token = req.output_token_ids[p - prompt_len] if p >= prompt_len else req.prompt_token_ids[p]
            if token < 0:
                ids[i] = 0
                src[i] = -1 - token
                num_gathered += 1
            else:
                ids[i] = token
                src[i] = -1
            tables = req.block_tables
            pos[i] = p
            if p < req.kv_cached_until:  # a whole-prompt hit's last token: its KV is cached, not written
                slots[:, i] = -1
            else:
                for g, blocks in enumerate(tables):
                    slots[g, i] = blocks[p // bs] * bs + p % bs
            seq[i] = row.end
            used = -(-row.end // bs)
            # The worker's tables only grow (entries the engine nulled behind a window keep their old ids).
            have = row_blocks[i] if row_request[i] is req else 0
            if used > have:
                for g, blocks in enumerate(tables):
                    bt[i, g, have:used] = blocks[have:used]
                row_request[i] = req
                row_blocks[i] = used
        if size > batch:
            ids[batch:size] = 0
            pos[batch:size] = 0
            slots[:, batch:size] = -1
            seq[batch:size] = 0
        self.dev64.copy_(self.host64, non_blocking=True)
        count = self.capacity + size * len(self.kv_windows) * self.width
        self.dev32[:count].copy_(self.host32[:count], non_blocking=True)
        self._record_inputs_copied()
        if num_gathered:
            assert prev_tokens is not None, "a placeholder token without the previous step's ids"
            d_ids, d_src = self.dev64[0, :batch], self.dev64[2, :batch]
            gathered = prev_tokens.index_select(0, d_src.clamp(min=0))
            d_ids.copy_(torch.where(d_src >= 0, gathered, d_ids))
        self.graphs[size].replay()
        return self.logits[size][:batch]

    def fits_prefill(self, rows: Sequence[DecodeRowLike]) -> bool:
        """One request computing 2..max prefill-size positions (its last chunk, or a prefix-hit suffix)."""
        if len(rows) != 1 or not self.prefill_graphs:
            return False
        num = rows[0].end - rows[0].start
        return 1 < num <= self.prefill_sizes[-1]

    def run_prefill(self, row: DecodeRowLike) -> torch.Tensor:
        """Logits float32 (1, vocab) of the last position of a short prefill of one request."""
        start, end = row.start, row.end
        num = end - start
        size = padded_size(num, self.prefill_sizes)
        assert size is not None and size in self.prefill_graphs, f"no prefill graph holds {num} tokens"
        req = row.request
        # A cached position (a whole-prompt hit's last token) only ever comes in a one-token row, never here.
        assert start >= req.kv_cached_until, "a prefill graph writes every position it computes"
        bs = self.block_size
        positions = range(start, end)
        used = -(-end // bs)
        self._wait_inputs_copied()
        self.h_ids[:num] = req.token_ids(start, end)
        self.h_pos[:num] = positions
        for g, blocks in enumerate(req.block_tables):
            self.h_slots[g, :num] = [blocks[p // bs] * bs + p % bs for p in positions]
            self.h_bt[0, g, :used] = blocks[:used]
        self.h_ids[num:size] = 0
        self.h_pos[num:size] = 0
        self.h_slots[:, num:size] = -1
        self.h_seq[0] = end
        self.row_request[0] = req
        self.row_blocks[0] = used
        self.h_qsl[1] = num
        self.h_last[0] = num - 1
        self.dev64.copy_(self.host64, non_blocking=True)
        count = self.capacity + len(self.kv_windows) * self.width
        self.dev32[:count].copy_(self.host32[:count], non_blocking=True)
        self.d_qsl.copy_(self.h_qsl, non_blocking=True)
        self.d_last.copy_(self.h_last, non_blocking=True)
        self._record_inputs_copied()
        self.prefill_graphs[size].replay()
        return self.prefill_logits[size]

    def forget_rows(self) -> None:
        """Drop the block-table row cache (the request state was reset)."""
        self.row_request = [None] * self.capacity
        self.row_blocks = [0] * self.capacity
