"""Typed reading of release JSON inputs: every bad field is a :class:`ReleaseInputError` naming its path."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class ReleaseInputError(ValueError):
    """A release input (workload, gate or mirror file) is malformed; the message names the field."""


def load_json_object(path: str | Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; a missing file or bad JSON is a ReleaseInputError."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ReleaseInputError(f"cannot read the {what} {str(path)!r}: {exc.strerror or exc}") from exc
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReleaseInputError(f"the {what} {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ReleaseInputError(f"the {what} {str(path)!r} must hold a JSON object")
    return value


class Fields:
    """A JSON object read field by field; ``where`` is its path in the document, for error messages."""

    def __init__(self, value: object, where: str) -> None:
        if not isinstance(value, Mapping):
            raise ReleaseInputError(f"{where} must be an object")
        self.value: Mapping[str, Any] = value
        self.where = where

    def has(self, key: str) -> bool:
        return self.value.get(key) is not None

    def _path(self, key: str) -> str:
        return f"{self.where}.{key}"

    def obj(self, key: str, required: bool = False) -> Fields:
        raw = self.value.get(key)
        if raw is None:
            if required:
                raise ReleaseInputError(f"{self._path(key)} is missing")
            raw = {}
        return Fields(raw, self._path(key))

    def objects(self, key: str, required: bool = False) -> list[Fields]:
        raw = self.value.get(key)
        if raw is None:
            if required:
                raise ReleaseInputError(f"{self._path(key)} is missing")
            return []
        if not isinstance(raw, list):
            raise ReleaseInputError(f"{self._path(key)} must be a list")
        return [Fields(item, f"{self._path(key)}[{i}]") for i, item in enumerate(raw)]

    def text(self, key: str, default: str | None = None) -> str:
        raw = self.value.get(key)
        if raw is None:
            if default is None:
                raise ReleaseInputError(f"{self._path(key)} is missing")
            return default
        if isinstance(raw, bool) or not isinstance(raw, str | int):
            raise ReleaseInputError(f"{self._path(key)} must be a string, got {raw!r}")
        return str(raw)

    def integer(self, key: str, default: int | None = None, minimum: int | None = None) -> int:
        raw = self.value.get(key)
        if raw is None:
            if default is None:
                raise ReleaseInputError(f"{self._path(key)} is missing")
            return default
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ReleaseInputError(f"{self._path(key)} must be an integer, got {raw!r}")
        if minimum is not None and raw < minimum:
            raise ReleaseInputError(f"{self._path(key)} must be >= {minimum}, got {raw}")
        return raw

    def optional_integer(self, key: str, minimum: int | None = None) -> int | None:
        return self.integer(key, minimum=minimum) if self.has(key) else None

    def number(self, key: str, default: float | None = None, minimum: float | None = None) -> float:
        raw = self.value.get(key)
        if raw is None:
            if default is None:
                raise ReleaseInputError(f"{self._path(key)} is missing")
            return default
        if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
            raise ReleaseInputError(f"{self._path(key)} must be a finite number, got {raw!r}")
        if minimum is not None and raw < minimum:
            raise ReleaseInputError(f"{self._path(key)} must be >= {minimum}, got {raw}")
        return float(raw)

    def optional_number(self, key: str, minimum: float | None = None) -> float | None:
        return self.number(key, minimum=minimum) if self.has(key) else None

    def flag(self, key: str, default: bool) -> bool:
        raw = self.value.get(key)
        if raw is None:
            return default
        if not isinstance(raw, bool):
            raise ReleaseInputError(f"{self._path(key)} must be true or false, got {raw!r}")
        return raw

    def integers(self, key: str, minimum: int | None = None) -> list[int] | None:
        raw = self.value.get(key)
        if raw is None:
            return None
        if not isinstance(raw, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in raw):
            raise ReleaseInputError(f"{self._path(key)} must be a list of integers")
        if minimum is not None and any(v < minimum for v in raw):
            raise ReleaseInputError(f"{self._path(key)} holds a value below {minimum}")
        return list(raw)

    def numbers(self, key: str) -> list[float] | None:
        raw = self.value.get(key)
        if raw is None:
            return None
        if not isinstance(raw, list) or any(
            isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) for v in raw
        ):
            raise ReleaseInputError(f"{self._path(key)} must be a list of finite numbers")
        return [float(v) for v in raw]

    def choice(self, key: str, options: Mapping[str, Any], default: str) -> Any:
        name = self.text(key, default).lower()
        if name not in options:
            raise ReleaseInputError(f"{self._path(key)} must be one of {sorted(options)}, got {name!r}")
        return options[name]
