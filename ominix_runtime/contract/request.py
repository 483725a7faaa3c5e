"""What the engine is asked to do."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum

from ominix_runtime.contract.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat turn as the client sent it (rendered through the model's chat template at the front edge)."""

    role: str
    content: str


class Priority(IntEnum):
    """Lower value = scheduled first, preempted last. Values match ``ominix.runtime.v1.Priority``."""

    REALTIME = 1
    INTERACTIVE = 2
    BATCH = 3


@dataclass(slots=True)
class GenerateRequest:
    """A tokenized request as the scheduler sees it (text and chat are resolved at the front edge)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    model: str = ""
    priority: Priority = Priority.INTERACTIVE
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # monotonic seconds; None: no deadline
    stream: bool = True
    prompt_text: str | None = None  # kept for request-level backends that take text
    chat_messages: tuple[ChatMessage, ...] = ()  # the chat turns, until the front edge renders them
    traceparent: str = ""  # W3C trace context to carry to the backend ("" when not traced)
    owner: str = ""  # digest of the creating caller's API key ("" without keys): Abort from another key fails
