"""The poll and the create served past the framework's routing (api/hot.py) answer as the routed
ones do: the same body, headers and errors, counted the same, under the same key's owner (issue 20).
(Every other test's creates and polls go the hot way too: the SDK sends them without a query.)"""

from __future__ import annotations

import socket

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import KEY_A, KEY_B
from tests.support.stack import Stack

pytestmark = pytest.mark.integration

ROUTE = "/v1/responses/{response_id}"


def _polls(stack: Stack, route: str = ROUTE, method: str = "GET") -> dict[str, float]:
    """A route's answers so far, by status (`respool_http_requests_total`)."""
    scrape = httpx.get(stack.url + "/metrics", timeout=10).text
    return {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(scrape)
        for sample in family.samples
        if sample.name == "respool_http_requests_total"
        and sample.labels["route"] == route
        and sample.labels["method"] == method
    }


def _get(stack: Stack, path: str, key: str | None = KEY_A) -> httpx.Response:
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    return httpx.get(stack.url + "/v1" + path, headers=headers, timeout=10)


def test_a_plain_poll_answers_as_the_routed_one(stack: Stack, client: openai.OpenAI) -> None:
    """`GET /v1/responses/{id}` (served past the framework) and the same with `?stream=false` (a
    query: routed) answer the same JSON with the same headers, each its own request id, and both
    count as the route's answers."""
    created = client.responses.create(model="synthetic", input="polled twice")
    before = _polls(stack).get("200", 0.0)
    plain, routed = (
        _get(stack, f"/responses/{created.id}"),
        _get(stack, f"/responses/{created.id}?stream=false"),
    )
    assert plain.status_code == routed.status_code == 200
    assert orjson.loads(plain.content) == orjson.loads(routed.content)
    assert plain.json()["id"] == created.id and plain.json()["status"] == "completed"
    assert sorted(plain.headers) == sorted(routed.headers)
    assert plain.headers["content-type"] == routed.headers["content-type"] == "application/json"
    assert (
        plain.headers["x-request-id"].startswith("req_")
        and plain.headers["x-request-id"] != routed.headers["x-request-id"]
    )
    assert _polls(stack)["200"] == before + 2
    assert client.responses.retrieve(created.id).output_text == created.output_text  # the SDK's own


@pytest.mark.parametrize(
    ("key", "status", "code"),
    [(None, 401, "invalid_api_key"), ("sk-not-a-key", 401, "invalid_api_key"), (KEY_B, 404, None)],
    ids=["no-key", "bad-key", "other-owner"],
)
def test_a_plain_poll_refused_says_why_as_the_routed_one(
    stack: Stack, client: openai.OpenAI, key: str | None, status: int, code: str | None
) -> None:
    """A poll without a key, with a wrong one, or of another owner's response is refused with the
    same OpenAI error either way, counted by its status."""
    created = client.responses.create(model="synthetic", input="not yours")
    before = _polls(stack).get(str(status), 0.0)
    plain = _get(stack, f"/responses/{created.id}", key)
    routed = _get(stack, f"/responses/{created.id}?stream=false", key)
    assert plain.status_code == routed.status_code == status
    assert plain.json() == routed.json()
    assert plain.json()["error"]["code"] == (code or plain.json()["error"]["code"])
    assert "x-request-id" in plain.headers
    assert _polls(stack)[str(status)] == before + 2


def test_a_malformed_id_takes_the_routed_way_and_its_400_names_it(stack: Stack) -> None:
    answer = _get(stack, "/responses/not-an-id")
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "response_id"


def _post(
    stack: Stack, body: bytes, query: str = "", key: str | None = KEY_A, **headers: str
) -> httpx.Response:
    sent = {"content-type": "application/json", **headers}
    if key is not None:
        sent["authorization"] = f"Bearer {key}"
    return httpx.post(stack.url + "/v1/responses" + query, content=body, headers=sent, timeout=30)


def test_a_create_answers_as_the_routed_one(stack: Stack) -> None:
    """A create (served past the routing) and one with a query the route ignores (routed) answer
    alike: the same headers, a Response each, both counted as the route's answers."""
    body = orjson.dumps({"model": "synthetic", "input": "created twice", "background": True})
    before = _polls(stack, "/v1/responses", "POST").get("200", 0.0)
    hot, routed = _post(stack, body), _post(stack, body, "?routed=1")
    assert hot.status_code == routed.status_code == 200
    assert sorted(hot.headers) == sorted(routed.headers)
    assert hot.headers["content-type"] == routed.headers["content-type"] == "application/json"
    assert hot.headers["x-request-id"] != routed.headers["x-request-id"]
    made, also = hot.json(), routed.json()
    assert made["status"] == also["status"] == "queued"
    assert {**made, "id": "", "created_at": 0} == {**also, "id": "", "created_at": 0}
    assert _polls(stack, "/v1/responses", "POST")["200"] == before + 2


@pytest.mark.parametrize(
    ("case", "status"),
    [("no-key", 401), ("not-json", 400), ("too-large", 413), ("bad-parameter", 400)],
)
def test_a_create_refused_says_why_as_the_routed_one(stack: Stack, case: str, status: int) -> None:
    """A create without a key, with a body that is not JSON, one declared past the body limit, or
    one with a parameter out of range is refused with the same OpenAI error either way, counted alike."""
    body = orjson.dumps(
        {"model": "synthetic", "input": "x", **({"temperature": 9} if case == "bad-parameter" else {})}
    )
    key: str | None = None if case == "no-key" else KEY_A
    if case == "not-json":
        body = b"{not json"
    headers = {"content-length": str(10**9)} if case == "too-large" else {}
    # Refused on its declared length before any route is matched: counted as unmatched either way.
    label = "unmatched" if case == "too-large" else "/v1/responses"
    before = _polls(stack, label, "POST").get(str(status), 0.0)
    if case == "too-large":  # declared, not sent: refused on its header alone
        answers = [_declared_too_large(stack, query) for query in ("", "?routed=1")]
    else:
        answers = [_post(stack, body, query, key, **headers) for query in ("", "?routed=1")]
    hot, routed = answers
    assert hot.status_code == routed.status_code == status
    assert hot.json() == routed.json()
    assert "x-request-id" in hot.headers
    assert _polls(stack, label, "POST")[str(status)] == before + 2


def _declared_too_large(stack: Stack, query: str) -> httpx.Response:
    """A create whose declared length is past the body limit, its body not sent (raw HTTP/1.1:
    clients refuse to declare what they do not send)."""
    host, port = stack.url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/responses{query} HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {KEY_A}\r\n"
        f"content-type: application/json\r\ncontent-length: {10**9}\r\nconnection: close\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    raw_headers, _, content = rest.partition(b"\r\n\r\n")
    headers = [tuple(line.decode().split(": ", 1)) for line in raw_headers.split(b"\r\n")]
    return httpx.Response(int(status_line.split()[1]), headers=headers, content=content)
