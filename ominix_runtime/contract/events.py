"""Per-request events, in order: PrefillDone, Token..., Usage, then exactly one Done or Error."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeGuard

from ominix_runtime.contract.errors import RuntimeErrorKind
from ominix_runtime.contract.state import FinishReason
from ominix_runtime.contract.step import SampledLogprobs


@dataclass(slots=True)
class PrefillDone:
    request_id: str
    prompt_tokens: int
    cached_tokens: int = 0


@dataclass(slots=True)
class Token:
    request_id: str
    token_ids: list[int]
    logprobs: list[SampledLogprobs] = field(default_factory=list)
    text: str = ""  # filled by the engine's detokenizer (request-level backends may fill it themselves)
    # The last of token_ids is a stop token (a stop_token_ids entry or an eos) that ended the request: it
    # counts as an output token
    # (token ids, usage) but its text is not output, as a matched stop string's is not. The engine's scheduler
    # sets it; a request-level backend that sends its own text leaves the token's text out itself.
    ended_by_stop_token: bool = False


@dataclass(slots=True)
class Usage:
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(slots=True)
class Done:
    request_id: str
    finish_reason: FinishReason
    text: str = ""
    matched_stop: str = ""


@dataclass(slots=True)
class Error:
    request_id: str
    kind: RuntimeErrorKind
    message: str


WorkerEvent = PrefillDone | Token | Usage | Done | Error
TERMINAL_EVENT_TYPES = (Done, Error)


def is_terminal(event: WorkerEvent) -> TypeGuard[Done | Error]:
    return isinstance(event, TERMINAL_EVENT_TYPES)
