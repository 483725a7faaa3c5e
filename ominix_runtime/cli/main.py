"""Entry point: pick the command, build its config tree, run it; every setup failure is one line, exit 1."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ominix_runtime.cli.commands import COMMANDS, FORWARDED, command
from ominix_runtime.cli.settings import ConfigError, resolve

PROG = "ominix-runtime"


def usage() -> str:
    rows = [(c.name, c.help) for c in COMMANDS] + [(n, h) for n, (h, _) in FORWARDED.items()]
    width = max(len(n) for n, _ in rows)
    lines = [
        f"usage: {PROG} [--version] COMMAND [flags]",
        "",
        "Runtime policy layer for LLM inference serving (engine daemon, workers, client).",
        "",
        "commands:",
        *(f"  {n.ljust(width)}  {h}" for n, h in rows),
        "",
        f"`{PROG} COMMAND --help` lists a command's flags with their defaults.",
    ]
    return "\n".join(lines)


def fail(name: str, message: str) -> int:
    print(f"{PROG} {name}: error: {message}", file=sys.stderr, flush=True)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 1
    if argv[0] == "--version":
        from ominix_runtime.version import version_text

        print(version_text())
        return 0
    name = argv[0]
    if name in FORWARDED:
        module, _, function = FORWARDED[name][1].partition(":")
        import importlib

        return int(getattr(importlib.import_module(module), function)(argv[1:]) or 0)
    try:
        cmd = command(name)
    except KeyError:
        known = ", ".join([c.name for c in COMMANDS] + list(FORWARDED))
        return fail(name, f"unknown command (commands: {known})")
    try:
        config, options = resolve(cmd, argv[1:])
    except ConfigError as exc:
        return fail(name, str(exc))
    try:
        return int(cmd.function()(config, options) or 0)
    except ConfigError as exc:
        return fail(name, str(exc))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
