"""Limits on what one request may carry, and malformed ids: each refused with a 4xx in OpenAI's
envelope naming what was wrong, before anything is recorded (issue 7)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from redis import Redis

from tests.conftest import own_stack
from tests.support.stack import Servers, Stack

pytestmark = pytest.mark.integration

MAX_BODY = 64 * 1024
MAX_ITEMS = 8


@pytest.fixture(scope="module")
def limited(backing: Servers, session_dir: Path, stack: Stack) -> Iterator[Stack]:
    """An API with small limits, no keys and no worker: what it accepts stays queued."""
    running = own_stack(
        backing,
        session_dir,
        "limits",
        RESPOOL_MAX_BODY_BYTES=str(MAX_BODY),
        RESPOOL_MAX_INPUT_ITEMS=str(MAX_ITEMS),
        RESPOOL_UPSTREAM_URL="http://127.0.0.1:9/v1",
    )
    running.start_api("api-limits")
    yield running
    running.stop_all()


@pytest.fixture
def http(limited: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=limited.url + "/v1", timeout=30) as client:
        yield client


def _queued(limited: Stack, backing: Servers) -> int:
    with Redis.from_url(backing.redis_url) as redis:
        return int(redis.llen(f"rq:queue:{limited.env['RESPOOL_QUEUE']}"))


def _body(text_bytes: int) -> bytes:
    return orjson.dumps({"model": "m", "background": True, "input": "x" * text_bytes})


def _error(answer: httpx.Response, status: int) -> dict[str, object]:
    assert answer.status_code == status, answer.text
    assert answer.headers["x-request-id"].startswith("req_")
    error: dict[str, object] = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_a_body_over_the_limit_is_413_and_records_nothing(
    http: httpx.Client, limited: Stack, backing: Servers
) -> None:
    """Declared (content-length) or streamed (chunked), a body past RESPOOL_MAX_BODY_BYTES is a 413
    request_too_large; one just under it is accepted."""
    before = _queued(limited, backing)
    declared = http.post("/responses", content=_body(MAX_BODY), headers={"content-type": "application/json"})
    assert _error(declared, 413)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:
        body = _body(MAX_BODY)
        for start in range(0, len(body), 8192):
            yield body[start : start + 8192]

    streamed = http.post("/responses", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in streamed.request.headers  # sent chunked
    assert _error(streamed, 413)["code"] == "request_too_large"
    assert _queued(limited, backing) == before

    fits = http.post("/responses", content=_body(MAX_BODY - 100))
    assert fits.status_code == 200, fits.text
    assert fits.json()["status"] == "queued"


def test_more_input_items_than_the_limit_is_400_on_input(http: httpx.Client) -> None:
    items = [{"role": "user", "content": f"turn {n}"} for n in range(MAX_ITEMS + 1)]
    over = http.post("/responses", json={"model": "m", "background": True, "input": items})
    error = _error(over, 400)
    assert (error["param"], error["code"]) == ("input", "invalid_value")
    at_limit = http.post("/responses", json={"model": "m", "background": True, "input": items[:MAX_ITEMS]})
    assert at_limit.status_code == 200, at_limit.text


def test_deeply_nested_json_is_400(http: httpx.Client) -> None:
    """Nesting past the JSON parser's depth limit is a 400, not a crash or a 500."""
    deep = b'{"model":"m","input":"x","metadata":' + b'{"a":' * 5000 + b"1" + b"}" * 5001
    assert _error(http.post("/responses", content=deep), 400)["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "bad_id", ["xyz", "resp_", "resp_" + "a" * 60, "resp_a.b", "msg_0123", "resp_%00", "resp_a%20b"]
)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/responses/{id}"),
        ("GET", "/responses/{id}?stream=true"),
        ("POST", "/responses/{id}/cancel"),
        ("DELETE", "/responses/{id}"),
        ("GET", "/responses/{id}/input_items"),
    ],
)
def test_a_malformed_response_id_is_400_on_every_route(
    http: httpx.Client, method: str, path: str, bad_id: str
) -> None:
    answer = http.request(method, path.format(id=bad_id))
    error = _error(answer, 400)
    assert (error["type"], error["param"]) == ("invalid_request_error", "response_id")


def test_a_malformed_previous_response_id_is_400(http: httpx.Client) -> None:
    body = {"model": "m", "input": "x", "previous_response_id": "../../etc/passwd"}
    error = _error(http.post("/responses", json=body), 400)
    assert error["param"] == "previous_response_id"


def test_an_input_items_cursor_past_its_length_is_400(http: httpx.Client) -> None:
    answer = http.get("/responses/resp_0123/input_items", params={"after": "a" * 129})
    assert _error(answer, 400)["param"] == "after"
