"""Stable fingerprints: SHA-256 over canonical JSON, so key order, whitespace and platform never matter."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence


def canonical_json(value: object) -> str:
    """Sorted keys, no whitespace, ASCII only, no NaN: one text per value on every machine."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def fingerprint(value: object) -> str:
    """``sha256:<hex>`` of the canonical JSON of ``value``."""
    return "sha256:" + hashlib.sha256(canonical_json(value).encode("ascii")).hexdigest()


def token_fingerprint(token_ids: Sequence[int]) -> str:
    """Fingerprint of a generated token sequence (what the gate compares for exact outputs)."""
    return fingerprint(list(token_ids))
