"""The Worker service's Run call in this process (loopback gRPC), driving a scripted runner instead of a model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from ominix_runtime import wire
from ominix_runtime.bind_probe import free_port
from ominix_runtime.contract import DecodeStep, StepResult
from ominix_runtime.pb import worker_pb2, worker_pb2_grpc
from ominix_worker.server import WorkerService, WorkerState

from .test_step_loop import ScriptedRunner

CALL_TIMEOUT_S = 10.0


class LoopBreakingRunner(ScriptedRunner):
    """Answers its steps, then breaks the step loop itself: handing over queued results raises (a fault outside
    any step, which the loop does not turn into a step failure)."""

    def take_results(self) -> list[StepResult]:
        raise RuntimeError("results lost")


async def run_until_the_call_ends(runner: ScriptedRunner) -> tuple[list[str], grpc.StatusCode, str]:
    """Serve Run over ``runner``, send step 1 and keep the request stream open (an engine that keeps going);
    returns the kinds of the messages that came back and how the call ended."""
    port = free_port()
    executor = ThreadPoolExecutor(max_workers=1)
    state = WorkerState(step_runner=runner, ready=True)
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerService(state, executor), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    held_open = asyncio.Event()

    async def steps() -> AsyncIterator[worker_pb2.DecodeStep]:
        yield wire.step_to_pb(DecodeStep(1))
        await held_open.wait()

    kinds: list[str] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = worker_pb2_grpc.WorkerStub(channel).Run(steps(), timeout=CALL_TIMEOUT_S)
            try:
                async for message in call:
                    kinds.append(message.WhichOneof("kind"))
            except grpc.aio.AioRpcError:
                pass  # the code and details are read below
            return kinds, await call.code(), await call.details()
    finally:
        held_open.set()
        await server.stop(None)
        executor.shutdown(wait=True)


def test_run_ends_with_an_error_when_the_step_loop_ends_on_its_own() -> None:
    """A step loop that ends while the engine's request stream is still open (here: it fails outside a step)
    ends the Run call at once with INTERNAL and the loop's failure, instead of leaving the engine on a call that
    neither answers its steps nor sends heartbeats until its deadline."""
    runner = LoopBreakingRunner()
    kinds, code, details = asyncio.run(run_until_the_call_ends(runner))
    assert runner.executed == [1]
    assert code == grpc.StatusCode.INTERNAL, (code, details)
    assert details == "the worker's step loop ended: RuntimeError: results lost"
    assert kinds == ["heartbeat", "step_result"]  # the acceptance, step 1 (answered before the loop broke)
    assert runner.resets == 1  # the stream's state was dropped
