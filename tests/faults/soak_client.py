"""An asyncio gRPC client that fires many short requests with random client aborts and disconnects."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import grpc.aio

from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc

# Rolled per request; a stream that ends before its cut point completes normally, so the share of requests
# really cut short is a little lower (about 21%).
ABORT_SHARE = 0.125  # Abort RPC after a few events
DISCONNECT_SHARE = 0.125  # the client cancels its call (goes away) after a few events, or at once
CALL_TIMEOUT_S = 30.0  # a request still open after this is stuck


@dataclass
class SoakTally:
    sent: int = 0
    completed: int = 0  # Done(stop/length)
    aborted: int = 0  # Done(abort) after an Abort RPC
    disconnected: int = 0  # the client cancelled its own call
    errors: int = 0  # one Error event (e.g. a deadline)
    rejected: int = 0  # the RPC was refused at admission (RESOURCE_EXHAUSTED)
    stuck: int = 0  # no terminal event within CALL_TIMEOUT_S
    bad: int = 0  # zero or several terminal events, or an unexpected RPC failure
    bad_examples: list[str] | None = None

    def note_bad(self, what: str) -> None:
        self.bad += 1
        self.bad_examples = (self.bad_examples or [])[:9] + [what]

    @property
    def client_aborts(self) -> int:
        return self.aborted + self.disconnected


async def _one(
    stub: engine_pb2_grpc.EngineStub, i: int, rng: random.Random, tally: SoakTally, prefix: str
) -> None:
    rid = f"{prefix}-{i}"
    roll = rng.random()
    mode = (
        "abort" if roll < ABORT_SHARE else "disconnect" if roll < ABORT_SHARE + DISCONNECT_SHARE else "normal"
    )
    cut_after = rng.randint(0, 3)
    req = engine_pb2.GenerateRequest(
        request_id=rid,
        input_ids=engine_pb2.TokenIds(ids=[rng.randint(3, 250) for _ in range(rng.randint(2, 40))]),
        sampling=common_pb2.SamplingParams(
            max_tokens=rng.randint(1, 12), temperature=1.0, seed=i, ignore_eos=rng.random() < 0.5
        ),
        deadline_ms=rng.choice([0, 0, 0, 20_000]),
    )
    tally.sent += 1
    call = stub.Generate(req, timeout=CALL_TIMEOUT_S)
    terminals = 0
    events = 0
    last: engine_pb2.GenerateEvent | None = None
    try:
        async for ev in call:
            events += 1
            if ev.WhichOneof("event") in ("done", "error"):
                terminals += 1
                last = ev
            if events == cut_after + 1 and terminals == 0:
                if mode == "abort":
                    await stub.Abort(engine_pb2.AbortRequest(request_id=rid), timeout=10)
                elif mode == "disconnect":
                    call.cancel()
                    tally.disconnected += 1
                    return
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.CANCELLED and mode == "disconnect":
            tally.disconnected += 1
        elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            tally.rejected += 1
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            tally.stuck += 1
        else:
            tally.note_bad(f"{rid}: {code.name} {exc.details()}")
        return
    except asyncio.CancelledError:
        if mode == "disconnect":
            tally.disconnected += 1
            return
        raise
    if terminals != 1 or last is None:
        tally.note_bad(f"{rid}: {terminals} terminal events")
    elif last.WhichOneof("event") == "error":
        tally.errors += 1
    elif last.done.finish_reason == common_pb2.FINISH_REASON_ABORT:
        tally.aborted += 1
    else:
        tally.completed += 1


async def run_soak(
    address: str,
    num_requests: int,
    concurrency: int,
    seed: int = 0,
    prefix: str = "soak",
    on_progress: Callable[[int], None] | None = None,
) -> SoakTally:
    """Send ``num_requests`` with at most ``concurrency`` open at once; ``on_progress(done)`` after each."""
    rng = random.Random(seed)
    tally = SoakTally()
    sem = asyncio.Semaphore(concurrency)
    done = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)

        async def guarded(i: int) -> None:
            nonlocal done
            async with sem:
                await _one(stub, i, rng, tally, prefix)
            done += 1
            if on_progress is not None:
                on_progress(done)

        await asyncio.gather(*(guarded(i) for i in range(num_requests)))
    return tally
