"""Structured logging: JSON lines for machines, a console renderer for people at a TTY.

Every log line carries ``service`` and ISO timestamps; call sites add ids as keyword arguments
(``log.info("job placed", job_id=...)``) so logs can be filtered by job without parsing prose.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(service: str, level: str = "info", fmt: str = "auto") -> structlog.stdlib.BoundLogger:
    """Configure structlog and the stdlib root logger once per process; return the service's logger."""
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer = structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    logging.basicConfig(format="%(message)s", stream=sys.stderr, level=level.upper(), force=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger().bind(service=service)


def get_logger(**bound: object) -> structlog.stdlib.BoundLogger:
    """A logger with ``bound`` key-values on every line.

    Lazy: safe at module import time, it picks up ``configure_logging`` done later (a logger bound at
    import would keep structlog's defaults, debug lines included).
    """
    return structlog.get_logger(**bound)
