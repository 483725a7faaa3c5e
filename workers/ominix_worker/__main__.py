"""``python -m ominix_worker``: run a worker process."""

import sys

from ominix_worker.server import main

sys.exit(main())
