"""Sampling parameters with validation (clear errors for out-of-range values)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ominix_runtime.contract.errors import InvalidArgument

DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
# Every sampled token is looked up among its request's stop ids on the engine's loop, every step: a request
# with millions of them would slow every other request's steps (and their check at admission the loop).
MAX_STOP_TOKEN_IDS = 1024
# Temperatures below this sample greedily (the first maximum), on the engine and the worker alike. Validation
# allows any temperature in [0, 100], but dividing logits by one this small overflows float32 (a logit of 30
# over 1e-38 is inf, and the Gumbel draw then picks among the infinities, not the maximum). Near 0 the
# softmax is the argmax anyway: at 1e-5 a logit gap of 1e-3 already weighs e^100 to 1.
GREEDY_TEMPERATURE = 1e-5
# A sampled temperature below this samples at this one, as vLLM does: sharper ones are greedy in all but name
# (a logit gap of 0.1 already weighs e^10 to 1 here) and only bring the division closer to overflow.
MIN_SAMPLING_TEMPERATURE = 0.01


def _finite(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise InvalidArgument(f"{name} must be a finite number, got {value!r}")


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; 0: sampled token only; N: plus top-N
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0

    @property
    def is_greedy(self) -> bool:
        """Sampled as the first maximum: temperature 0, or below ``GREEDY_TEMPERATURE``."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def sampling_temperature(self) -> float:
        """What a sampler divides the logits by: 0 when greedy, else at least ``MIN_SAMPLING_TEMPERATURE``."""
        return 0.0 if self.is_greedy else max(self.temperature, MIN_SAMPLING_TEMPERATURE)

    def validate(self, vocab_size: int | None = None, max_model_len: int | None = None) -> SamplingParams:
        """Raise :class:`InvalidArgument` naming the first bad field; return self when all are valid."""
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            _finite(name, getattr(self, name))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if max_model_len is not None and self.max_tokens > max_model_len:
            raise InvalidArgument(
                f"max_tokens {self.max_tokens} exceeds the model's context length {max_model_len}"
            )
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidArgument(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise InvalidArgument(f"top_k must be -1 (no limit) or >= 1, got {self.top_k}")
        if vocab_size is not None and self.top_k > vocab_size:
            self.top_k = -1
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidArgument(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidArgument(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidArgument(f"seed must be in [0, 2^64), got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not s:
                raise InvalidArgument("stop strings must not be empty")
            if len(s) > MAX_STOP_STRING_LEN:
                raise InvalidArgument(f"stop strings must be at most {MAX_STOP_STRING_LEN} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}"
            )
        for t in self.stop_token_ids:
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise InvalidArgument(f"stop_token_ids entry {t} is outside the vocabulary [0, {vocab_size})")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidArgument(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        return self
