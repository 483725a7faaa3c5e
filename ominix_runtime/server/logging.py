"""One log stream for the engine, the worker and the launcher: structlog, JSON lines unless stderr is a TTY.

Every line carries ``event``, ``level``, ``timestamp`` and ``component`` (engine, worker, launcher), plus
``worker_id`` in a worker and ``request_id`` inside a request. stdlib ``logging`` records (the worker's
modules, grpc) are rendered by the same processors, so nothing else reaches stderr in another shape.
"""

from __future__ import annotations

import datetime
import logging
import sys
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager, suppress
from typing import Any

import structlog
from structlog.typing import FilteringBoundLogger, Processor

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
# Loggers of this project's own stdlib users: they log at the configured level; others (grpc, asyncio) at
# WARNING and above.
_OWN_STDLIB_LOGGERS = ("ominix_worker", "ominix")
_fields: dict[str, Any] = {}
_rendering = {"json": True}  # what configure_logging chose (JSON until it runs)


def renders_json() -> bool:
    """Whether this process's log stream is JSON lines (else the console renderer)."""
    return _rendering["json"]


def set_log_fields(**fields: Any) -> None:
    """Fields added to every later line of this process (e.g. ``worker_id`` once the worker knows it)."""
    _fields.update({k: v for k, v in fields.items() if v is not None})


def line_fields(level: str) -> dict[str, Any]:
    """The keys every line carries besides ``event``, for a JSON line written without structlog (the
    worker's progress events, which own their stream)."""
    timestamp = datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")
    return {"level": level, "timestamp": timestamp, **_fields}


def _add_fields(logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key, value in _fields.items():
        event_dict.setdefault(key, value)
    return event_dict


def _drop_stdlib_extras(
    logger: Any, method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    event_dict.pop("_record", None)
    event_dict.pop("_from_structlog", None)
    return event_dict


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of the write. The stream bound when logging was
    configured can be replaced and closed later (a test runner's capture, a redirect), and a log line from a
    thread that outlives it would then fail with "I/O operation on closed file"."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_STDERR = _CurrentStderr()


def configure_logging(
    level: str = "info", json_output: bool | None = None, component: str = "engine", **fields: Any
) -> None:
    """Route structlog and stdlib logging to stderr. ``json_output=None``: JSON unless stderr is a TTY."""
    if json_output is None:
        json_output = not sys.stderr.isatty()
    numeric_level = _LEVELS.get(level.lower(), logging.INFO)
    _rendering["json"] = json_output
    set_log_fields(component=component, **fields)
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
        _add_fields,
    ]
    renderer: Processor
    if json_output:
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        # One write per line (message and newline together): processes sharing one stderr (launch's workers)
        # would otherwise interleave a line's text and its newline with another process's line.
        logger_factory=structlog.WriteLoggerFactory(file=_STDERR),  # type: ignore[arg-type]  # write and flush suffice
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(_STDERR)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[_drop_stdlib_extras, renderer],
        )
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(max(numeric_level, logging.WARNING))
    for name in _OWN_STDLIB_LOGGERS:
        logging.getLogger(name).setLevel(numeric_level)


def get_logger(name: str = "ominix") -> FilteringBoundLogger:
    logger: FilteringBoundLogger = structlog.get_logger(name)  # the wrapper configure_logging installs
    return logger


@contextmanager
def request_context(request_id: str, **fields: object) -> Iterator[None]:
    """Bind request_id (and fields) to every log line emitted in this context (asyncio-task local)."""
    tokens = structlog.contextvars.bind_contextvars(request_id=request_id, **fields)
    try:
        yield
    finally:
        # A streaming handler closed by a client disconnect is finalised in another context; the variables
        # it bound died with its own context, so there is nothing to restore (reset raises ValueError).
        with suppress(ValueError):
            structlog.contextvars.reset_contextvars(**tokens)
