"""The host-side grid and block helpers (``ominix_worker.ops``) compute what Triton's own do."""

from __future__ import annotations

import math

import pytest

from ominix_worker.ops import cdiv, next_power_of_2


def test_next_power_of_2_is_the_smallest_power_at_or_above() -> None:
    assert next_power_of_2(0) == 0
    for n in range(1, 5000):
        p = next_power_of_2(n)
        assert p >= n and p & (p - 1) == 0 and (p == 1 or p // 2 < n), n


def test_cdiv_rounds_up() -> None:
    for a in range(0, 300):
        for b in range(1, 40):
            assert cdiv(a, b) == math.ceil(a / b), (a, b)


def test_the_same_as_triton() -> None:
    triton = pytest.importorskip("triton")
    powers = [2**k + d for k in range(1, 63) for d in (-1, 0, 1)]
    for n in [*range(-100, 70_001), *powers]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in [*range(-300, 3_000), *powers]:
        for b in (1, 2, 3, 7, 16, 64, 127, 128, 1024):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
