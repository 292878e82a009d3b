"""structlog set-up shared by every service and the CLI."""
from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(service: str, level: str | None = None, json: bool | None = None) -> structlog.BoundLogger:
    level_name = (level or os.environ.get("AMPD_LOG_LEVEL", "INFO")).upper()
    as_json = json if json is not None else os.environ.get("AMPD_LOG_FORMAT", "console") == "json"
    # Tracebacks without local variables, in both formats: structlog's defaults render every frame's
    # locals (rich's, when rich is installed), which puts prompts and tool arguments in the log and
    # costs minutes on a deeply nested request (issue 24, finding 1).
    if as_json:
        tail = [structlog.processors.ExceptionRenderer(
                    structlog.tracebacks.ExceptionDictTransformer(show_locals=False)),
                structlog.processors.JSONRenderer()]
    else:
        tail = [structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *tail,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger(service=service)
