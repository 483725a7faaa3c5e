"""How fast a bare grpc.aio server takes in a burst of streaming calls: the floor under the engine's intake.

W1 sends its 256 requests at once; the engine's handlers see them over tens of milliseconds. This measures the
same burst against a server that does nothing (an ``Engine`` servicer whose ``Generate`` answers one empty
event), in another process, over the same channel setup as bench/serve.py (several channels, each its own
connection): when the first and the last handler were entered, relative to the client's start. Both sides run
uvloop, as the engine and the bench client do. Nothing here imports torch.

    python bench/grpc_intake.py [--calls 256] [--channels 4] [--trials 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import grpc
import grpc.aio

from bench.common import free_port
from ominix_runtime.pb import engine_pb2, engine_pb2_grpc


class _Empty(engine_pb2_grpc.EngineServicer):
    """Records when each Generate call's handler was entered and answers one empty event."""

    def __init__(self) -> None:
        self.entered: list[float] = []

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:  # noqa: ANN401
        self.entered.append(time.perf_counter())
        yield engine_pb2.GenerateEvent()


async def _serve(port: int, calls: int, queue: Any) -> None:  # noqa: ANN401 - a multiprocessing queue
    server = grpc.aio.server()
    servicer = _Empty()
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    queue.put("serving")
    while len(servicer.entered) < calls:
        await asyncio.sleep(0.01)
    queue.put((min(servicer.entered), max(servicer.entered)))
    await server.stop(0)


def _server_process(port: int, calls: int, queue: Any) -> None:  # noqa: ANN401 - a multiprocessing queue
    import uvloop

    uvloop.run(_serve(port, calls, queue))


async def _burst(port: int, calls: int, channels: int) -> float:
    """Opens the channels, then starts every call at once; returns perf_counter at the start."""
    options = [("grpc.use_local_subchannel_pool", 1)]  # one connection per channel, as bench/serve.py
    opened = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(channels)]
    try:
        for channel in opened:
            await channel.channel_ready()
        stubs = [engine_pb2_grpc.EngineStub(channel) for channel in opened]

        async def one(i: int) -> None:
            async for _ in stubs[i % channels].Generate(engine_pb2.GenerateRequest(request_id=f"burst-{i}")):
                pass

        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(calls)))
        return started
    finally:
        for channel in opened:
            await channel.close()


def run_trial(calls: int, channels: int) -> tuple[float, float]:
    """(first, last) handler entry in ms after the client started the burst."""
    import uvloop

    port = free_port()
    queue: Any = multiprocessing.get_context("spawn").Queue()
    server = multiprocessing.get_context("spawn").Process(target=_server_process, args=(port, calls, queue))
    server.start()
    try:
        if queue.get(timeout=60) != "serving":
            raise RuntimeError("the server did not start")
        started = uvloop.run(_burst(port, calls, channels))
        first, last = queue.get(timeout=60)
    finally:
        server.join(10)
        if server.is_alive():
            server.kill()
    return (first - started) * 1e3, (last - started) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=256, help="calls in the burst (W1: 256)")
    parser.add_argument("--channels", type=int, default=4, help="client channels (bench/serve.py: 4)")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args(argv)
    spans = []
    for trial in range(args.trials):
        first, last = run_trial(args.calls, args.channels)
        spans.append(last - first)
        print(f"trial {trial}: handlers entered {first:.1f} .. {last:.1f} ms after the burst started")
    print(
        f"{args.calls} calls over {args.channels} channels: handlers entered over {statistics.median(spans):.1f} "
        f"ms (median of {args.trials}), {statistics.median(spans) / max(1, args.calls - 1) * 1e3:.0f} µs a call"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
