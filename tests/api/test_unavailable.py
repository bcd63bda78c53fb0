"""Outages mapped once, at the API's boundary, and rendered as the SDK needs them (PROTOCOL.md §4.2, §5.5).

Unit tests, no network: every foreign error that means "Redis (or Postgres) is unreachable" becomes
`UnavailableError`; anything else passes through; the 503 and the SSE `error` frame carry what a
client needs to come back.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pydantic
import pytest
from openai.types.responses import ResponseErrorEvent
from redis import exceptions as redis_errors
from sqlalchemy import exc as sqlalchemy_errors
from starlette.responses import Response

from api.errors import committed_error_response, error_response
from api.sse import error_frame
from tests.support.schema import validate_event
from worker.errors import UnavailableAfterCommitError, UnavailableError
from worker.outages import OUTAGE_CLASSES, as_unavailable

REDIS_OUTAGES = [
    redis_errors.ConnectionError("refused"),
    redis_errors.TimeoutError("hung"),
    redis_errors.BusyLoadingError("loading its AOF"),
    redis_errors.ReadOnlyError("a replica after a failover"),
]
REDIS_FAULTS = [redis_errors.AuthenticationError("wrong password"), redis_errors.ResponseError("WRONGTYPE")]


def _dbapi(kind: type[sqlalchemy_errors.DBAPIError]) -> sqlalchemy_errors.DBAPIError:
    return kind("SELECT 1", None, Exception("server closed the connection"))


POSTGRES_OUTAGES = [
    _dbapi(sqlalchemy_errors.OperationalError),
    _dbapi(sqlalchemy_errors.InterfaceError),
    sqlalchemy_errors.TimeoutError("QueuePool limit reached"),
]
POSTGRES_FAULTS = [_dbapi(sqlalchemy_errors.IntegrityError), _dbapi(sqlalchemy_errors.ProgrammingError)]


@pytest.mark.parametrize("error", REDIS_OUTAGES, ids=lambda error: type(error).__name__)
def test_redis_outages_are_unavailable(error: Exception) -> None:
    """Each way Redis can be unreachable becomes UnavailableError, the original kept as its cause."""
    unavailable = as_unavailable(error)
    assert isinstance(unavailable, UnavailableError)
    assert unavailable.__cause__ is error


@pytest.mark.parametrize("error", REDIS_FAULTS, ids=lambda error: type(error).__name__)
def test_other_redis_errors_pass_through(error: Exception) -> None:
    """A Redis error that is not an outage (a misconfiguration, a bug) is not disguised as one."""
    assert as_unavailable(error) is None


@pytest.mark.parametrize("error", POSTGRES_OUTAGES, ids=lambda error: type(error).__name__)
def test_postgres_outages_are_unavailable(error: Exception) -> None:
    """Each way Postgres can be unreachable becomes UnavailableError."""
    assert isinstance(as_unavailable(error), UnavailableError)


@pytest.mark.parametrize("error", POSTGRES_FAULTS, ids=lambda error: type(error).__name__)
def test_other_postgres_errors_pass_through(error: Exception) -> None:
    """A Postgres error that is not an outage is not disguised as one."""
    assert as_unavailable(error) is None


def test_every_outage_reaches_the_apis_boundary() -> None:
    """The API maps outages at one boundary: every kind of outage above is an instance of a class it handles."""
    for error in REDIS_OUTAGES + POSTGRES_OUTAGES:
        assert isinstance(error, OUTAGE_CLASSES), error


def test_a_503_says_when_to_retry() -> None:
    """An outage is a 503 in OpenAI's envelope with the configured retry-after, and the SDK may retry it."""
    answer = error_response(UnavailableError("Redis is down."), retry_after_seconds=7)
    body = json.loads(answer.body)
    assert (answer.status_code, answer.headers["retry-after"]) == (503, "7")
    assert body["error"] == {
        "message": "Redis is down.",
        "type": "server_error",
        "param": None,
        "code": "service_unavailable",
    }
    assert "x-should-retry" not in answer.headers


AFTER_COMMIT: dict[str, Callable[[], Response]] = {
    "after-commit error": lambda: error_response(UnavailableAfterCommitError("'resp_1' was recorded."), 7),
    "outage while waiting": lambda: committed_error_response(UnavailableError("Redis is down."), 7),
    "anything while waiting": lambda: committed_error_response(RuntimeError("anything"), 7),
}


@pytest.mark.parametrize("answer", AFTER_COMMIT)
def test_a_503_after_a_recorded_create_is_never_retried(answer: str) -> None:
    """Once a create is recorded, its 503 says x-should-retry: false, so the SDK cannot run it twice."""
    rendered = AFTER_COMMIT[answer]()
    assert rendered.status_code == 503
    assert (rendered.headers["x-should-retry"], rendered.headers["retry-after"]) == ("false", "7")


@pytest.mark.parametrize("after", [0, 41])
def test_the_error_frame_is_a_valid_flat_error_event(after: int) -> None:
    """A stream cut short ends with a flat `error` event repeating the last number (the resume cursor)
    and naming where to resume."""
    frame = error_frame(UnavailableError("Redis is down."), after).decode()
    head, data = frame.removesuffix("\n\n").split("\n")
    assert head == "event: error"
    event = json.loads(data.removeprefix("data: "))
    validate_event(event)
    parsed = pydantic.TypeAdapter(ResponseErrorEvent).validate_python(event, strict=True)
    assert (parsed.sequence_number, parsed.code) == (after, "service_unavailable")
    resume = f"stream=true&starting_after={after}"
    assert resume in parsed.message
    assert "error" not in event  # a top-level `error` key would make the SDK raise (PROTOCOL.md §4.2)
