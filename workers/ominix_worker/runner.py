"""The model runner: a persistent batch of requests fed by DecodeSteps, one forward and one sample per step.

Each request keeps its tokens (prompt + output), block table and ``num_computed_tokens`` across steps. A
step computes positions ``[num_computed, num_computed + num_scheduled)`` of each scheduled request; when
that reaches the end of the known tokens the request samples one token (otherwise its prefill is chunked
and continues next step). Prefill and decode rows are flattened into one ragged batch.

Structure for device fast paths: ``_prepare_inputs`` is the only place that builds step tensors, the
forward is ``_forward`` and ``capture_decode_graphs`` is the seam where CUDA/ACL graphs hook in.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from ominix_runtime.contract import (
    NULL_BLOCK_ID,
    AttentionKind,
    DecodeStep,
    InvalidArgument,
    KVGroup,
    NewRequestData,
    RequestOutput,
    RuntimeErrorKind,
    SampledLogprobs,
    SamplingParams,
    StepResult,
    TokenLogprob,
)
from ominix_worker.attention.base import AttentionBackend, AttentionMetadata
from ominix_worker.config import AttentionGroup, ModelConfig
from ominix_worker.cuda_graph import DEFAULT_BATCH_SIZES, DecodeGraphs, padded_size
from ominix_worker.kv_cache import kv_tensor_indices
from ominix_worker.models.llama import LlamaForCausalLM
from ominix_worker.parallel import SINGLE, PackableLinear, TensorParallel
from ominix_worker.piecewise_graph import TOKEN_STEP, PiecewiseGraphs, token_buckets
from ominix_worker.sampler import SamplerOutput, SamplingTensors, greedy, sample

# Block-table widths are padded to a multiple of this on CUDA, so Triton sees one stride specialisation.
BLOCK_TABLE_ALIGN = 16

log = logging.getLogger(__name__)


def _as_int64(seed: int) -> int:
    """A 64-bit unsigned seed reinterpreted as the int64 torch can hold (same bits)."""
    seed %= 1 << 64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@dataclass(slots=True)
class CachedRequest:
    """What the worker holds for one request between steps."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingParams
    # One block table per KV group (the model's ``attention_groups`` order); a sliding-window group's starts
    # with NULL_BLOCK_ID entries where the engine freed blocks behind the window.
    block_tables: list[list[int]]
    num_computed_tokens: int
    seed: int  # sampling.seed, or the engine's effective seed
    # Positions below this hold their KV from a prefix hit and are never written (above num_computed_tokens
    # only for a prompt found whole in the cache: its last token is computed for its logits alone).
    kv_cached_until: int = 0

    @property
    def kv_block_ids(self) -> list[int]:
        """Block table of KV group 0."""
        return self.block_tables[0]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]


@dataclass(slots=True)
class ScheduledRow:
    request: CachedRequest
    start: int  # first position computed this step
    end: int  # one past the last
    samples: bool  # reaches the end of the known tokens


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metas: tuple[AttentionMetadata, ...]  # one per KV group (block tables, slots and window differ)
    logits_indices: torch.Tensor  # rows of the flattened batch whose logits are sampled
    sampling: SamplingTensors | None
    sampling_rows: list[ScheduledRow] = field(default_factory=list)
    # The captured bucket the inputs are padded to (``PiecewiseGraphs``); 0: the forward runs eagerly.
    piecewise_bucket: int = 0


class _HostDone:
    """A finished step's event on a CPU, where the ids are on the host when the step returns."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@dataclass(slots=True)
class PendingStep:
    """A launched step (a decode graph, or an eager step with ``pipeline_eager``) whose sampled ids are still on
    their way to the host.

    Its requests already count the sampled token: ``output_token_ids`` holds a placeholder ``-(1 + i)``
    (``i``: the row in ``token_ids``) at ``positions[i]``, so the next step can be scheduled, checked and
    launched before these values are known; it gathers them on the device.
    """

    step_id: int
    order: list[str]
    outputs: dict[str, RequestOutput]
    rows: list[ScheduledRow]
    positions: list[int]  # index of each row's placeholder in its request's output_token_ids
    token_ids: torch.Tensor  # device, int64 (len(rows),)
    host: torch.Tensor  # pinned (2, len(rows)): token ids and NaN flags, filled by a non-blocking copy
    done: torch.cuda.Event | _HostDone
    num_tokens: int
    started: float


class RequestError(Exception):
    """A problem confined to one request; the step goes on without it."""

    def __init__(self, kind: RuntimeErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        device: torch.device,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.config = config
        self.backend = backend
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = backend.block_size
        # The KV groups (layers sharing one block table): each layer attends within its group's window where
        # the backend can; otherwise the model has one full group and max_model_len is capped at the window.
        self.attention_groups = model.attention_groups
        self.group_num_blocks: tuple[int, ...] = ()
        self.set_kv_caches(kv_caches)
        self.max_model_len = max_model_len
        self.vocab_size = config.vocab_size
        self.requests: dict[str, CachedRequest] = {}
        self.last_step_id = 0
        self._pin = device.type == "cuda"
        # ``_forward``'s row when none samples.
        self._first_row = torch.zeros(1, dtype=torch.int64, device=device)
        self._graphs: DecodeGraphs | None = None  # captured on CUDA
        # Prefill and mixed steps up to a token budget, captured in pieces (``capture_piecewise_graphs``).
        self._piecewise_graphs: PiecewiseGraphs | None = None
        # Device ms of each bucket's pieces, when timed at capture (``capture_piecewise_graphs(timed=True)``).
        self.piecewise_bucket_ms: dict[int, float] = {}
        # Row counts an eager step's LM head is padded up to (the captured decode sizes once graphs exist): the
        # LM head GEMM then runs only at row counts the capture already ran. On an H200 (torch 2.11, cu130) the
        # first cuBLAS call at a row count new to it (one per bucket of 8 rows, at the LM head's shape) blocks
        # the host until the device has drained the work already queued; the second call queues at once
        # (bench/gemm_first_call.py). Unpadded, new counts of sampled rows in a fresh server's prefill steps held
        # the device thread for up to a step each, with CUDA_MODULE_LOADING=EAGER as without (bench/RESULTS.md,
        # 2026-11-30).
        self.logits_row_sizes: tuple[int, ...] = ()
        self.pad_logits = True  # False (debug, ``OMINIX_PAD_LOGITS=0``): the LM head at its own row count
        # Overlapped decode (set by the server on CUDA): a graph step is launched before the previous step's
        # sampled ids reach the host; results then come out of ``take_results`` (or ``post_result``, below)
        # instead of execute_step.
        self.overlap_steps = False
        self.pipeline_decode = True  # False (debug): never overlap, even with captured graphs
        # Eager steps (prefill, mixed) overlapped too (off with ``OMINIX_PIPELINE_EAGER=0``): launched before the
        # previous step's ids reach the host, their own ids copied back while the next step is prepared.
        self.pipeline_eager = True
        # While an overlapped eager step launches, the step before it is polled between layers and its result
        # handed to ``post_result`` (set by the step loop) once its ids are on the host; otherwise it leaves
        # after that launch, which took 21 - 33 ms for a 1,024-token prompt in the service on an H200
        # (bench/RESULTS.md, 2026-11-29 19:53 - 20:10). The server sets it from WorkerConfig.early_results
        # (on unless ``--no-early-results``).
        self.early_results = False
        self.post_result: Callable[[StepResult], None] | None = None
        self._early_candidate: PendingStep | None = None  # may leave during the current launch
        self._pending: PendingStep | None = None
        self._results: list[StepResult] = []

    # ---- request state -----------------------------------------------------------------------------

    def set_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Swap the KV tensors (after sizing); an empty list frees them first."""
        self.kv_caches = kv_caches
        # Blocks of each group's pool: the KV tensor of every layer of a group has the same count.
        first = [indices[0] for indices in kv_tensor_indices(self.attention_groups, self.config.num_layers)]
        self.group_num_blocks = tuple(int(kv_caches[i].shape[1]) if kv_caches else 0 for i in first)

    @property
    def num_blocks(self) -> int:
        """Blocks of KV group 0's pool (every layer's, in a uniform layout)."""
        return self.group_num_blocks[0] if self.group_num_blocks else 0

    @property
    def supports_whole_prompt_hits(self) -> bool:
        """A prompt cached whole may compute its last token alone (slot -1): the store skips such slots, and
        every group keeps a row per token with nothing sliding (the engine's condition too)."""
        return self.backend.skips_unset_slots and all(
            not g.window and not g.compress_ratio for g in self.attention_groups
        )

    @property
    def kv_windows(self) -> tuple[int, ...]:
        """Per KV group: the window its layers attend within (0: full attention)."""
        return tuple(g.window for g in self.attention_groups)

    def kv_layout(self, bytes_per_token_per_layer: int = 0) -> tuple[KVGroup, ...]:
        """The KV groups as the contract states them (kind, layers, window, pool size)."""
        return tuple(
            KVGroup(
                _kind(g),
                g.layers,
                self.block_size,
                n,
                bytes_per_token_per_layer=bytes_per_token_per_layer,
                sliding_window=g.window,
                compress_ratio=g.compress_ratio,
            )
            for g, n in zip(self.attention_groups, self.group_num_blocks, strict=True)
        )

    def can_overlap(self) -> bool:
        """Overlapped decode needs captured graphs; ``pipeline_decode`` (``OMINIX_PIPELINE=0``) turns it off."""
        return self._graphs is not None and self.pipeline_decode

    def announce(self, step: DecodeStep) -> None:
        """A step is queued to run (``step_loop.StepRunner``); a lone runner has nobody to tell."""

    def reset(self) -> None:
        """Drop every request's state (the engine's stream closed)."""
        self._pending = None
        self._results.clear()
        self.requests.clear()
        if self._graphs is not None:
            self._graphs.forget_rows()

    def _add_new(self, new: NewRequestData) -> CachedRequest:
        sampling = new.sampling.validate(vocab_size=self.vocab_size)
        seed = sampling.seed if sampling.seed is not None else new.effective_seed
        request = CachedRequest(
            request_id=new.request_id,
            prompt_token_ids=list(new.prompt_token_ids),
            output_token_ids=list(new.output_token_ids),
            sampling=sampling,
            block_tables=[list(new.kv_block_ids), *(list(t) for t in new.group_kv_block_ids)],
            num_computed_tokens=new.num_computed_tokens,
            seed=seed,
            kv_cached_until=new.kv_cached_until,
        )
        tokens = request.prompt_token_ids + request.output_token_ids
        if tokens and (min(tokens) < 0 or max(tokens) >= self.vocab_size):
            bad = next(t for t in tokens if not 0 <= t < self.vocab_size)
            raise RequestError(RuntimeErrorKind.INVALID_ARGUMENT, f"token id {bad} outside the vocabulary")
        self._check_block_ids(request.block_tables)
        problem = new.cached_kv_problem(self.supports_whole_prompt_hits)
        if problem:
            raise RequestError(RuntimeErrorKind.INTERNAL, problem)
        self.requests[new.request_id] = request
        return request

    def _check_block_ids(self, tables: list[list[int]]) -> None:
        """Checked once when blocks arrive, not every step: one table (or diff) per KV group, ids in range."""
        if len(tables) != len(self.attention_groups):
            raise RequestError(
                RuntimeErrorKind.INTERNAL,
                f"{len(tables)} block tables for a layout of {len(self.attention_groups)} KV groups",
            )
        for group, num_blocks, block_ids in zip(
            self.attention_groups, self.group_num_blocks, tables, strict=True
        ):
            # A sliding window's table holds NULL_BLOCK_ID where the engine freed a block behind the window.
            low = NULL_BLOCK_ID if group.window else 0
            if block_ids and (min(block_ids) < low or max(block_ids) >= num_blocks):
                raise RequestError(RuntimeErrorKind.INTERNAL, f"KV block id outside [0, {num_blocks})")

    def _check_row(self, request: CachedRequest, num_scheduled: int) -> ScheduledRow:
        start = request.num_computed_tokens
        end = start + num_scheduled
        if end > request.num_tokens:
            raise RequestError(
                RuntimeErrorKind.INTERNAL,
                f"scheduled up to position {end} but only {request.num_tokens} tokens are known",
            )
        if end > self.max_model_len:
            raise RequestError(
                RuntimeErrorKind.KV_CAPACITY_EXCEEDED,
                f"position {end} exceeds max_model_len {self.max_model_len}",
            )
        bs = self.block_size
        for group, table in zip(self.attention_groups, request.block_tables, strict=True):
            need = _blocks_for_tokens(group, end, bs)
            if len(table) < need:
                what = "blocks of a compressed KV group" if group.compress_ratio else "KV blocks"
                raise RequestError(
                    RuntimeErrorKind.INTERNAL,
                    f"{len(table)} {what} cannot hold {end} tokens (block size {bs})",
                )
            first_read = max(0, start - group.window + 1) // bs if group.window else 0
            if NULL_BLOCK_ID in table[first_read:need]:
                raise RequestError(
                    RuntimeErrorKind.INTERNAL,
                    f"a KV block inside the window of positions [{start}, {end}) is null",
                )
        return ScheduledRow(request, start, end, samples=end == request.num_tokens)

    def _apply_step(
        self, step: DecodeStep
    ) -> tuple[list[str], list[ScheduledRow | None], dict[str, RequestOutput]]:
        """Update request state from the step's diffs; returns the scheduled order, rows and early errors.

        A request named twice in the step, or a new request whose id the worker still holds, is refused with
        INVALID_ARGUMENT and leaves the state held under that id as it was: only the engine's own bug or a
        hostile stream sends either, and running such a request would sample it twice or replace another's
        tokens. State is dropped only where this step added it or its own diffs or rows failed."""
        for request_id in step.finished_request_ids:
            self.requests.pop(request_id, None)
        order: list[str] = []
        rows: list[ScheduledRow | None] = []
        errors: dict[str, RequestOutput] = {}
        refused: set[str] = set()  # errors that must not drop the state held under their id
        scheduled: list[tuple[str, int]] = []
        repeated = _repeated_ids(step)
        for new in step.new_requests:
            request_id = new.request_id
            if request_id in repeated or request_id in self.requests:
                if request_id not in errors:  # one output per request id
                    why = "named twice in one step" if request_id in repeated else "already in use"
                    errors[request_id] = _refusal(request_id, why)
                    refused.add(request_id)
                    scheduled.append((request_id, 0))
                continue
            try:
                self._add_new(new)
            except (InvalidArgument, RequestError) as exc:
                errors[request_id] = RequestOutput(request_id, error_kind=exc.kind, error_message=str(exc))
            scheduled.append((request_id, new.num_scheduled_tokens))
        for running in step.running_requests:
            request_id = running.request_id
            if request_id in repeated:
                if request_id not in errors:
                    errors[request_id] = _refusal(request_id, "named twice in one step")
                    refused.add(request_id)
                    scheduled.append((request_id, 0))
                continue
            request = self.requests.get(request_id)
            if request is None:
                if request_id not in errors:
                    errors[request_id] = RequestOutput(
                        request_id,
                        error_kind=RuntimeErrorKind.INTERNAL,
                        error_message="the worker holds no state for this request",
                    )
            else:
                try:
                    # No group diffs at all: nothing appended to groups 1.. (a table left short is caught
                    # by _check_row when a step needs it).
                    others = running.new_group_kv_block_ids or [[] for _ in request.block_tables[1:]]
                    diffs = [running.new_kv_block_ids, *others]
                    self._check_block_ids(diffs)
                    for table, diff in zip(request.block_tables, diffs, strict=True):
                        table.extend(diff)
                except RequestError as exc:
                    errors[request_id] = RequestOutput(
                        request_id, error_kind=exc.kind, error_message=str(exc)
                    )
            scheduled.append((request_id, running.num_scheduled_tokens))
        for request_id, num_scheduled in scheduled:
            order.append(request_id)
            if request_id in errors:
                rows.append(None)
                continue
            request = self.requests[request_id]
            try:
                rows.append(self._check_row(request, num_scheduled) if num_scheduled > 0 else None)
            except RequestError as exc:
                errors[request_id] = RequestOutput(request_id, error_kind=exc.kind, error_message=str(exc))
                rows.append(None)
        for request_id in errors:
            if request_id not in refused:
                self.requests.pop(request_id, None)
        return order, rows, errors

    # ---- step --------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_step(self, step: DecodeStep) -> StepResult | None:
        """Run one step. With ``overlap_steps`` off, returns its result; on, returns None and the results
        (this step's and earlier ones', in step order) come out of ``take_results``; with ``early_results``
        the previous step's may already have left through ``post_result`` during this step's launch.

        The step takes one of five forward paths: overlapped with the previous one (``_launch_overlapped``: a
        decode graph, or eager with ``pipeline_eager``), a decode graph (``_decode_graph``), a single-prompt
        prefill graph (``_prefill_graph``) or eager (``_eager``).
        """
        started = time.perf_counter()
        order, rows, errors = self._apply_step(step)
        active = [row for row in rows if row is not None]
        num_tokens = sum(row.end - row.start for row in active)
        if len(active) < num_tokens:
            active = _prompt_side_first(active)
        graph_step = bool(active) and self._graph_step(active)
        overlap = self.overlap_steps and all(_overlappable(row.request) for row in active)
        # A decode graph step overlaps; an eager one too with ``pipeline_eager`` (a prefill graph does not).
        if overlap and (graph_step or self._overlaps_eagerly(active)):
            self._launch_overlapped(
                step.step_id, order, dict(errors), active, num_tokens, started, graph_step
            )
            return None
        self.finish_pending()  # what follows reads token values on the host
        outputs: dict[str, RequestOutput] = dict(errors)
        if graph_step:
            outputs.update(self._decode_graph(active))
        elif self._prefill_graph_fits(active):
            outputs.update(self._prefill_graph(active))
        elif active:
            outputs.update(self._eager(active))
        result = self._step_result(step.step_id, order, outputs, num_tokens, started)
        if self.overlap_steps:
            self._results.append(result)
            return None
        return result

    # ---- forward paths: each computes its rows and returns their outputs ---------------------------

    def _launch_overlapped(
        self,
        step_id: int,
        order: list[str],
        outputs: dict[str, RequestOutput],
        rows: list[ScheduledRow],
        num_tokens: int,
        started: float,
        graph_step: bool,
    ) -> None:
        """The step launched before the previous step's ids reach the host: their placeholders are gathered on
        the device (a decode graph, or eager inputs). This step's ids stay pending when it samples; the
        previous step's result is queued now, this one's once its ids arrive."""
        previous = self._pending
        prev_tokens = previous.token_ids if previous is not None else None
        sampled: SamplerOutput | None
        if graph_step:
            assert self._graphs is not None
            sampling_rows = rows
            sampled = self._sample_logits(self._graphs.run(rows, prev_tokens), rows)
        else:
            inputs = self._prepare_inputs(rows, prev_tokens)
            sampling_rows = inputs.sampling_rows
            sampled, posted = self._launch_posting_early(inputs, previous)
            if posted:
                previous = None
        for row in rows:
            if not row.samples:  # the sampling rows are booked by _defer
                row.request.num_computed_tokens = row.end
                outputs[row.request.request_id] = RequestOutput(row.request.request_id)
        self._pending = None
        if sampled is not None:
            self._pending = self._defer(step_id, order, outputs, sampling_rows, sampled, num_tokens, started)
        if previous is not None:
            self._results.append(self._finish(previous))
        if sampled is None:
            self._results.append(self._step_result(step_id, order, outputs, num_tokens, started))

    def _launch_posting_early(
        self, inputs: StepInputs, previous: PendingStep | None
    ) -> tuple[SamplerOutput | None, bool]:
        """Launch an eager step's forward and sampling; between its layers, ``previous``'s result leaves
        through ``post_result`` as soon as its ids are on the host. Returns the sampled output and whether
        ``previous`` was posted (it is no longer pending then)."""
        # Results already queued must leave first: posting ``previous`` past them would break step order.
        if previous is None or self.post_result is None or not self.early_results or self._results:
            return self._sample(self._forward(inputs), inputs), False
        self._early_candidate = previous
        self.model.between_layers = self._post_early_if_done
        try:
            sampled = self._sample(self._forward(inputs), inputs)
        finally:
            self.model.between_layers = None
            posted = self._early_candidate is None
            self._early_candidate = None
        return sampled, posted

    def _post_early_if_done(self) -> None:
        early = self._early_candidate
        if early is None or not early.done.query():
            return
        self._early_candidate = None
        if self._pending is early:
            self._pending = None  # a failure later in this launch must not finish it twice
        assert self.post_result is not None
        self.post_result(self._finish(early))

    def _decode_graph(self, rows: list[ScheduledRow]) -> dict[str, RequestOutput]:
        """Pure decode replayed from a captured graph."""
        assert self._graphs is not None
        sampled = self._sample_logits(self._graphs.run(rows), rows)
        return self._update_states(rows, rows, sampled)

    def _overlaps_eagerly(self, rows: list[ScheduledRow]) -> bool:
        return self.pipeline_eager and bool(rows) and not self._prefill_graph_fits(rows)

    def _prefill_graph_fits(self, rows: list[ScheduledRow]) -> bool:
        return (
            len(rows) > 0 and self._graphs is not None and self._graphs.fits_prefill(rows) and rows[0].samples
        )

    def _prefill_graph(self, rows: list[ScheduledRow]) -> dict[str, RequestOutput]:
        """One short prompt's last chunk replayed from a captured prefill graph."""
        assert self._graphs is not None
        sampled = self._sample_logits(self._graphs.run_prefill(rows[0]), rows)
        return self._update_states(rows, rows, sampled)

    def _eager(self, rows: list[ScheduledRow]) -> dict[str, RequestOutput]:
        """Any mix of prefill chunks and decodes, run eagerly as one ragged batch."""
        inputs = self._prepare_inputs(rows)
        sampled = self._sample(self._forward(inputs), inputs)
        return self._update_states(rows, inputs.sampling_rows, sampled)

    # ---- pipelined decode ---------------------------------------------------------------------------

    def has_pending(self) -> bool:
        return self._pending is not None

    def pending_ready(self) -> bool:
        """The pending step's sampled ids are on the host (finishing it will not block)."""
        return self._pending is None or self._pending.done.query()

    def finish_pending(self) -> None:
        """Wait for the pending step's sampled ids and queue its result."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._results.append(self._finish(pending))

    def reset_pending(self) -> None:
        """Forget the pending step (its device work failed)."""
        self._pending = None

    def take_results(self) -> list[StepResult]:
        results, self._results = self._results, []
        return results

    def _defer(
        self,
        step_id: int,
        order: list[str],
        outputs: dict[str, RequestOutput],
        rows: list[ScheduledRow],
        sampled: SamplerOutput,
        num_tokens: int,
        started: float,
    ) -> PendingStep:
        """Book the step as done on the host (placeholders for its tokens) and start the ids' copy back."""
        positions: list[int] = []
        for i, row in enumerate(rows):
            req = row.request
            req.num_computed_tokens = row.end
            outputs[req.request_id] = RequestOutput(req.request_id)
            positions.append(len(req.output_token_ids))
            req.output_token_ids.append(-1 - i)
        flags = torch.stack((sampled.token_ids, sampled.bad_rows.to(torch.int64)))
        done: torch.cuda.Event | _HostDone
        if flags.device.type == "cuda":
            host = torch.empty(flags.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:  # the CPU computed it already (the eager overlap's tests run there)
            host, done = flags, _HostDone()
        return PendingStep(
            step_id, order, outputs, rows, positions, sampled.token_ids, host, done, num_tokens, started
        )

    def _finish(self, pending: PendingStep) -> StepResult:
        pending.done.synchronize()
        token_ids, bad = pending.host.tolist()
        outputs = pending.outputs
        for i, row in enumerate(pending.rows):
            req = row.request
            req.output_token_ids[pending.positions[i]] = token_ids[i]
            if bad[i]:
                outputs[req.request_id] = RequestOutput(
                    req.request_id,
                    error_kind=RuntimeErrorKind.INTERNAL,
                    error_message="the model produced NaN logits",
                )
                if self.requests.get(req.request_id) is req:
                    del self.requests[req.request_id]
                continue
            outputs[req.request_id].sampled_token_id = token_ids[i]
        return self._step_result(pending.step_id, pending.order, outputs, pending.num_tokens, pending.started)

    def _step_result(
        self,
        step_id: int,
        order: list[str],
        outputs: dict[str, RequestOutput],
        num_tokens: int,
        started: float,
    ) -> StepResult:
        """The step's result: one output per request in ``order`` (an empty one where it has none)."""
        result = StepResult(step_id=step_id, num_tokens=num_tokens)
        result.outputs = [outputs.get(request_id) or RequestOutput(request_id) for request_id in order]
        self.last_step_id = step_id
        result.compute_seconds = time.perf_counter() - started
        return result

    def _prepare_inputs(
        self, rows: list[ScheduledRow], prev_tokens: torch.Tensor | None = None
    ) -> StepInputs:
        """Every tensor the forward and the sampler need, built on the host and copied once. A placeholder
        input token ``-(1 + j)`` (a pending step's sampled id) is taken from ``prev_tokens[j]`` on the device."""
        bs = self.block_size
        num_groups = len(self.attention_groups)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(num_groups)]
        query_start = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        max_blocks = max(-(-row.end // bs) for row in rows)
        num_tokens = sum(row.end - row.start for row in rows)
        bucket = self._piecewise_graphs.bucket_for(num_tokens) if self._piecewise_graphs is not None else None
        if self.device.type == "cuda":
            max_blocks = -(-max_blocks // BLOCK_TABLE_ALIGN) * BLOCK_TABLE_ALIGN
        block_rows: list[list[list[int]]] = [[] for _ in range(num_groups)]
        unset_slots = False
        for row in rows:
            req = row.request
            unset_slots |= row.start < req.kv_cached_until
            input_ids.extend(req.token_ids(row.start, row.end))
            span = range(row.start, row.end)
            positions.extend(span)
            for g, (group, blocks) in enumerate(zip(self.attention_groups, req.block_tables, strict=True)):
                used = _blocks_for_tokens(group, row.end, bs)
                if not group.compress_ratio:  # a compressed group's rows are written by its layers
                    _extend_slots(slots[g], blocks, row.start, row.end, bs, req.kv_cached_until)
                block_rows[g].append(blocks[:used] + [0] * (max_blocks - used))
            query_start.append(query_start[-1] + row.end - row.start)
            seq_lens.append(row.end)
            if row.samples:
                logits_indices.append(query_start[-1] - 1)
        if bucket is not None:  # padding rows: token 0 at position 0, a slot the KV store skips
            padding = bucket - num_tokens
            input_ids += [0] * padding
            positions += [0] * padding
            for group_slots in slots:
                group_slots += [-1] * padding
        if logits_indices and self.pad_logits:
            padded = self._logits_rows(len(logits_indices))
            logits_indices += [logits_indices[-1]] * (padded - len(logits_indices))
        max_query_len = max(row.end - row.start for row in rows)
        first = AttentionMetadata(
            query_start_loc=self._to_device(torch.tensor(query_start, dtype=torch.int32)),
            seq_lens=self._to_device(torch.tensor(seq_lens, dtype=torch.int32)),
            block_tables=self._to_device(torch.tensor(block_rows[0], dtype=torch.int32)),
            slot_mapping=self._to_device(torch.tensor(slots[0], dtype=torch.int64)),
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
            num_decode_only=max_query_len == 1,
            query_start_loc_cpu=query_start,
            seq_lens_cpu=seq_lens,
            sliding_window=self.attention_groups[0].window,
            has_unset_slots=unset_slots,
        )
        # The other groups share the step's shape and differ in tables, slots and window.
        metas = (first,) + tuple(
            replace(
                first,
                block_tables=self._to_device(torch.tensor(block_rows[g], dtype=torch.int32)),
                slot_mapping=self._to_device(torch.tensor(slots[g], dtype=torch.int64)),
                sliding_window=self.attention_groups[g].window,
            )
            for g in range(1, num_groups)
        )
        sampling_rows = [row for row in rows if row.samples]
        ids = self._to_device(torch.tensor(input_ids, dtype=torch.int64))
        if min(input_ids) < 0:
            if prev_tokens is None:
                raise RuntimeError("a placeholder input token without the pending step's ids")
            ids = resolve_placeholders(ids, prev_tokens)
        return StepInputs(
            input_ids=ids,
            positions=self._to_device(torch.tensor(positions, dtype=torch.int64)),
            metas=metas,
            logits_indices=self._to_device(torch.tensor(logits_indices, dtype=torch.int64)),
            sampling=self._sampling_tensors(sampling_rows) if sampling_rows else None,
            sampling_rows=sampling_rows,
            piecewise_bucket=bucket or 0,
        )

    def _logits_rows(self, rows: int) -> int:
        """The LM head's row count for ``rows`` sampled rows: the smallest captured decode size that holds them,
        or ``rows`` itself above every captured size (and before any capture)."""
        return padded_size(rows, self.logits_row_sizes) or rows

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return tensor
        if self._pin:
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def _sampling_tensors(self, rows: list[ScheduledRow]) -> SamplingTensors:
        params = [row.request.sampling for row in rows]
        vocab = self.vocab_size
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        seeds = [_as_int64(row.request.seed) for row in rows]
        # A greedy row goes to the device as 0: the sampler's float32 threshold then agrees with the host's
        # (``SamplingParams.is_greedy``) even for a temperature that rounds across it.
        temperatures = [p.sampling_temperature for p in params]
        t = SamplingTensors(
            temperature=self._to_device(torch.tensor(temperatures, dtype=torch.float32)),
            top_k=self._to_device(torch.tensor(top_k, dtype=torch.int64)),
            top_p=self._to_device(torch.tensor([p.top_p for p in params], dtype=torch.float32)),
            min_p=self._to_device(torch.tensor([p.min_p for p in params], dtype=torch.float32)),
            seeds=self._to_device(torch.tensor(seeds, dtype=torch.int64)),
            output_positions=self._to_device(
                torch.tensor([len(r.request.output_token_ids) for r in rows], dtype=torch.int64)
            ),
            num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
            needs_top_k=any(k < vocab for k in top_k),
            needs_top_p=any(p.top_p < 1.0 for p in params),
            needs_min_p=any(p.min_p > 0.0 for p in params),
            all_greedy=not any(temperatures),
        )
        if any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in params):
            # The output ids are all on the host: a penalised row never runs overlapped (``_overlappable``),
            # so none is a pending step's placeholder.
            shape = (len(rows), vocab)
            out_rows, out_ids = self._row_ids([row.request.output_token_ids for row in rows])
            counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
            counts.index_put_(
                (out_rows, out_ids), torch.ones_like(out_ids, dtype=torch.float32), accumulate=True
            )
            prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
            prompt_mask[self._row_ids([row.request.prompt_token_ids for row in rows])] = True
            t.output_counts = counts
            t.prompt_mask = prompt_mask
            t.repetition_penalty = self._to_device(torch.tensor([p.repetition_penalty for p in params]))
            t.frequency_penalty = self._to_device(torch.tensor([p.frequency_penalty for p in params]))
            t.presence_penalty = self._to_device(torch.tensor([p.presence_penalty for p in params]))
        banned_ids = [
            [
                token
                for token in (*self.config.eos_token_ids, *row.request.sampling.stop_token_ids)
                if token < vocab
            ]
            if len(row.request.output_token_ids) < row.request.sampling.min_tokens
            else []
            for row in rows
        ]
        if any(banned_ids):
            t.banned_mask = torch.zeros((len(rows), vocab), dtype=torch.bool, device=self.device)
            t.banned_mask[self._row_ids(banned_ids)] = True
        return t

    def _row_ids(self, ids_by_row: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The (row, id) pairs of every row's ids, as two index tensors on the device: the sampler's rows x
        vocabulary tensors (penalty counts, prompt and banned masks) are filled there from them, so only the
        ids cross to the device, not the tensors (128 MiB of counts at 256 rows of a 128K vocabulary)."""
        lengths = torch.tensor([len(ids) for ids in ids_by_row], dtype=torch.int64)
        flat = torch.cat([torch.tensor(ids, dtype=torch.int64) for ids in ids_by_row])
        rows = torch.repeat_interleave(torch.arange(len(ids_by_row), dtype=torch.int64), lengths)
        return self._to_device(rows), self._to_device(flat)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The final hidden states of the rows whose logits the step samples, in ``logits_indices`` order: the
        last layer computes only those past its attention (``last_layer_rows``). A step that samples nothing
        keeps its first row, so that no kernel meets an empty batch."""
        keep = inputs.logits_indices if inputs.logits_indices.shape[0] else self._first_row
        if inputs.piecewise_bucket:
            assert self._piecewise_graphs is not None
            return self._piecewise_graphs.run(
                inputs.input_ids, inputs.positions, inputs.metas, keep, self.model.between_layers
            )
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metas, keep)

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs) -> SamplerOutput | None:
        """Sample from ``hidden``, the rows of ``logits_indices`` (``_forward``)."""
        if inputs.sampling is None:
            return None
        logits = self.model.compute_logits(hidden)
        # Rows past the sampled ones pad the LM head to a captured size (``logits_row_sizes``).
        return sample(logits[: len(inputs.sampling_rows)], inputs.sampling)

    def _graph_step(self, rows: list[ScheduledRow]) -> bool:
        """A captured graph serves the step: every row decodes exactly one token and the batch fits."""
        graphs = self._graphs
        if graphs is None or not graphs.fits(len(rows)):
            return False
        return all(row.samples and row.end - row.start == 1 for row in rows)

    def _sample_logits(self, logits: torch.Tensor, rows: list[ScheduledRow]) -> SamplerOutput:
        """``sample`` on the graph's logits; plain greedy rows skip building the per-row parameter tensors."""
        if all(_plain_greedy(row.request) for row in rows):
            # What ``sample`` computes when every row is greedy with nothing to mask or report.
            token_ids, bad_rows = greedy(logits)
            return SamplerOutput(token_ids=token_ids, bad_rows=bad_rows)
        return sample(logits, self._sampling_tensors(rows))

    def _update_states(
        self, rows: list[ScheduledRow], sampling_rows: list[ScheduledRow], sampled: SamplerOutput | None
    ) -> dict[str, RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        for row in rows:
            row.request.num_computed_tokens = row.end
            outputs[row.request.request_id] = RequestOutput(row.request.request_id)
        if sampled is None:
            return outputs
        # One device → host transfer for the tokens (and NaN flags); one more only when logprobs are asked.
        token_ids, bad = torch.stack((sampled.token_ids, sampled.bad_rows.to(torch.int64))).tolist()
        sampled_lp = top_lp = top_ids = None
        if sampled.sampled_logprobs is not None:
            floats = [sampled.sampled_logprobs.unsqueeze(1)]
            n = 0  # top-N columns
            if sampled.top_logprobs is not None and sampled.top_token_ids is not None:
                n = sampled.top_logprobs.shape[1]
                floats += [sampled.top_logprobs, sampled.top_token_ids.to(torch.float64)]
            host = torch.cat([f.to(torch.float64) for f in floats], dim=1).tolist()
            sampled_lp = [row[0] for row in host]
            if len(floats) > 1:
                top_lp = [row[1 : 1 + n] for row in host]
                top_ids = [[int(t) for t in row[1 + n :]] for row in host]
        for i, row in enumerate(sampling_rows):
            req = row.request
            if bad[i]:
                outputs[req.request_id] = RequestOutput(
                    req.request_id,
                    error_kind=RuntimeErrorKind.INTERNAL,
                    error_message="the model produced NaN logits",
                )
                self.requests.pop(req.request_id, None)
                continue
            out = outputs[req.request_id]
            out.sampled_token_id = token_ids[i]
            num_top = req.sampling.logprobs
            if num_top is not None and sampled_lp is not None:
                top = []
                if num_top > 0 and top_lp is not None and top_ids is not None:
                    top = [TokenLogprob(top_ids[i][j], top_lp[i][j]) for j in range(num_top)]
                out.logprobs = SampledLogprobs(TokenLogprob(token_ids[i], sampled_lp[i]), top)
            req.output_token_ids.append(token_ids[i])
        return outputs

    # ---- warm-up and device seams ------------------------------------------------------------------

    def _scratch_row(
        self, request_id: str, num_tokens: int, blocks: Sequence[int], start: int
    ) -> ScheduledRow:
        """A row of a request that exists only for one warm-up or profiling forward: ``num_tokens`` zero
        tokens, the first ``start`` of them already in ``blocks`` (every KV group's table), the rest computed."""
        params = SamplingParams(temperature=0.0)
        tables = [list(blocks) for _ in self.attention_groups]
        request = CachedRequest(request_id, [0] * num_tokens, [], params, tables, start, 0)
        return ScheduledRow(request, start, num_tokens, samples=True)

    @torch.inference_mode()
    def _run_scratch(self, rows: list[ScheduledRow]) -> None:
        inputs = self._prepare_inputs(rows)
        self._sample(self._forward(inputs), inputs)

    def profile_forward(self, num_tokens: int) -> None:
        """One forward of ``num_tokens`` prompt tokens in a single request, writing into block 0 onward."""
        capacity = min(self.group_num_blocks) * self.block_size
        num_tokens = max(1, min(num_tokens, self.max_model_len, capacity))
        blocks = range(-(-num_tokens // self.block_size))
        self._run_scratch([self._scratch_row("__profile__", num_tokens, blocks, 0)])

    def mixed_forward(self, decode_rows: int, context: int, prefill_tokens: int) -> bool:
        """One eager step of ``decode_rows`` single-token rows over ``context`` cached tokens beside one
        ``prefill_tokens`` prompt row, as continuous batching mixes them; the decode rows share their blocks.
        Returns False (nothing run) when the cache cannot hold it."""
        bs = self.block_size
        context = max(1, min(context, self.max_model_len - 1))
        decode_blocks = -(-(context + 1) // bs)
        prefill_tokens = max(2, min(prefill_tokens, self.max_model_len))
        prefill_blocks = -(-prefill_tokens // bs)
        if decode_blocks + prefill_blocks > min(self.group_num_blocks):
            return False
        shared = range(decode_blocks)
        rows = [
            self._scratch_row(f"__warm_up_{i}__", context + 1, shared, context) for i in range(decode_rows)
        ]
        own = range(decode_blocks, decode_blocks + prefill_blocks)
        rows.append(self._scratch_row("__warm_up_prompt__", prefill_tokens, own, 0))
        self._run_scratch(rows)
        return True

    def warm_up(self, max_tokens: int) -> list[int]:
        """Eager forwards before the first request; returns their token counts. CUDA: 16, 64, then every power
        of two up to ``max_tokens`` and ``max_tokens`` itself, so that the Triton kernels of prefill steps,
        and the fused-MoE tile shapes (which change with the token count), compile here rather than stall a
        step of a running batch for a second or more; then the mixed steps (decode rows beside a prompt) the
        attention backend names, whose kernels are variants of their own (``mixed_warm_up_steps``). Other
        devices: one forward of at most 16 tokens."""
        counts = warm_up_token_counts(max_tokens, cuda=self.device.type == "cuda")
        for num_tokens in counts:
            self.profile_forward(num_tokens)
        if self.kv_caches:
            num_kv_heads = self.kv_caches[0].shape[3]
            for rows, context, tokens in self.backend.mixed_warm_up_steps(
                num_kv_heads, max_tokens, self.device
            ):
                self.mixed_forward(rows, context, tokens)
        # An eager step launched behind a pending one gathers its placeholders first; its kernels are first
        # needed in serving (a prompt beside a few decodes), so they run once here, with nothing queued.
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        resolve_placeholders(torch.tensor([-1, 1], dtype=torch.int64, device=self.device), zero)
        return counts

    @torch.inference_mode()
    def warm_up_gemm_rows(self, max_tokens: int, bucket: int, lm_head: bool = False) -> int:
        """Run each distinct linear layer's GEMM (layer class, weight shape and dtype, bias or not) once at the
        top row count of every bucket of ``bucket`` rows up to ``max_tokens``, with a zero input in the
        model's dtype; the LM head only with ``lm_head`` (its rows are otherwise padded to captured sizes), and
        no layer whose weight was packed for the CPU. Returns the calls made. On an H200 a first cuBLAS call
        at a row count new to it waited for the device to drain its queue (~85 - 185 ms behind queued work),
        once per bucket of 8 rows at the LM head's shape and at some counts 7 - 33 rows apart at the gate-up
        shape (bench/RESULTS.md, 2026-11-30), holding the device thread in the middle of serving. With
        buckets of 8 (4,096 calls, 2.2 - 2.6 s at start for the Llama-3.1-8B shape) three fresh services had
        no such stall (three unwarmed ones one each, 156 - 176 ms); ITL p99 moved -1.7 to +5.6 ms, within
        what one host's launch speed varies (one eager launch's CPU time ran 14 - 30 ms in one process). The
        worker's OMINIX_WARM_GEMM_ROWS stays off by default until an online A/B decides."""
        if bucket <= 0:
            return 0
        head = self.model.lm_head
        layers: dict[tuple[object, ...], PackableLinear] = {}
        for module in self.model.modules():
            if not isinstance(module, PackableLinear) or module.packed is not None:
                continue
            if module is head and not lm_head:
                continue
            w, bias = module.weight, getattr(module, "bias", None)  # the LM head has none
            layers.setdefault((type(module), tuple(w.shape), w.dtype, bias is not None), module)
        if not layers:
            return 0
        widest = max(int(layer.weight.shape[1]) for layer in layers.values())
        dtype = self.model.embed_tokens.weight.dtype  # the activations'
        flat = torch.zeros(max_tokens * widest, dtype=dtype, device=self.device)
        calls = 0
        for rows in gemm_warm_up_rows(max_tokens, bucket):
            for layer in layers.values():
                features = int(layer.weight.shape[1])
                # A contiguous [rows, features] input, as a step's activations are.
                layer.warm_gemm(flat[: rows * features].view(rows, features))
                calls += 1
        return calls

    def capture_decode_graphs(self, batch_sizes: list[int] | None = None) -> bool:
        """CUDA: capture pure-decode steps for ``batch_sizes`` (default: 1 to 256); other devices capture nothing.
        (The server warms up eager shapes first, ``warm_up``, and skips this call under
        ``OMINIX_CUDA_GRAPHS=0``.)
        """
        if self.device.type != "cuda" or not self.kv_caches:
            return False
        started = time.perf_counter()
        graphs = DecodeGraphs(
            self.model, self.backend, self.kv_caches, self.device, self.max_model_len,
            batch_sizes or DEFAULT_BATCH_SIZES, kv_windows=self.kv_windows,
        )  # fmt: skip
        graphs.capture()
        self._graphs = graphs
        self.logits_row_sizes = tuple(graphs.sizes)
        log.info("captured %d decode graphs in %.1f s", len(graphs.graphs), time.perf_counter() - started)
        return True

    def piecewise_capturable(self) -> bool:
        """Its prefill and mixed steps can be captured in pieces: CUDA, a backend that offers it, a model whose
        layers attend through the backend's forward."""
        return (
            self.device.type == "cuda"
            and self.backend.piecewise_attention() is not None
            and self.model.piecewise_graphs
        )

    def capture_piecewise_graphs(
        self, max_tokens: int, timed: bool = False, step: int = TOKEN_STEP, sampled_rows: int = 0
    ) -> int:
        """CUDA: capture prefill and mixed steps of up to ``max_tokens`` tokens in pieces, per bucket of ``step``
        tokens; returns the buckets captured (0: none, and the steps stay eager:
        not ``piecewise_capturable``, or a capture that failed on a lone rank; on a rank of a group a failure
        raises). After the decode graphs (``capture_decode_graphs``), as the server calls it under
        ``OMINIX_PIECEWISE_GRAPH_TOKENS``. ``timed``: on a lone rank, each bucket's pieces are timed and a step
        replays the fastest captured bucket that holds it (``PiecewiseGraphs.time_buckets``); the ranks of a
        group would each time their own and must pad alike, and an MoE model's padding rows do not cost what
        its tokens do, so they keep the smallest. ``sampled_rows``: the most rows a step samples (the
        running-request limit); a bucket larger than that, padded as the LM head pads it, runs its last layer
        past attention on that many rows (0: every bucket on all of its rows)."""
        attention = self.backend.piecewise_attention() if self.piecewise_capturable() else None
        buckets = token_buckets(max_tokens, step)
        if attention is None or not self.kv_caches or not buckets:
            return 0
        started = time.perf_counter()
        tail_rows = self._logits_rows(sampled_rows) if sampled_rows else 0
        graphs = PiecewiseGraphs(self.model, attention, self.device, buckets, self.kv_windows, tail_rows)
        try:
            graphs.capture(self.kv_caches)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            if self.model.tp.size > 1:
                # The other ranks may be waiting in a collective of the uncaptured pass, and a rank that went
                # on eagerly would reduce unpadded rows against their padded ones: the group must not start.
                raise RuntimeError(
                    f"the piecewise capture failed on rank {self.model.tp.rank}: {exc}"
                ) from exc
            log.warning("prefill and mixed steps stay eager: their capture failed (%s)", exc)
            return 0
        self._piecewise_graphs = graphs
        log.info(
            "captured prefill and mixed steps at %d token counts up to %d in %.1f s",
            len(buckets), buckets[-1], time.perf_counter() - started,
        )  # fmt: skip
        if timed:
            self._route_piecewise_steps(graphs)
        return len(buckets)

    def _route_piecewise_steps(self, graphs: PiecewiseGraphs) -> None:
        """Time the captured buckets and send steps to larger, faster ones where that held
        (``capture_piecewise_graphs(timed=True)``); otherwise each step keeps the smallest that holds it."""
        if self.model.tp.size > 1:
            log.warning("piecewise buckets not timed: the ranks of a group must pad their steps alike")
            return
        if not self.model.piecewise_bucket_timing:
            log.warning(
                "piecewise buckets not timed: %s's timed pieces do not stand for its steps",
                type(self.model).__name__,
            )
            return
        started = time.perf_counter()
        try:
            times, routes = graphs.time_buckets()
        except RuntimeError as exc:
            log.warning("piecewise buckets not timed (%s): each step replays the smallest that holds it", exc)
            return
        graphs.set_routes(routes)
        self.piecewise_bucket_ms = times
        log.info(
            "timed %d piecewise buckets in %.1f s; %d replay a larger, faster one: %s",
            len(times), time.perf_counter() - started, len(routes),
            ", ".join(f"{b}->{r}" for b, r in sorted(routes.items())) or "none",
        )  # fmt: skip


def resolve_placeholders(ids: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """``ids`` (int64, on the device) with each placeholder ``-(1 + j)`` replaced by ``prev_tokens[j]``, the
    pending step's sampled id, without waiting for it on the host."""
    return torch.where(ids < 0, prev_tokens.index_select(0, (-1 - ids).clamp(min=0)), ids)


def _kind(group: AttentionGroup) -> AttentionKind:
    if group.compress_ratio:
        return AttentionKind.COMPRESSED
    return AttentionKind.SLIDING_WINDOW if group.window else AttentionKind.FULL


def _extend_slots(
    slots: list[int], blocks: Sequence[int], start: int, end: int, block_size: int, cached_until: int = 0
) -> None:
    """Append the flat KV slots of positions [start, end) (``blocks[p // block_size] * block_size + p %
    block_size``), a range per block rather than a product per token: a 1,024-token prompt is 64 ranges.
    Positions below ``cached_until`` hold their KV already (shared blocks): slot -1, not written."""
    if start < cached_until:
        skip = min(cached_until, end)
        slots.extend([-1] * (skip - start))
        start = skip
    while start < end:
        index = start // block_size
        stop = min(end, (index + 1) * block_size)
        offset = (blocks[index] - index) * block_size  # slot - position within this block
        slots.extend(range(offset + start, offset + stop))
        start = stop


def _blocks_for_tokens(group: AttentionGroup, num_tokens: int, block_size: int) -> int:
    """Blocks of ``group`` the first ``num_tokens`` tokens occupy: one row per token, or (compressed) one per
    complete chunk."""
    rows = num_tokens // group.compress_ratio if group.compress_ratio else num_tokens
    return -(-rows // block_size)


def _repeated_ids(step: DecodeStep) -> frozenset[str]:
    """The request ids ``step`` names more than once (new and running together); empty in a well-formed step."""
    named = len(step.new_requests) + len(step.running_requests)
    ids = {new.request_id for new in step.new_requests}
    ids.update([running.request_id for running in step.running_requests])
    if len(ids) == named:
        return frozenset()
    counts = Counter(new.request_id for new in step.new_requests)
    counts.update(running.request_id for running in step.running_requests)
    return frozenset(request_id for request_id, n in counts.items() if n > 1)


def _refusal(request_id: str, why: str) -> RequestOutput:
    return RequestOutput(
        request_id,
        error_kind=RuntimeErrorKind.INVALID_ARGUMENT,
        error_message=f"request id {request_id!r} {why}",
    )


def _overlappable(request: CachedRequest) -> bool:
    """Sampling needs no output-token values on the host (penalties count them) and no logprobs."""
    p = request.sampling
    return (
        p.logprobs is None
        and p.repetition_penalty == 1.0
        and not p.frequency_penalty
        and not p.presence_penalty
    )


def _plain_greedy(request: CachedRequest) -> bool:
    p = request.sampling
    return (
        p.is_greedy
        and p.logprobs is None
        and p.repetition_penalty == 1.0
        and not p.frequency_penalty
        and not p.presence_penalty
        and len(request.output_token_ids) >= p.min_tokens
    )


def gemm_warm_up_rows(max_tokens: int, bucket: int) -> list[int]:
    """The top row count of each bucket of ``bucket`` rows that a step of at most ``max_tokens`` rows can use:
    ``bucket``, ``2 * bucket``, ... and ``max_tokens`` for the last, partial one."""
    return sorted({min(top, max_tokens) for top in range(bucket, max_tokens + bucket, bucket)})


def warm_up_token_counts(max_tokens: int, cuda: bool) -> list[int]:
    """``ModelRunner.warm_up``'s forwards: on CUDA 16, 64, the powers of two from 128 below ``max_tokens``, and
    ``max_tokens``; elsewhere one forward of at most 16 tokens."""
    if not cuda:
        return [min(16, max_tokens)]
    counts = {16, 64, max_tokens} | {1 << p for p in range(7, max_tokens.bit_length())}
    return sorted(n for n in counts if n <= max_tokens)


def build_runner(
    model_path: str | None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    num_blocks: int = 256,
    block_size: int = 16,
    attention: str | None = None,
    max_model_len: int | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    tp: TensorParallel = SINGLE,
) -> ModelRunner:
    """A runner with a fixed number of KV blocks (tests, benchmarks); the server sizes KV from memory.

    With ``tp`` (a joined group), this rank's shards of the model and its KV heads."""
    from ominix_runtime.models import resolve_model
    from ominix_worker.attention import get_attention_backend
    from ominix_worker.devices import make_current
    from ominix_worker.kv_cache import allocate_kv_cache, resolve_kv_cache_dtype
    from ominix_worker.loader import load_model

    device = torch.device(device)
    make_current(device)
    backend = get_attention_backend(attention or device.type, block_size)
    source = resolve_model(model_path)
    loaded = load_model(
        source, device, dtype, backend, max_positions=max_model_len, tp=tp, quantization=quantization
    )
    config = loaded.config
    max_len = max_model_len or config.max_len_for(backend.supports_sliding_window)
    kv_heads = tp.kv_heads(config.num_kv_heads, config.num_heads).size
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype, device)
    kv = allocate_kv_cache(backend, config, num_blocks, kv_dtype, device, kv_heads)
    return ModelRunner(loaded.model, loaded.config, backend, kv, device, max_len)


def _prompt_side_first(rows: list[ScheduledRow]) -> list[ScheduledRow]:
    """The rows computing several tokens (prompts, chunks, prefix-hit suffixes), then the single-token ones, each
    part in its own order. A step's row order is the worker's own (outputs go back by request id); this one lets
    a paged-attention prefill launch span the leading prompt-side requests only
    (``mixed_plan.prompt_side_requests``)."""
    prompt_side = [row for row in rows if row.end - row.start > 1]
    if len(prompt_side) == len(rows):
        return rows
    return prompt_side + [row for row in rows if row.end - row.start == 1]
