"""``python -m ominix_worker``: run a worker process (the flags of ``ominix-runtime worker``)."""

import sys

from ominix_worker.server import main

sys.exit(main())
