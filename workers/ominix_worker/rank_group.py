"""The two sides of a tensor-parallel worker group: the leader (rank 0) and its followers.

The leader serves the engine over gRPC like a single worker. Each step it receives is forwarded to the
followers on the group's gloo control group (``StepSender``: one all-reduce of a two-integer header, then
one broadcast of the encoded step, ``encode_step``) as soon as it arrives, while the previous step still computes; every
rank then runs the same step on its shards, the model's collectives meet on the compute group, and every
rank samples the same tokens from the gathered logits. Only the leader's results leave the group.

Liveness: while no step is due the leader sends a tick every ``TICK_S``; both sides wait at most the
group's timeout for each control message. A rank that dies, hangs or fails a step ends its own process
(``fail_group``), which the others notice at their next control message or collective: the whole group
exits, the engine sees the leader's stream break, and ``launch`` restarts the group. Never a half-alive group.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import fields
from datetime import timedelta
from enum import IntEnum
from typing import NoReturn

import torch
import torch.distributed as dist

from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData, StepResult
from ominix_worker.parallel.distributed import RankGroup
from ominix_worker.runner import ModelRunner

log = logging.getLogger(__name__)

TICK_S = 1.0
# A rank that leaves its group exits with this code (launch restarts the whole group).
GROUP_FAILURE_EXIT_CODE = 3


class Message(IntEnum):
    TICK = 0  # proof of life, nothing to do
    STEP = 1  # payload: an encoded DecodeStep
    RESET = 2  # the engine's stream ended: drop every request


_NEW_FIELDS = tuple(f.name for f in fields(NewRequestData))


def encode_step(step: DecodeStep) -> bytes:
    """A step as plain lists for pickle: a decode step of 256 requests pickles in a tenth of the time its
    dataclasses take (the ranks trust each other: they are one deployment)."""
    running = step.running_requests
    plain = (
        step.step_id,
        [tuple(getattr(n, name) for name in _NEW_FIELDS) for n in step.new_requests],
        [r.request_id for r in running],
        [r.new_kv_block_ids for r in running],
        [r.num_scheduled_tokens for r in running],
        [r.new_group_kv_block_ids for r in running],  # KV groups 1.. of a hybrid layout
        step.finished_request_ids,
    )
    return pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL)


def decode_step(payload: bytes) -> DecodeStep:
    step_id, news, ids, blocks, nums, group_blocks, finished = pickle.loads(payload)
    return DecodeStep(
        step_id,
        new_requests=[NewRequestData(*values) for values in news],
        running_requests=[RunningRequestData(*r) for r in zip(ids, blocks, nums, group_blocks, strict=True)],
        finished_request_ids=finished,
    )


def fail_group(rank: int, reason: str) -> NoReturn:
    """Leave the group for good: the process exits so no rank keeps serving with a missing peer."""
    log.critical("tensor-parallel rank %d leaves its group: %s", rank, reason)
    print(f"ominix-worker: rank {rank} leaves its group: {reason}", file=sys.stderr, flush=True)
    os._exit(GROUP_FAILURE_EXIT_CODE)


def _wait(work: dist.Work | None, timeout_s: float) -> None:
    assert work is not None
    work.wait(timeout=timedelta(seconds=timeout_s))


class StepSender:
    """Leader side of the control group: forwards messages in order from its own thread; ticks when idle."""

    def __init__(self, group: RankGroup, tick_s: float = TICK_S) -> None:
        self._group = group
        self._tick_s = tick_s
        self._queue: queue.SimpleQueue[tuple[Message, DecodeStep | None]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ominix-tp-sender", daemon=True)
        self._thread.start()

    def send(self, kind: Message, step: DecodeStep | None = None) -> None:
        self._queue.put((kind, step))

    def _run(self) -> None:
        try:
            while True:
                try:
                    kind, step = self._queue.get(timeout=self._tick_s)
                except queue.Empty:
                    kind, step = Message.TICK, None
                self._transmit(kind, encode_step(step) if step is not None else b"")
        except Exception as exc:  # noqa: BLE001 - any failure here means a peer is gone or stuck
            fail_group(self._group.rank, f"a peer stopped answering ({type(exc).__name__}: {exc})")

    def _transmit(self, kind: Message, payload: bytes) -> None:
        group, timeout = self._group, self._group.timeout_s
        header = torch.tensor([int(kind), len(payload)], dtype=torch.int64)
        _wait(dist.all_reduce(header, group=group.control, async_op=True), timeout)
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            _wait(dist.broadcast(data, src=0, group=group.control, async_op=True), timeout)


def receive(group: RankGroup) -> tuple[Message, DecodeStep | None]:
    """Follower side: the leader's next message (raises when the leader is gone or silent too long)."""
    timeout = group.timeout_s
    header = torch.zeros(2, dtype=torch.int64)
    _wait(dist.all_reduce(header, group=group.control, async_op=True), timeout)
    kind, size = Message(int(header[0])), int(header[1])
    if size == 0:
        return kind, None
    data = torch.empty(size, dtype=torch.uint8)
    _wait(dist.broadcast(data, src=0, group=group.control, async_op=True), timeout)
    return kind, decode_step(data.numpy().tobytes())


class GroupLeader:
    """The leader's step runner (``step_loop.StepRunner``): its own shards' runner plus the step hand-off.

    Steps are forwarded when they arrive (``announce``) and run here when the step loop reaches them; the
    followers run every forwarded step in the same order. A step that fails on the leader leaves the ranks
    out of step with each other, so it ends the group rather than the step.
    """

    def __init__(self, runner: ModelRunner, group: RankGroup, sender: StepSender | None = None) -> None:
        self.runner = runner
        self.group = group
        self.sender = sender or StepSender(group)

    @property
    def overlap_steps(self) -> bool:
        return self.runner.overlap_steps

    @overlap_steps.setter
    def overlap_steps(self, value: bool) -> None:
        self.runner.overlap_steps = value

    @property
    def post_result(self) -> Callable[[StepResult], None] | None:
        return self.runner.post_result

    @post_result.setter
    def post_result(self, value: Callable[[StepResult], None] | None) -> None:
        self.runner.post_result = value

    def can_overlap(self) -> bool:
        return self.runner.can_overlap()

    def announce(self, step: DecodeStep) -> None:
        self.sender.send(Message.STEP, step)

    def execute_step(self, step: DecodeStep) -> StepResult | None:
        try:
            return self.runner.execute_step(step)
        except Exception as exc:  # noqa: BLE001 - the ranks no longer agree on their state
            log.error("step %d failed on the leader:\n%s", step.step_id, traceback.format_exc())
            fail_group(self.group.rank, f"step {step.step_id} failed: {type(exc).__name__}: {exc}")

    def has_pending(self) -> bool:
        return self.runner.has_pending()

    def pending_ready(self) -> bool:
        return self.runner.pending_ready()

    def finish_pending(self) -> None:
        self.runner.finish_pending()

    def reset_pending(self) -> None:
        self.runner.reset_pending()

    def take_results(self) -> list[StepResult]:
        return self.runner.take_results()

    def reset(self) -> None:
        self.sender.send(Message.RESET)
        self.runner.reset()


def run_follower(runner: ModelRunner, group: RankGroup) -> NoReturn:
    """A follower's life after loading: run the leader's steps in order until the group ends."""
    inbox: queue.SimpleQueue[tuple[Message, DecodeStep | None]] = queue.SimpleQueue()

    def receive_forever() -> None:
        try:
            while True:
                kind, item = receive(group)
                if kind != Message.TICK:
                    inbox.put((kind, item))
        except Exception as exc:  # noqa: BLE001 - the leader is gone or stuck
            fail_group(group.rank, f"the leader stopped answering ({type(exc).__name__}: {exc})")

    threading.Thread(target=receive_forever, name="ominix-tp-receiver", daemon=True).start()
    runner.overlap_steps = runner.can_overlap()
    while True:
        kind, item = inbox.get()
        if kind == Message.RESET:
            runner.reset()
            continue
        assert isinstance(item, DecodeStep)
        try:
            runner.execute_step(item)
            runner.take_results()  # only the leader's results leave the group
        except Exception as exc:  # noqa: BLE001 - out of step with the leader
            log.error("step %d failed:\n%s", item.step_id, traceback.format_exc())
            fail_group(group.rank, f"step {item.step_id} failed: {type(exc).__name__}: {exc}")
