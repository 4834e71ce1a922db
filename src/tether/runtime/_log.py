"""Logging: structlog events with stable names, pykka's stdlib logging routed through it.

Quiet by default (warnings and errors); ``TETHER_LOG=debug|info|warning|error`` sets the
level, ``TETHER_LOG_FORMAT=json`` renders one JSON object a line. An application that
configured structlog itself keeps its configuration.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

__all__ = ["configure_logging"]

_HANDLER_MARK = "_tether_handler"


def configure_logging() -> None:
    level = getattr(logging, os.environ.get("TETHER_LOG", "warning").upper(), logging.WARNING)
    if not structlog.is_configured():
        structlog.configure(
            processors=[
                structlog.stdlib.filter_by_level,
                structlog.contextvars.merge_contextvars,
                structlog.stdlib.add_logger_name,
                structlog.stdlib.add_log_level,
                structlog.processors.TimeStamper(fmt="iso"),
                structlog.processors.format_exc_info,
                structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
            ],
            logger_factory=structlog.stdlib.LoggerFactory(),
            wrapper_class=structlog.stdlib.BoundLogger,
            cache_logger_on_first_use=True,  # capture_logs still works: it edits the list in place
        )
    renderer = (
        structlog.processors.JSONRenderer()
        if os.environ.get("TETHER_LOG_FORMAT") == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        processor=renderer,
        foreign_pre_chain=[
            structlog.stdlib.add_logger_name,
            structlog.stdlib.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
        ],
    )
    for name in ("tether", "pykka"):
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if not any(getattr(h, _HANDLER_MARK, False) for h in logger.handlers):
            handler = logging.StreamHandler(sys.stderr)
            setattr(handler, _HANDLER_MARK, True)
            logger.addHandler(handler)
            logger.propagate = False
        for h in logger.handlers:
            if getattr(h, _HANDLER_MARK, False):
                h.setFormatter(formatter)
