"""``replay``, ``gate`` and ``mirror-gate``: the release commands, which parse their own arguments."""

from __future__ import annotations

from collections.abc import Sequence


def _run(command: str, argv: Sequence[str]) -> int:
    from ominix_runtime.release.commands import main

    return main(command, list(argv))


def replay(argv: Sequence[str]) -> int:
    return _run("replay", argv)


def gate(argv: Sequence[str]) -> int:
    return _run("gate", argv)


def mirror_gate(argv: Sequence[str]) -> int:
    return _run("mirror-gate", argv)
