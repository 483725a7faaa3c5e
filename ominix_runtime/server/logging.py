"""structlog setup: JSON lines to stderr (a readable console renderer on a terminal), request_id bound."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import structlog
from structlog.typing import FilteringBoundLogger, Processor

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(level: str = "info", json_output: bool | None = None) -> None:
    """Route structlog (and stdlib logging, e.g. grpc's) to stderr. ``json_output=None``: JSON unless a TTY."""
    if json_output is None:
        json_output = not sys.stderr.isatty()
    numeric_level = _LEVELS.get(level.lower(), logging.INFO)
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(numeric_level, logging.WARNING), stream=sys.stderr, force=True)


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
