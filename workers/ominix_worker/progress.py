"""Startup progress of a worker (weight loading, KV profiling, warm-up).

On a terminal a tqdm bar per stage; otherwise (systemd, containers, a parent process reading the log) one
JSON line per event on stderr, so a supervisor can follow a slow start:

    {"event": "progress", "stage": "loading weights", "status": "start", "done": 0, "total": 291}
    {"event": "progress", "stage": "loading weights", "status": "update", "done": 150, "total": 291, ...}
    {"event": "progress", "stage": "loading weights", "status": "done", "done": 291, "total": 291, ...}

Updates come at most once per ``JSON_UPDATE_INTERVAL_S``; ``elapsed_s`` is seconds since the stage started.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any, TypeVar

from ominix_runtime.server.logging import get_logger, line_fields, renders_json

T = TypeVar("T")
JSON_UPDATE_INTERVAL_S = 1.0


class Progress:
    """One stage: ``update(n)`` as work gets done, ``close()`` at the end (or use it as a context manager)."""

    def __init__(self, stage: str, total: int | None = None, unit: str = "it", stream: IO[str] | None = None):
        self.stage = stage
        self.total = total
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._started = time.monotonic()
        self._last_emit = self._started
        self._closed = False
        self._bar: Any = None
        self._json = not _is_tty(self._stream)
        if not self._json:
            try:
                from tqdm import tqdm
            except ImportError:  # the worker extra brings tqdm; without it a terminal gets no bar
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=stage, unit=unit, leave=False, file=self._stream)
        else:
            self._emit("start")

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._json:
            now = time.monotonic()
            if now - self._last_emit >= JSON_UPDATE_INTERVAL_S:
                self._last_emit = now
                self._emit("update")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self._json:
            self._emit("done")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _emit(self, status: str) -> None:
        name = "progress"
        event = {"event": name, "stage": self.stage, "status": status, "done": self.done}
        if self.total is not None:
            event["total"] = self.total
        if status != "start":
            event["elapsed_s"] = round(time.monotonic() - self._started, 3)
        if self._stream is sys.stderr and not renders_json():
            # The log stream is rendered for a terminal further up (launch's): a console line, not JSON.
            del event["event"]  # the log line's own event name
            get_logger("ominix_worker.progress").info(name, **event)
            return
        event.update(line_fields("info"))  # the keys of every other line of the log stream
        print(json.dumps(event), file=self._stream, flush=True)


def track(iterable: Iterable[T], total: int, stage: str, unit: str = "it") -> Iterator[T]:
    """Iterate ``iterable`` with progress for ``stage``; the stage closes when the iteration ends."""
    with Progress(stage, total, unit) as progress:
        for item in iterable:
            yield item
            progress.update()


def stage(name: str) -> Progress:
    """A stage with no count of its own (KV profiling, warm-up): start and done, with the elapsed time."""
    return Progress(name, total=None, unit="step")


def _is_tty(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
