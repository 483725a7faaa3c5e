"""The contract's facts about a failed RPC, carried in its trailing metadata (engine.proto, "Errors"): the error
kind and whether a retry is safe. Every refusal of the front API sends them, whatever refused the call (the
guard, a handler, a forwarded call)."""

from __future__ import annotations

from ominix_runtime.contract import RuntimeErrorKind, is_retryable

ERROR_KIND_METADATA_KEY = "ominix-error-kind"
RETRYABLE_METADATA_KEY = "ominix-retryable"


def error_metadata(kind: RuntimeErrorKind, tokens_sent: bool = False) -> tuple[tuple[str, str], ...]:
    """Trailing metadata of a failed RPC: the contract's error kind and whether a retry is safe."""
    return (
        (ERROR_KIND_METADATA_KEY, kind.name),
        (RETRYABLE_METADATA_KEY, "true" if is_retryable(kind, tokens_sent) else "false"),
    )
