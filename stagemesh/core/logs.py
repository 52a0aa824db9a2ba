"""structlog set-up: JSON lines for services, a console renderer on a TTY.

Every line of a request carries its request_id, bound in a contextvar by the server layer.
"""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import structlog

REQUEST_ID_HEADER = "x-request-id"
LOG_LEVELS = ("debug", "info", "warning", "error")


def check_level(level: str, where: str = "--log-level") -> str:
    if not isinstance(level, str) or level.lower() not in LOG_LEVELS:
        raise ValueError(f"{where}: {level!r} is not a log level; allowed: {', '.join(LOG_LEVELS)}")
    return level.lower()


def configure(service: str, level: str = "info") -> None:
    renderer = structlog.dev.ConsoleRenderer() if sys.stderr.isatty() else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            # Process-wide, not a contextvar: lines from threads that did not inherit the context
            # (result pumps, watchdogs) name their service too.
            _add_service(service),
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # One write per line (message and newline together): processes sharing a log file
        # (children of `stagemesh up`, unbuffered) must not interleave inside a line.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def _add_service(service: str):
    def add(logger, method: str, event: dict) -> dict:
        event.setdefault("service", service)
        return event

    return add


def get_logger(name: str):
    return structlog.get_logger(name)


def new_request_id() -> str:
    return uuid.uuid4().hex


def current_request_id() -> str:
    """The id bound by the server layer for the request being handled."""
    return str(structlog.contextvars.get_contextvars().get("request_id") or new_request_id())


@contextmanager
def bound_request(request_id: str) -> Iterator[None]:
    with structlog.contextvars.bound_contextvars(request_id=request_id):
        yield
