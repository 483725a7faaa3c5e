"""Deterministic replay: the real Scheduler and KV registry, driven tick by tick by a simulated worker.

One tick = one ``Scheduler.schedule()`` call. Per tick: requests whose ``arrival_tick`` has come are added
(list order within a tick), a step is scheduled and run by :class:`SimulatedWorker`, and the oldest step in
flight is answered once ``max_inflight_steps`` are out (1: at once; 2: one tick later, as the engine's
overlapped driver does under light load). The simulated clock advances by the cost model's time of the answered step.

The trace fingerprint hashes every scheduling decision (admissions, tokens granted per request, preemptions,
decodes, completions, queue and KV occupancy) as canonical JSON; timings are not part of it, so the same
workload gives the same fingerprint on any machine, and one changed decision changes it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ominix_runtime.contract import (
    DecodeStep,
    Done,
    Error,
    GenerateRequest,
    OminixError,
    SamplingParams,
    StepResult,
    Token,
    WorkerEvent,
)
from ominix_runtime.engine.kv_registry import IntegrityError
from ominix_runtime.engine.scheduler import Scheduler
from ominix_runtime.release.cost_model import StepShape
from ominix_runtime.release.fingerprint import fingerprint
from ominix_runtime.release.simulated_worker import SimulatedWorker
from ominix_runtime.release.workload import ReplayRequest, Workload

# A workload whose scheduler makes no progress for this many ticks with work left is reported as stalled.
_STALL_TICKS = 10_000


class ReplayStalled(RuntimeError):
    """The scheduler kept work but scheduled nothing: a policy bug the replay surfaces instead of looping."""


@dataclass(slots=True)
class TickRecord:
    tick: int
    step_id: int | None
    arrived: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    scheduled: list[tuple[str, int]] = field(default_factory=list)  # (request id, tokens granted), step order
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    decoded: list[str] = field(default_factory=list)  # got a token from the step answered this tick
    completed: list[str] = field(default_factory=list)
    queued: int = 0
    active: int = 0
    kv_blocks_used: int = 0
    step_ms: float = 0.0
    # The step's budget: smaller in a step with decodes under max_batch_tokens_with_decodes (or
    # max_batch_tokens_in_burst while a burst is taken in).
    token_budget: int = 0

    def decisions(self) -> dict[str, object]:
        """Everything but timing: what the fingerprint covers."""
        return {
            "tick": self.tick,
            "step_id": self.step_id,
            "arrived": self.arrived,
            "rejected": self.rejected,
            "admitted": self.admitted,
            "scheduled": [[rid, n] for rid, n in self.scheduled],
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "preempted": self.preempted,
            "decoded": self.decoded,
            "completed": self.completed,
            "queued": self.queued,
            "active": self.active,
            "kv_blocks_used": self.kv_blocks_used,
        }

    def to_json(self) -> dict[str, object]:
        return self.decisions() | {"step_ms": round(self.step_ms, 6)}


@dataclass(slots=True)
class RequestTrack:
    spec: ReplayRequest
    first_admitted_tick: int | None = None
    first_token_tick: int | None = None
    finish_tick: int | None = None
    finish: str = ""
    output_tokens: int = 0
    error: str = ""


@dataclass(slots=True)
class ReplayRun:
    """The raw outcome of a replay; :mod:`~ominix_runtime.release.replay_report` turns it into a report."""

    workload: Workload
    scheduler: Scheduler
    ticks: list[TickRecord]
    tracks: dict[str, RequestTrack]
    rejected: dict[str, str]
    simulated_ms: float
    kv_problem: str
    worker_requests_left: int

    @property
    def trace_fingerprint(self) -> str:
        return fingerprint({"ticks": [t.decisions() for t in self.ticks], "rejected": self.rejected})


class _Replayer:
    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.now_ms = 0.0
        self.scheduler = Scheduler(workload.capability, workload.scheduler, clock=self._clock, seed=0)
        registry = self.scheduler.registry
        model = workload.capability.model
        self.worker = SimulatedWorker(
            registry.num_blocks,
            registry.block_size,
            model.vocab_size,
            frozenset(model.eos_token_ids),
            workload.capability.supports_whole_prompt_hits,
        )
        self.pending = deque(sorted(workload.requests, key=lambda r: r.arrival_tick))  # stable: list order
        self.tracks = {r.request_id: RequestTrack(r) for r in workload.requests}
        self.rejected: dict[str, str] = {}
        self.inflight: deque[tuple[DecodeStep, StepResult, StepShape]] = deque()
        self.ticks: list[TickRecord] = []

    def _clock(self) -> float:
        return self.now_ms / 1e3

    def run(self) -> ReplayRun:
        tick = 0
        idle_streak = 0
        while self.pending or self.scheduler.has_work() or self.inflight:
            record = TickRecord(tick=tick, step_id=None)
            self._arrivals(record)
            step = self.scheduler.schedule()
            self.scheduler.take_events()  # a request schedule() ended is reported from scheduler.finished
            if step is not None:
                self._schedule(step, record)
            # Occupancy while the step runs (after scheduling, before its answer frees anything).
            record.kv_blocks_used = self.scheduler.registry.num_leased_blocks
            record.queued = self.scheduler.num_waiting
            record.active = self.scheduler.num_running
            if self.inflight and (len(self.inflight) >= self.workload.max_inflight_steps or step is None):
                self._answer(record)
            else:
                record.step_ms = self.workload.cost_model.idle_ms if step is None else 0.0
            if step is None and not record.decoded and not record.completed and not record.arrived:
                idle_streak += 1
                if not self.pending and idle_streak > _STALL_TICKS:
                    raise ReplayStalled(
                        f"tick {tick}: {self.scheduler.num_waiting} waiting and {self.scheduler.num_running} "
                        f"running requests, but nothing was scheduled for {_STALL_TICKS} ticks"
                    )
                if self.pending and not self.scheduler.has_work() and not self.inflight:
                    # Nothing to do until the next arrival: skip the empty ticks (counted, not traced).
                    skipped = self.pending[0].arrival_tick - tick
                    self.now_ms += skipped * self.workload.cost_model.idle_ms
                    tick = self.pending[0].arrival_tick
                    continue
            else:
                idle_streak = 0
            self.ticks.append(record)
            tick += 1
        return ReplayRun(
            workload=self.workload,
            scheduler=self.scheduler,
            ticks=self.ticks,
            tracks=self.tracks,
            rejected=self.rejected,
            simulated_ms=self.now_ms,
            kv_problem=self._kv_problem(),
            worker_requests_left=len(self.worker.requests),
        )

    def _arrivals(self, record: TickRecord) -> None:
        while self.pending and self.pending[0].arrival_tick <= record.tick:
            spec = self.pending.popleft()
            record.arrived.append(spec.request_id)
            request = GenerateRequest(
                request_id=spec.request_id,
                prompt_token_ids=list(spec.prompt_token_ids),
                sampling=SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True, seed=0),
                priority=spec.priority,
                arrival_time=self._clock(),
            )
            try:
                self.scheduler.add_request(request)
            except OminixError as exc:
                record.rejected.append(spec.request_id)
                self.rejected[spec.request_id] = f"{exc.kind.name}: {exc.message}"
                track = self.tracks[spec.request_id]
                track.finish, track.error, track.finish_tick = "REJECTED", exc.message, record.tick

    def _schedule(self, step: DecodeStep, record: TickRecord) -> None:
        plan = self.scheduler.last_plan
        record.step_id = step.step_id
        record.admitted = [r.request_id for r in step.new_requests]
        record.scheduled = [(r.request_id, r.num_scheduled_tokens) for r in step.new_requests] + [
            (r.request_id, r.num_scheduled_tokens) for r in step.running_requests
        ]
        if plan is not None:
            record.prefill_tokens = plan.num_prefill_tokens
            record.decode_tokens = plan.num_decode_tokens
            record.token_budget = plan.token_budget
            record.preempted = list(plan.preempted_request_ids)
        for rid in record.admitted:
            track = self.tracks[rid]
            if track.first_admitted_tick is None:
                track.first_admitted_tick = record.tick
        shape = StepShape(
            record.prefill_tokens, record.decode_tokens, self.scheduler.registry.num_leased_blocks
        )
        self.inflight.append((step, self.worker.execute(step), shape))

    def _answer(self, record: TickRecord) -> None:
        step, result, shape = self.inflight.popleft()
        record.step_ms = self.workload.cost_model.step_ms(shape)
        self.now_ms += record.step_ms
        events = self.scheduler.update(step, result)
        self._apply(events, record)

    def _apply(self, events: list[WorkerEvent], record: TickRecord) -> None:
        for event in events:
            track = self.tracks[event.request_id]
            if isinstance(event, Token):
                record.decoded.append(event.request_id)
                track.output_tokens += len(event.token_ids)
                if track.first_token_tick is None:
                    track.first_token_tick = record.tick
            elif isinstance(event, Done):
                record.completed.append(event.request_id)
                track.finish, track.finish_tick = event.finish_reason.name, record.tick
            elif isinstance(event, Error):
                record.completed.append(event.request_id)
                track.finish, track.error, track.finish_tick = "ERROR", event.message, record.tick

    def _kv_problem(self) -> str:
        """Empty when every KV block came back and the books balance; else what is wrong."""
        try:
            self.scheduler.check_integrity()
            self.scheduler.registry.check_quiescent()
        except (IntegrityError, AssertionError) as exc:
            return str(exc)
        return ""


def replay(workload: Workload) -> ReplayRun:
    """Run ``workload`` through the real scheduler; deterministic for a given workload."""
    return _Replayer(workload).run()
