"""Structured logs (issue 5): one JSON object a line, carrying the request and response ids in context."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import make_sdk, own_stack
from tests.support.stack import Servers, Stack, wait_for
from tests.support.upstream_process import ScriptedUpstream
from worker import logs


def _record(message: str, *, is_failure: bool = False) -> logging.LogRecord:
    exc_info = None
    if is_failure:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    return logging.getLogger("respool.test").makeRecord(
        "respool.test", logging.WARNING, "f", 1, message, (), exc_info
    )


def test_a_record_in_context_carries_its_ids() -> None:
    """A line logged while handling a request about a response names both, as JSON."""

    def log_it() -> str:
        logs.REQUEST_ID.set("req_1")
        logs.RESPONSE_ID.set("resp_1")
        return logs.JsonFormatter().format(_record("hello there"))

    line = json.loads(contextvars.copy_context().run(log_it))
    assert (line["message"], line["level"], line["logger"]) == ("hello there", "warning", "respool.test")
    assert (line["request_id"], line["response_id"]) == ("req_1", "resp_1")


def test_a_record_out_of_context_has_no_ids_and_keeps_its_traceback() -> None:
    """Outside any request or response no id is invented, and an exception's traceback is kept."""
    line = json.loads(
        contextvars.Context().run(logs.JsonFormatter().format, _record("failed", is_failure=True))
    )
    assert "request_id" not in line and "response_id" not in line
    assert "ValueError: boom" in line["exception"]


LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", *logs.CHATTY)


@pytest.fixture
def configured() -> Iterator[None]:
    """Logging as a test configures it, and as pytest had it again afterwards."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    loggers = {name: logging.getLogger(name) for name in LOGGERS}
    states = {name: (logger.filters[:], logger.level) for name, logger in loggers.items()}
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    for name, logger in loggers.items():
        logger.filters[:] = states[name][0]
        logger.setLevel(states[name][1])


@pytest.mark.parametrize(
    ("level", "shown", "hidden"),
    [
        (
            "info",
            ["respool.worker", "uvicorn.error", "uvicorn.access"],
            ["rq.worker", "alembic.runtime.plugins"],
        ),
        ("debug", ["respool.worker", "rq.worker", "alembic.runtime.plugins"], []),
        ("warning", [], ["respool.worker", "uvicorn.access", "rq.worker"]),
    ],
)
@pytest.mark.usefixtures("configured")
def test_the_level_decides_whose_info_lines_are_shown(
    level: str, shown: list[str], hidden: list[str]
) -> None:
    """At `info` respool's and uvicorn's INFO lines show and RQ's and Alembic's routine ones do not;
    `debug` shows those too; `warning` shows no INFO line at all."""
    logs.configure("text", level)
    for name in shown:
        assert logging.getLogger(name).isEnabledFor(logging.INFO), name
    for name in hidden:
        assert not logging.getLogger(name).isEnabledFor(logging.INFO), name


def _access_line(path: str) -> logging.LogRecord:
    """uvicorn's access-log record of a GET of `path`."""
    args = ("10.0.0.9:5000", "GET", path, "1.1", 200)
    return logging.getLogger("uvicorn.access").makeRecord(
        "uvicorn.access", logging.INFO, "f", 1, '%s - "%s %s HTTP/%s" %d', args, None
    )


@pytest.mark.usefixtures("configured")
def test_uvicorns_false_alarm_after_a_refused_websocket_is_dropped() -> None:
    """uvicorn's "returned without completing handshake" after our 426 is not logged; its other errors are."""
    logs.configure("text", "info")
    uvicorn_error = logging.getLogger("uvicorn.error")
    message = "ASGI callable returned without completing handshake."
    false_alarm = uvicorn_error.makeRecord("uvicorn.error", logging.ERROR, "f", 1, message, (), None)
    real = uvicorn_error.makeRecord("uvicorn.error", logging.ERROR, "f", 1, "Exception in ASGI app", (), None)
    assert not uvicorn_error.filter(false_alarm)
    assert uvicorn_error.filter(real)


@pytest.mark.usefixtures("configured")
@pytest.mark.parametrize(("level", "is_probe_shown"), [("info", False), ("debug", True)])
def test_probe_lines_are_shown_only_at_debug(level: str, is_probe_shown: bool) -> None:
    """Health checks and metric scrapes leave no access-log line at the default level; requests do."""
    logs.configure("text", level)
    access = logging.getLogger("uvicorn.access")
    for probe in ("/healthz", "/readyz", "/metrics", "/healthz?verbose=1"):
        assert bool(access.filter(_access_line(probe))) is is_probe_shown, probe
    assert access.filter(_access_line("/v1/responses/resp_1"))


@pytest.mark.integration
@pytest.mark.once
def test_a_worker_logs_json_lines_naming_the_response(
    backing: Servers, upstream: ScriptedUpstream, session_dir: Path, stack: Stack, model: str
) -> None:
    """With RESPOOL_LOG_FORMAT=json, a worker's lines about a response are JSON that name it."""
    running = own_stack(
        backing,
        session_dir,
        "json",
        RESPOOL_UPSTREAM_URL=upstream.url,
        RESPOOL_UPSTREAM_RETRIES="0",
        RESPOOL_LOG_FORMAT="json",
    )
    try:
        running.start_api()
        running.start_worker()
        upstream.script(model, {"status": 400, "error": {"message": "no such thing"}})
        with make_sdk(running.url, "unused") as sdk:
            failed = sdk.responses.create(model=model, input="x")
        assert failed.status == "failed"

        def lines_about_it() -> list[dict[str, object]]:
            lines = [json.loads(line) for line in running.log("worker").splitlines() if line.startswith("{")]
            return [line for line in lines if line.get("response_id") == failed.id]

        about = wait_for(lines_about_it, timeout=30, what="a JSON line naming the response")
        assert any("failed" in str(line["message"]) for line in about)
    finally:
        running.stop_all()
