"""A worker's per-request error with an ErrorCode this engine does not know (a newer worker) ends that one
request with an INTERNAL error naming the code; the Run stream, the group and its other requests carry on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc.aio

from ominix_runtime import wire
from ominix_runtime.backends.grpc_worker import GrpcWorkerBackend
from ominix_runtime.bind_probe import free_port
from ominix_runtime.contract import (
    Done,
    Error,
    GenerateRequest,
    RuntimeErrorKind,
    SamplingParams,
    Token,
    WorkerEvent,
    is_terminal,
)
from ominix_runtime.engine.config import EngineCoreConfig
from ominix_runtime.engine.core import EngineCore, RequestHandle
from ominix_runtime.pb import worker_pb2, worker_pb2_grpc
from ominix_runtime.testing.fake_backend import FakeConfig, FakeStepBackend

NEW_ERROR_CODE = 99  # proto3 enums are open: a valid value on the wire, unknown to this engine
NEW_ERROR_MESSAGE = "a kind of failure this engine has no name for"


class NewerWorker(worker_pb2_grpc.WorkerServicer):
    """The fake step backend behind the real Worker service; request ``victim`` fails with NEW_ERROR_CODE
    at its first sampled token."""

    def __init__(self) -> None:
        self.fake = FakeStepBackend(FakeConfig())

    async def Describe(self, request, context):  # noqa: ANN001, ANN201
        return wire.capability_to_pb(await self.fake.describe())

    async def Health(self, request, context):  # noqa: ANN001, ANN201
        return worker_pb2.HealthResponse(ready=True)

    async def Run(self, request_iterator, context) -> AsyncIterator[worker_pb2.WorkerMessage]:  # noqa: ANN001
        yield worker_pb2.WorkerMessage(heartbeat=worker_pb2.Heartbeat(worker_time=0.0))
        async for step_pb in request_iterator:
            pb = wire.step_result_to_pb(self.fake.execute(wire.step_from_pb(step_pb)))
            for out in pb.outputs:
                if out.request_id == "victim" and out.HasField("sampled_token_id"):
                    out.ClearField("sampled_token_id")
                    out.error.code = NEW_ERROR_CODE  # type: ignore[assignment]
                    out.error.message = NEW_ERROR_MESSAGE
            yield worker_pb2.WorkerMessage(step_result=pb)


async def _collect(handle: RequestHandle) -> list[WorkerEvent]:
    return [e async for e in handle]


def test_unknown_error_code_fails_one_request_not_the_group() -> None:
    """The victim gets one INTERNAL error with the worker's message and code; the bystander finishes all its
    tokens and the group records no failure."""

    async def main() -> tuple[list[WorkerEvent], list[WorkerEvent], int]:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(NewerWorker(), server)
        port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
        await server.start()
        core = EngineCore(
            [GrpcWorkerBackend(f"127.0.0.1:{port}", step_timeout=5, heartbeat_timeout=30)],
            EngineCoreConfig(reconnect=False),
        )
        await core.start()
        try:
            sp = SamplingParams(max_tokens=8, ignore_eos=True)
            bystander = core.submit(GenerateRequest("bystander", [5, 6, 7], sp))
            victim = core.submit(GenerateRequest("victim", [5, 6, 8], sp))
            b_events, v_events = await asyncio.gather(_collect(bystander), _collect(victim))
            return b_events, v_events, core.groups[0].num_failures
        finally:
            await core.stop()
            await server.stop(0)

    b_events, v_events, num_failures = asyncio.run(asyncio.wait_for(main(), 20))
    assert sum(is_terminal(e) for e in v_events) == 1
    error = v_events[-1]
    assert isinstance(error, Error) and error.kind == RuntimeErrorKind.INTERNAL
    assert NEW_ERROR_MESSAGE in error.message and str(NEW_ERROR_CODE) in error.message
    assert sum(is_terminal(e) for e in b_events) == 1
    assert isinstance(b_events[-1], Done), b_events[-1]
    assert sum(len(e.token_ids) for e in b_events if isinstance(e, Token)) == 8
    assert num_failures == 0
