"""structlog set-up: JSON lines when stderr is not a terminal (systemd, docker), pretty on a TTY."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: str = "INFO", json_output: bool | None = None) -> None:
    """Configure structlog once for the process; events go to stderr."""
    if json_output is None:
        json_output = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if json_output
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # one write per line (print() writes the line, then its newline: another thread's
        # write to stderr, a library's warning, could land between and break the JSON line)
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
