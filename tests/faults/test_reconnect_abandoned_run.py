"""A reconnect whose Run the worker answers only after the engine stopped waiting for it (the reconnect's own
timeout) must leave no Run call behind: the worker would accept that abandoned call, hold its one Run slot
for a reader nobody reads, and refuse every later Run, so the group would never come back although the
worker is healthy.

Engine and worker are the real classes (StepWorkerGroup._reconnect, GrpcWorkerBackend, the worker's
WorkerService over an idle runner); the one fault is a worker paused for 5 s right after it answered
Describe (SIGSTOP, a cgroup freeze, an event-loop stall). Timeouts are the defaults scaled from 10 s to 3 s,
keeping the accept timeout equal to reconnect_rpc_timeout as the defaults do."""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import grpc.aio

from ominix_runtime.backends.grpc_worker import GrpcWorkerBackend
from ominix_runtime.bind_probe import free_port
from ominix_runtime.contract import FAKE_PROFILE, DecodeStep, ModelInfo, StepResult
from ominix_runtime.engine.config import EngineCoreConfig
from ominix_runtime.engine.groups.step_group import StepWorkerGroup
from ominix_runtime.engine.groups.worker_group import GroupHooks
from ominix_runtime.pb import worker_pb2_grpc
from ominix_worker.server import WorkerService, WorkerState

CAPABILITY = dataclasses.replace(
    FAKE_PROFILE, model=ModelInfo(name="m", vocab_size=100, max_model_len=64, eos_token_ids=(2,))
)


class IdleRunner:
    overlap_steps = False
    post_result = None

    def can_overlap(self) -> bool:
        return False

    def announce(self, step: DecodeStep) -> None:
        pass

    def execute_step(self, step: DecodeStep) -> StepResult:
        return StepResult(step.step_id)

    def has_pending(self) -> bool:
        return False

    def pending_ready(self) -> bool:
        return True

    def finish_pending(self) -> None:
        pass

    def reset_pending(self) -> None:
        pass

    def take_results(self) -> list[StepResult]:
        return []

    def reset(self) -> None:
        pass


class PausedOnce(WorkerService):
    """The real servicer in a process that pauses for ``pause`` seconds right after its first Describe
    answered (SIGSTOP, a cgroup freeze, a VM or event-loop stall): every call that arrives meanwhile is
    served when it resumes, in arrival order."""

    def __init__(self, *args, pause: float, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.pause = pause
        self.paused_until = 0.0
        self.runs = 0

    async def _stalled(self) -> None:
        delay = self.paused_until - asyncio.get_running_loop().time()
        if delay > 0:
            await asyncio.sleep(delay)

    async def Describe(self, request, context):  # noqa: ANN001, ANN201
        await self._stalled()
        answer = await super().Describe(request, context)
        if self.pause:
            self.paused_until, self.pause = asyncio.get_running_loop().time() + self.pause, 0.0
        return answer

    async def Run(self, request_iterator, context):  # noqa: ANN001, ANN201
        self.runs += 1
        await self._stalled()
        async for message in super().Run(request_iterator, context):
            yield message


def test_a_late_answered_reconnect_does_not_wedge_the_worker() -> None:
    async def run() -> None:
        state = WorkerState(capability=CAPABILITY, step_runner=IdleRunner(), ready=True)  # type: ignore[arg-type]
        executor = ThreadPoolExecutor(max_workers=1)
        service = PausedOnce(state, executor, pause=5.0)
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
        port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
        await server.start()
        backend = GrpcWorkerBackend(f"127.0.0.1:{port}", rpc_timeout=3.0, heartbeat_timeout=3.0)
        config = EngineCoreConfig(
            reconnect_rpc_timeout=3.0, reconnect_backoff_initial=0.1, reconnect_backoff_max=0.5
        )
        hooks = GroupHooks(
            deliver=lambda e: None,
            report=lambda r: None,
            step_report=lambda w, r: None,
            evacuate=lambda g, reqs: reqs,
        )
        group = StepWorkerGroup(backend, CAPABILITY, config, hooks)
        try:
            try:
                stream = await asyncio.wait_for(group._reconnect(), 20)  # noqa: SLF001
            except asyncio.TimeoutError:
                raise AssertionError(
                    f"no reconnect within 20 s: the worker saw {service.runs} Run calls and still holds "
                    f"one (run_active={state.run_active}) that the engine abandoned"
                ) from None
            await stream.close()
        finally:
            await backend.close()
            await server.stop(0)
            executor.shutdown(wait=False)

    asyncio.run(run())
