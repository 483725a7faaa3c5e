"""Runtime error kinds (upstream OminiX names) and the exception that carries one."""

from __future__ import annotations

from enum import IntEnum


class RuntimeErrorKind(IntEnum):
    """Values match ``ominix.runtime.v1.ErrorCode``."""

    ADMISSION_REJECTED = 1
    BACKEND_UNAVAILABLE = 2
    CAPABILITY_MISMATCH = 3
    KV_CAPACITY_EXCEEDED = 4
    TIMEOUT = 5
    CANCELLED = 6
    INTERNAL = 7
    INVALID_ARGUMENT = 8


# Kinds a caller may retry as they are (elsewhere or a little later), provided no token reached the user yet:
# a full queue and a missing backend are transient; everything else fails the same way again.
RETRYABLE_KINDS = frozenset({RuntimeErrorKind.ADMISSION_REJECTED, RuntimeErrorKind.BACKEND_UNAVAILABLE})


def is_retryable(kind: RuntimeErrorKind, tokens_sent: bool = False) -> bool:
    """The upstream router's rule: retry only before user-visible output, and only transient kinds."""
    return not tokens_sent and kind in RETRYABLE_KINDS


class OminixError(Exception):
    """An error with a kind; the gRPC edge maps the kind to a status code."""

    def __init__(self, kind: RuntimeErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message

    def __repr__(self) -> str:
        return f"OminixError({self.kind.name}, {self.message!r})"


class InvalidArgument(OminixError):
    def __init__(self, message: str) -> None:
        super().__init__(RuntimeErrorKind.INVALID_ARGUMENT, message)


class AdmissionRejected(OminixError):
    def __init__(self, message: str, kind: RuntimeErrorKind = RuntimeErrorKind.ADMISSION_REJECTED) -> None:
        super().__init__(kind, message)
