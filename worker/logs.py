"""Logging for every respool process: plain text, or one JSON object a line (`RESPOOL_LOG_FORMAT`),
each carrying the request id and the response id it concerns, when there is one.

The ids travel in context variables: the API sets `REQUEST_ID` per request and `RESPONSE_ID` once
it knows the response; a worker sets `RESPONSE_ID` in each response's task.
"""

from __future__ import annotations

import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime

import orjson

REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)
RESPONSE_ID: ContextVar[str | None] = ContextVar("response_id", default=None)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """A record as one line of JSON: time, level, logger, message, ids, and the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, var in (("request_id", REQUEST_ID), ("response_id", RESPONSE_ID)):
            value = var.get()
            if value is not None:
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


def configure(log_format: str) -> None:
    """Send every logger's records to stderr, as text or as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
