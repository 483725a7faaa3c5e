"""How the engine talks to a backend.

Step-level backends (torch workers, the fake backend) receive DecodeSteps and return StepResults; the
engine owns batching and KV. Request-level backends (SGLang) receive whole requests and stream events;
the backend owns batching and KV, the engine keeps admission, priority, streams, metrics and reports.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from ominix_runtime.contract.capability import BackendCapability
from ominix_runtime.contract.events import WorkerEvent
from ominix_runtime.contract.request import GenerateRequest
from ominix_runtime.contract.step import DecodeStep, StepResult


@runtime_checkable
class StepStream(Protocol):
    """One ordered session with a step-level backend. Results come back in step_id order."""

    async def send(self, step: DecodeStep) -> None: ...

    async def recv(self) -> StepResult:
        """Next result; raises OminixError(BACKEND_UNAVAILABLE) when the backend is gone or hung."""
        ...

    def recv_nowait(self) -> StepResult | None:
        """The next result if it is already here, else None (never waits); raises as ``recv`` does."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class StepBackend(Protocol):
    async def describe(self) -> BackendCapability: ...

    async def open(self) -> StepStream: ...

    async def health(self) -> bool: ...

    async def close(self) -> None: ...


@runtime_checkable
class RequestBackend(Protocol):
    async def describe(self) -> BackendCapability: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[WorkerEvent]:
        """Events for one request, ending with exactly one Done or Error."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def load(self) -> dict[str, float]:
        """Backend-reported load (queued/running requests, token usage) for routing and GetLoad."""
        ...

    async def health(self) -> bool: ...

    async def close(self) -> None: ...


BackendAdapter = StepBackend | RequestBackend
