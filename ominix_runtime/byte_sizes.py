"""Byte sizes and dtype names as flags and config files write them (--kv-cache-memory 512MiB, --dtype bf16):
one reading for the CLI, which refuses a bad value as it reads the flag, and for the worker, which acts on
it."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "t": 1000**4,
    "tb": 1000**4,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """'1GiB', '512MiB', '1e9'-free integers, '2GB' → bytes."""
    if isinstance(text, int):
        return text
    match = _BYTES_RE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"bad byte size {text!r}: use e.g. 1073741824, 512MiB or 1GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


# --dtype: the run dtypes by name, and the short names they also go by ("auto" picks one per device).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float": "float32",
}
