"""Who may drive this worker: a Run stream is accepted only from the engine the worker is configured for.

Whoever holds Run controls the worker's KV cache and sees every prompt, so a certificate from the right CA
is not enough (the CA also signs front-end clients): with mutual TLS the client certificate must name the
engine identity (subject CN or a SAN entry); on plaintext loopback the engine must present the shared secret.
Describe and Health stay open to anyone who can connect (launchers and probes use them).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ominix_runtime.backends.grpc_worker import ENGINE_SECRET_METADATA

# The engine certificate's subject CN as deploy/tls/make-certs.sh issues it.
DEFAULT_ENGINE_IDENTITY = "ominix-runtime engine"
_NAME_KEYS = ("x509_common_name", "x509_subject_alternative_name")


class AccessConfigError(ValueError):
    """The access settings cannot be used (an unreadable or empty secret file)."""


@dataclass(frozen=True, slots=True)
class EngineAccess:
    """The engine identities (mutual TLS) and the shared secret (plaintext) that may open Run."""

    identities: tuple[str, ...] = ()  # empty: any certificate the CA signed (no name check)
    secret: str | None = None  # None: no secret required

    @property
    def open_to_anyone(self) -> bool:
        return not self.identities and self.secret is None

    def refusal(self, context: Any) -> str | None:
        """None when the caller may open Run, else the reason it may not (sent back with the refusal)."""
        if self.identities:
            auth = context.auth_context()
            names = {v.decode(errors="replace") for key in _NAME_KEYS for v in auth.get(key, [])}
            if not names & set(self.identities):
                shown = ", ".join(sorted(names)) or "no client certificate"
                return f"only the engine ({', '.join(self.identities)}) may open Run; the caller is {shown}"
        if self.secret is not None:
            given = next(
                (v for k, v in context.invocation_metadata() or () if k == ENGINE_SECRET_METADATA), None
            )
            if not isinstance(given, str) or not hmac.compare_digest(given.encode(), self.secret.encode()):
                return "only the engine may open Run: missing or wrong engine secret"
        return None


def read_secret_file(path: str) -> str:
    """The shared engine secret in ``path`` (surrounding whitespace dropped); engine and worker read it alike."""
    try:
        secret = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise AccessConfigError(f"cannot read --engine-secret-file: {exc}") from None
    if not secret:
        raise AccessConfigError(f"--engine-secret-file {path} is empty")
    return secret


def engine_access(identities: list[str] | None, secret_file: str | None, mutual_tls: bool) -> EngineAccess:
    """The access rule from the worker's flags: with mutual TLS the engine identity defaults to the one
    make-certs.sh issues; a secret file adds the shared-secret check (plaintext deployments)."""
    names = tuple(identities or ())
    if mutual_tls and not names:
        names = (DEFAULT_ENGINE_IDENTITY,)
    secret = read_secret_file(secret_file) if secret_file else None
    return EngineAccess(identities=names if mutual_tls else (), secret=secret)
