"""``ominix-runtime``: the command line (flags in ``flags``, commands in ``commands``, tree in ``settings``)."""

from ominix_runtime.cli.main import main

__all__ = ["main"]
