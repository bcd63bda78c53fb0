"""Logging for every respool process: plain text, or one JSON object a line (`RESPOOL_LOG_FORMAT`),
each carrying the request id and the response id it concerns, when there is one.

The ids travel in context variables: the API sets `REQUEST_ID` per request and `RESPONSE_ID` once
it knows the response; a worker sets `RESPONSE_ID` in each response's task.

At the default level (`RESPOOL_LOG_LEVEL=info`) the console says what a user needs: startup, where
the API listens, a line a request, warnings and errors. The libraries' chatter (RQ's registry
cleaning every 2 s and its three lines a job, Alembic's set-up lines) and the lines of health checks
and metric scrapes are shown from `debug` on.
"""

from __future__ import annotations

import logging
import logging.config
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

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


class WithoutFalseAlarms(logging.Filter):
    """Drops uvicorn's "ASGI callable returned without completing handshake." after a WebSocket
    upgrade the app refused with an HTTP answer (`websocket.http.response`), which uvicorn 0.54's
    default WebSocket protocol logs as an ERROR though it sent that answer as given."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing handshake."


class WithoutProbes(logging.Filter):
    """Drops the access-log lines of health checks and metric scrapes (`/healthz`, `/readyz`,
    `/metrics`): a container healthcheck or a probe every few seconds would be most of the log."""

    PATHS = ("/healthz", "/readyz", "/metrics")

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn.access records carry (client, method, path with query, HTTP version, status).
        args = record.args if isinstance(record.args, tuple) else ()
        path = str(args[2]).partition("?")[0] if len(args) > 2 else ""
        return path not in self.PATHS


# Libraries whose INFO lines are routine (RQ's maintenance every 2 s and three lines a job, Alembic's
# plugin set-up): shown only from `debug` on.
CHATTY = ("rq", "alembic", "httpx", "httpx2")  # httpx: a line per upstream call and webhook


def chatty_level(level: str) -> str:
    """The level of the CHATTY libraries' loggers when respool's is `level`: one step quieter at `info`."""
    return {"debug": "DEBUG", "info": "WARNING"}.get(level, level.upper())


def dict_config(log_format: str, level: str = "info") -> dict[str, Any]:
    """The `logging.config.dictConfig` of a respool process: every record to stderr, as text or as
    JSON lines, at `level`; uvicorn's own loggers included (uvicorn applies it in each of its
    processes, so `--replicas` children log alike)."""
    formatter: dict[str, Any] = {"()": JsonFormatter} if log_format == "json" else {"format": TEXT_FORMAT}
    quiet = chatty_level(level)
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"respool": formatter},
        "filters": {
            "without_false_alarms": {"()": WithoutFalseAlarms},
            "without_probes": {"()": WithoutProbes},
        },
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "respool", "stream": "ext://sys.stderr"}
        },
        "root": {"handlers": ["stderr"], "level": level.upper()},
        "loggers": {
            **{name: {"level": quiet} for name in CHATTY},
            # uvicorn's own handlers would print in another format: its records go to the root's.
            "uvicorn": {"handlers": [], "propagate": True},
            "uvicorn.error": {"handlers": [], "propagate": True, "filters": ["without_false_alarms"]},
            "uvicorn.access": {
                "handlers": [],
                "propagate": True,
                "filters": [] if level == "debug" else ["without_probes"],
            },
        },
    }


def configure(log_format: str, level: str = "info") -> None:
    """Send every logger's records to stderr, as text or as JSON lines, at `level`."""
    logging.config.dictConfig(dict_config(log_format, level))
