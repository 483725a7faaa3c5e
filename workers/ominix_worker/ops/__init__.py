"""Fused elementwise kernels for CUDA (Triton): the kernel modules need Triton, this package imports nothing.

The integer helpers below size grids and blocks on the host. ``triton.cdiv`` and ``triton.next_power_of_2``
are constexpr functions, whose call wrapper costs about 1.5 µs a host call (Triton 3.9); an eager step makes
hundreds of such calls, and the same sums in plain Python cost about 0.05 µs each.
"""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b), as ``triton.cdiv`` computes it."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 at or above ``n`` (0 for 0), as ``triton.next_power_of_2`` computes it."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()
