"""The serving process's collector setup (``memory.freeze_startup_heap``), in a child process of its own."""

from __future__ import annotations

import subprocess
import sys

from ominix_runtime import memory

_CHILD = """
import gc
from ominix_runtime import memory
import ominix_runtime.server.app  # a serving process's startup heap
assert gc.get_freeze_count() == 0
memory.freeze_startup_heap()
frozen = gc.get_freeze_count()
assert frozen > 10_000, frozen
assert gc.get_threshold() == memory.SERVING_GC_THRESHOLD, gc.get_threshold()
assert len(gc.get_objects()) < frozen, "startup objects left in the collected generations"
print("ok", frozen)
"""


def test_startup_heap_is_frozen_and_the_young_threshold_raised() -> None:
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok")
    assert memory.SERVING_GC_THRESHOLD[0] > 700  # above Python's default, or the change buys nothing
