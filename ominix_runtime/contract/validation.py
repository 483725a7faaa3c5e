"""The one request validator. Every entry point calls :func:`validate_request` with the limits it knows.

The front edge calls it twice: before tokenization, with the text still raw, where only cheap checks apply
(request id, characters per prompt and per message against what the model's context could ever hold), and
after, with the token ids. Worker groups call it again with what only they know (their KV capacity).
"""

from __future__ import annotations

from dataclasses import dataclass

from ominix_runtime.contract.errors import InvalidArgument, OminixError, RuntimeErrorKind
from ominix_runtime.contract.request import GenerateRequest

MAX_REQUEST_ID_BYTES = 256
# Characters one token can stand for when no tokenizer says better (text for a request-level backend).
DEFAULT_MAX_CHARS_PER_TOKEN = 64
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one entry point knows about where a request will run; None: not known there."""

    vocab_size: int | None = None
    max_model_len: int | None = None
    # The longest text one token of the model's vocabulary stands for: a prompt longer than
    # max_model_len x this cannot fit, whatever it tokenizes to.
    max_chars_per_token: int = DEFAULT_MAX_CHARS_PER_TOKEN
    kv_capacity_tokens: int | None = None  # the worker group's KV cache in tokens
    holder: str = ""  # who holds that KV (named in the error)
    needs_token_ids: bool = False  # True where the prompt must already be tokens

    @property
    def max_prompt_chars(self) -> int | None:
        if self.max_model_len is None:
            return None
        return self.max_model_len * max(1, self.max_chars_per_token)


def validate_request_id(request_id: str) -> None:
    """At most 256 bytes of printable ASCII: ids are repeated in every event and log line."""
    if len(request_id) > MAX_REQUEST_ID_BYTES:
        raise InvalidArgument(f"request_id is longer than {MAX_REQUEST_ID_BYTES} bytes ({len(request_id)})")
    if not all(" " <= c <= "~" for c in request_id):
        raise InvalidArgument("request_id must be printable ASCII")


def validate_request(request: GenerateRequest, limits: RequestLimits) -> None:
    """Raise OminixError naming the first reason ``request`` can never run under ``limits``."""
    validate_request_id(request.request_id)
    _validate_text(request, limits)
    _validate_tokens(request, limits)
    request.sampling.validate(limits.vocab_size, limits.max_model_len)


def _validate_text(request: GenerateRequest, limits: RequestLimits) -> None:
    max_chars = limits.max_prompt_chars
    messages = request.chat_messages
    # Every turn renders at least one token: more turns than the context holds are refused before a pass
    # over them (a million of them is a 30 MiB body).
    if limits.max_model_len is not None and len(messages) > limits.max_model_len:
        raise InvalidArgument(
            f"{len(messages)} chat messages; the model's context ({limits.max_model_len} tokens) can never hold them"
        )
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"messages[{i}].role {m.role!r} is not one of {', '.join(sorted(CHAT_ROLES))}"
            )
        if max_chars is not None and len(m.content) > max_chars:
            raise InvalidArgument(
                f"messages[{i}].content has {len(m.content)} characters; the model's context "
                f"({limits.max_model_len} tokens) can never hold more than {max_chars}"
            )
    total = sum(len(m.content) for m in messages) + len(request.prompt_text or "")
    if max_chars is not None and total > max_chars:
        raise InvalidArgument(
            f"the prompt has {total} characters; the model's context ({limits.max_model_len} tokens) "
            f"can never hold more than {max_chars}"
        )


def _validate_tokens(request: GenerateRequest, limits: RequestLimits) -> None:
    prompt = request.prompt_token_ids
    has_text = bool(request.prompt_text) or bool(request.chat_messages)
    if not prompt and (limits.needs_token_ids or not has_text):
        raise InvalidArgument("the prompt is empty")
    vocab = limits.vocab_size
    # min/max run in C: a long prompt is checked in microseconds on every admission's critical path.
    if vocab is not None and prompt and (min(prompt) < 0 or max(prompt) >= vocab):
        bad = next(t for t in prompt if not 0 <= t < vocab)
        raise InvalidArgument(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
    max_len = limits.max_model_len
    n = len(prompt)
    if max_len is not None and n >= max_len:
        raise InvalidArgument(f"the prompt has {n} tokens; the model's context length is {max_len}")
    max_tokens = request.sampling.max_tokens
    if max_len is not None and n and isinstance(max_tokens, int) and n + max_tokens > max_len:
        raise InvalidArgument(
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} "
            f"exceeds the model's context length {max_len}"
        )
    capacity = limits.kv_capacity_tokens
    if capacity is not None and isinstance(max_tokens, int) and n + max_tokens > capacity:
        raise OminixError(
            RuntimeErrorKind.KV_CAPACITY_EXCEEDED,
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs more KV than the "
            f"{capacity} tokens {limits.holder or 'the worker'} has in total",
        )
