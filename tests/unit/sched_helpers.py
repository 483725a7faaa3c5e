"""Synchronous drive loop: scheduler + fake worker, with up to ``max_inflight`` steps in flight."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ominix_runtime.contract import (
    DecodeStep,
    Done,
    Error,
    GenerateRequest,
    SamplingParams,
    Token,
    WorkerEvent,
    is_terminal,
)
from ominix_runtime.engine.config import SchedulerConfig
from ominix_runtime.engine.scheduler import Scheduler
from ominix_runtime.testing.fake_backend import FakeConfig, FakeStepBackend


@dataclass
class Run:
    scheduler: Scheduler
    backend: FakeStepBackend
    events: dict[str, list[WorkerEvent]] = field(default_factory=dict)
    steps: list[DecodeStep] = field(default_factory=list)

    def tokens(self, request_id: str) -> list[int]:
        return [t for e in self.events.get(request_id, []) if isinstance(e, Token) for t in e.token_ids]

    def terminal(self, request_id: str) -> WorkerEvent:
        ends = [e for e in self.events[request_id] if is_terminal(e)]
        assert len(ends) == 1, ends
        return ends[0]

    def record(self, events: list[WorkerEvent]) -> None:
        for e in events:
            self.events.setdefault(e.request_id, []).append(e)


def make(fake: FakeConfig | None = None, config: SchedulerConfig | None = None) -> Run:
    backend = FakeStepBackend(fake or FakeConfig())
    return Run(Scheduler(backend.capability(), config, seed=1234), backend)


def request(
    rid: str,
    prompt: list[int],
    max_tokens: int = 8,
    seed: int | None = 7,
    ignore_eos: bool = True,
    min_tokens: int = 0,
    stop_token_ids: list[int] | None = None,
) -> GenerateRequest:
    sampling = SamplingParams(
        max_tokens=max_tokens,
        seed=seed,
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        stop_token_ids=stop_token_ids or [],
    )
    return GenerateRequest(rid, list(prompt), sampling)


def drive(
    run: Run,
    max_inflight: int = 2,
    max_steps: int = 10_000,
    on_step: Callable[[Run], bool | None] | None = None,
) -> Run:
    """Run until no request is left; checks integrity and the fake worker's checks after every step.

    ``on_step`` runs before every step; one that adds requests returns True while it may add more.
    """
    s, backend = run.scheduler, run.backend
    inflight: deque[DecodeStep] = deque()
    feeding = False
    for _ in range(max_steps):
        if on_step is not None:
            feeding = bool(on_step(run))
        while len(inflight) < max_inflight:
            step = s.schedule()
            run.record(s.take_events())
            if step is None:
                break
            assert step.num_scheduled_tokens <= s.max_batch_tokens
            plan = s.last_plan
            assert plan is not None and step.num_scheduled_tokens <= plan.token_budget  # its own budget
            assert plan.token_budget in (
                s.max_batch_tokens,
                s.max_batch_tokens_with_decodes,
                s.max_batch_tokens_in_burst,
            )
            run.steps.append(step)
            inflight.append(step)
        if not inflight:
            if not s.requests and not feeding:
                return run
            continue
        step = inflight.popleft()
        run.record(s.update(step, backend.execute(step)))
        s.check_integrity()
        assert not backend.violations, backend.violations
    raise AssertionError(f"not finished after {max_steps} steps: {len(s.requests)} requests left")


def finished_ok(run: Run, request_id: str) -> bool:
    end = run.terminal(request_id)
    return isinstance(end, Done) and not isinstance(end, Error)
