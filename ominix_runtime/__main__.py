"""``python -m ominix_runtime`` is the ``ominix-runtime`` command."""

import sys

from ominix_runtime.cli import main

if __name__ == "__main__":
    sys.exit(main())
