"""Limits on what one request may carry, and malformed ids: each refused with a 4xx in OpenAI's
envelope naming what was wrong, before anything is recorded (issue 7)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from redis import Redis

from tests.conftest import make_sdk, own_stack
from tests.support.stack import Servers, Stack
from worker.keys import queue_key

pytestmark = pytest.mark.integration

MAX_BODY = 64 * 1024
MAX_ITEMS = 8
MAX_CHAIN = 3


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
        return int(redis.llen(queue_key(limited.env["RESPOOL_QUEUE"])))


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


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "input": "a\u0000b"}, "input"),
        ({"model": "m", "input": "x", "metadata": {"k": "v\u0000"}}, "metadata.k"),
        ({"model": "m", "input": [{"role": "user", "content": "\u0000"}]}, "input[0].content"),
        ({"model": "m", "input": "x", "unknown\u0000key": 1}, None),
    ],
)
def test_a_nul_character_anywhere_is_400_naming_where(
    limited: Stack, backing: Servers, http: httpx.Client, body: dict[str, object], param: str | None
) -> None:
    """Postgres can hold no NUL in text or jsonb: refused up front, not a 500 after the fact."""
    before = _queued(limited, backing)
    error = _error(http.post("/responses", json={**body, "background": True}), 400)
    assert (error["param"], "NUL" in str(error["message"])) == (param, True)
    assert _queued(limited, backing) == before


def test_an_escaped_backslash_before_u0000_is_no_nul(
    limited: Stack, backing: Servers, http: httpx.Client
) -> None:
    """`\\\\u0000` in JSON is a backslash and the text "u0000": it is accepted as sent."""
    body = b'{"model": "m", "background": true, "input": "a\\\\u0000b"}'
    answer = http.post("/responses", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 200, answer.text
    items = http.get(f"/responses/{answer.json()['id']}/input_items").json()["data"]
    assert items[0]["content"][0]["text"] == "a\\u0000b"


def test_a_nul_in_the_input_items_cursor_is_400(http: httpx.Client) -> None:
    answer = http.get("/responses/resp_0123/input_items", params={"after": "msg_\u0000"})
    assert _error(answer, 400)["param"] == "after"


def test_a_stream_cursor_past_any_sequence_number_is_400(http: httpx.Client) -> None:
    """Past 2**53 - 1 no event has a number (and Redis ids end at 2**64): refused, not a broken stream."""
    answer = http.get("/responses/resp_0123", params={"stream": "true", "starting_after": str(2**53)})
    assert _error(answer, 400)["param"] == "starting_after"


def test_an_unknown_service_tier_is_400(http: httpx.Client) -> None:
    body = {"model": "m", "input": "x", "background": True, "service_tier": "gold"}
    assert _error(http.post("/responses", json=body), 400)["param"] == "service_tier"


def test_a_method_a_path_does_not_take_is_405_listing_every_method_it_takes(http: httpx.Client) -> None:
    answer = http.put("/responses/resp_0123")
    assert _error(answer, 405)["type"] == "invalid_request_error"
    assert answer.headers["allow"] == "DELETE, GET"


def test_the_openapi_document_covers_every_route(limited: Stack) -> None:
    """Every route the API answers is in /openapi.json with its answers; /metrics is not an API."""
    document = httpx.get(f"{limited.url}/openapi.json", timeout=30).json()
    served = {(method.upper(), path) for path, item in document["paths"].items() for method in item}
    assert served == {
        ("POST", "/v1/responses"),
        ("POST", "/v1/responses/input_tokens"),
        ("POST", "/v1/responses/compact"),
        ("GET", "/v1/responses/{response_id}"),
        ("DELETE", "/v1/responses/{response_id}"),
        ("POST", "/v1/responses/{response_id}/cancel"),
        ("GET", "/v1/responses/{response_id}/input_items"),
        ("GET", "/v1/models"),
        ("POST", "/v1/conversations"),
        ("GET", "/v1/conversations/{conversation_id}"),
        ("POST", "/v1/conversations/{conversation_id}"),
        ("DELETE", "/v1/conversations/{conversation_id}"),
        ("GET", "/v1/conversations/{conversation_id}/items"),
        ("POST", "/v1/conversations/{conversation_id}/items"),
        ("GET", "/v1/conversations/{conversation_id}/items/{item_id}"),
        ("DELETE", "/v1/conversations/{conversation_id}/items/{item_id}"),
        ("GET", "/healthz"),
        ("GET", "/readyz"),
    }
    create = document["paths"]["/v1/responses"]["post"]
    assert create["requestBody"]["content"]["application/json"]["schema"]["required"] == ["model", "input"]
    assert set(create["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "security" not in create  # this API has no keys; with keys, schemathesis' ignored_auth holds it


@pytest.fixture(scope="module")
def chained(backing: Servers, session_dir: Path, stack: Stack) -> Iterator[openai.OpenAI]:
    """The SDK on an API and worker of their own that continue chains of at most MAX_CHAIN responses."""
    running = own_stack(backing, session_dir, "chains", RESPOOL_MAX_CHAIN_DEPTH=str(MAX_CHAIN))
    running.start_api("api-chains")
    running.start_worker("worker-chains")
    with make_sdk(running.url, "anything") as client:
        yield client
    running.stop_all()


def test_a_chain_past_its_depth_limit_is_400_and_records_nothing(chained: openai.OpenAI) -> None:
    """Responses 0..MAX_CHAIN chain (MAX_CHAIN precede the last); one more is refused, naming
    previous_response_id; a branch from inside the chain is still fine."""
    chain = [chained.responses.create(model="synthetic", input="turn 0")]
    for turn in range(1, MAX_CHAIN + 1):
        chain.append(
            chained.responses.create(
                model="synthetic", input=f"turn {turn}", previous_response_id=chain[-1].id
            )
        )
    assert all(response.status == "completed" for response in chain)
    with pytest.raises(openai.BadRequestError) as refused:
        chained.responses.create(model="synthetic", input="one too many", previous_response_id=chain[-1].id)
    error = refused.value.body
    assert isinstance(error, dict)
    assert (error["param"], error["code"]) == ("previous_response_id", "previous_response_chain_too_long")
    branch = chained.responses.create(model="synthetic", input="a branch", previous_response_id=chain[-2].id)
    assert branch.status == "completed"
