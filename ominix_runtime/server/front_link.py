"""The link between the engine process and its front processes (``--front-procs``): messages and framing.

A front process serves clients' Generate streams; the engine process owns the engine core. They talk over
one Unix socket per front, in a directory only this user can enter. A frame is a 4-byte big-endian length
and a pickled list of messages: each side sends what one turn of its event loop produced as one frame, so
the engine pays one write per front per step instead of one stream message per request and token. Both ends
are this package at the same version, started by the same user; nothing else may connect.

Admin calls (GetLoad, GetStats, ListBackends, Drain, Abort of another front's request) do not use the link:
a front forwards them over gRPC to the engine process's own server on ``Hello.engine_address``. A request that
waits for its tokenizer before it is submitted is announced (Resolving) so that such an Abort finds it.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from dataclasses import dataclass
from typing import Any

from ominix_runtime.contract import (
    BackendCapability,
    FinishReason,
    GenerateRequest,
    RuntimeErrorKind,
    WorkerEvent,
)

_LENGTH = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 30  # a frame of one prompt of max_message_bytes and the batched events fits


# ---- front → engine ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Bound:
    """Front ``index`` listens on ``port`` (the first front picks it when the configured port is 0)."""

    index: int
    port: int


@dataclass(frozen=True, slots=True)
class Submit:
    """Admit ``request`` (resolved and validated by the front; ``request.owner`` names its caller)."""

    request: GenerateRequest


@dataclass(frozen=True, slots=True)
class Resolving:
    """A request of this front waits for its prompt to be tokenized before its Submit: an Abort that reaches
    another front (and through it the engine process) must find it meanwhile. ``owner`` is its caller."""

    request_id: str
    owner: str


@dataclass(frozen=True, slots=True)
class Resolved:
    """The request of a Resolving no longer waits: its Submit follows in the same frame, or it was refused or
    its client went away."""

    request_id: str


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """The client of a request on this front went away: abort it (frees its KV)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class FinishRequest:
    """The front matched a stop string: finish the request with ``reason``."""

    request_id: str
    reason: FinishReason
    matched_stop: str


@dataclass(frozen=True, slots=True)
class SettleRequest:
    """The front's verdict on a request with stop strings that the engine ended on its length: ``matched_stop``
    when its last tokens completed one, else "" (EngineCore.settle)."""

    request_id: str
    matched_stop: str


@dataclass(frozen=True, slots=True)
class FrontRefusal:
    """The front refused a request before it reached the engine (counted in GetStats and the metrics)."""

    message: str
    reason: str
    model: str = ""  # the model label of the refusal ("" for the engine's own model)


# ---- engine → front ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """First message to a front: what it serves and where the engine process answers admin calls."""

    model_name: str
    engine_address: str
    ready: bool
    capabilities: tuple[BackendCapability, ...]


@dataclass(frozen=True, slots=True)
class Readiness:
    """The engine's ``ready`` changed (or its backends' capabilities did)."""

    ready: bool
    capabilities: tuple[BackendCapability, ...]


@dataclass(frozen=True, slots=True)
class Admitted:
    """The engine took the request; its events follow."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Refused:
    """The engine refused the request; ``duplicate``: its id is live (on this or another front)."""

    request_id: str
    kind: RuntimeErrorKind
    message: str
    duplicate: bool


@dataclass(frozen=True, slots=True)
class AbortResolving:
    """An Abort came (through another front) for a request of this front still Resolving: abort it, as an
    Abort this front took itself would."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Events:
    """Events of this front's requests, in the engine's order (each names its request)."""

    events: list[WorkerEvent]


@dataclass(frozen=True, slots=True)
class StopServing:
    """The engine is stopping: finish the streams still open (their terminal events have been sent) and exit."""


def encode(messages: list[Any]) -> bytes:
    body = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> list[Any] | None:
    """The next frame's messages; None when the other side closed the link."""
    try:
        head = await reader.readexactly(_LENGTH.size)
        (length,) = _LENGTH.unpack(head)
        if length > MAX_FRAME_BYTES:
            raise ValueError(f"front link frame of {length} bytes")
        messages = pickle.loads(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    if not isinstance(messages, list):
        raise ValueError("front link frame is not a list of messages")
    return messages


class FrameWriter:
    """Queues messages and writes everything queued in one turn of the event loop as one frame."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._queued: list[Any] = []
        self._flush_pending = False

    def send(self, message: Any) -> None:
        if self._writer.is_closing():
            return
        self._queued.append(message)
        if not self._flush_pending:
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush)

    def send_event(self, event: WorkerEvent) -> None:
        """Queue ``event``: the events of one turn go in one Events message, in order with the others."""
        last = self._queued[-1] if self._queued else None
        if isinstance(last, Events):
            last.events.append(event)
        else:
            self.send(Events([event]))

    def flush(self) -> None:
        """Write what is queued now, not at the end of this turn of the event loop."""
        self._flush()

    def _flush(self) -> None:
        self._flush_pending = False
        messages, self._queued = self._queued, []
        if messages and not self._writer.is_closing():
            self._writer.write(encode(messages))

    async def drain(self) -> None:
        """Write what is queued now and wait for the socket to take it."""
        self._flush()
        if not self._writer.is_closing():
            await self._writer.drain()

    def close(self) -> None:
        self._flush()
        self._writer.close()
