"""Structured logging (structlog) for every service: one line per event, key=value or JSON.

`configure(service)` once at process start; then `get_logger()` and `log.bind(request_id=...)`.
"""
import logging
import os
import sys

import structlog


def configure(service: str, level: str | None = None, json: bool | None = None) -> None:
    level = (level or os.environ.get("PAGODA_LOG_LEVEL", "INFO")).upper()
    if json is None:
        json = os.environ.get("PAGODA_LOG_FORMAT", "console") == "json"
    renderer = (structlog.processors.JSONRenderer() if json
                else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service, pid=os.getpid())


def get_logger(name: str | None = None):
    return structlog.get_logger(name) if name else structlog.get_logger()
