"""The poll served past the framework (api/polls.py) answers as the routed one does: the same body,
headers and errors, counted the same, under the same key's owner (issue 20)."""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import KEY_A, KEY_B
from tests.support.stack import Stack

pytestmark = pytest.mark.integration

ROUTE = "/v1/responses/{response_id}"


def _polls(stack: Stack) -> dict[str, float]:
    """The routed poll's answers so far, by status (`respool_http_requests_total`)."""
    scrape = httpx.get(stack.url + "/metrics", timeout=10).text
    return {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(scrape)
        for sample in family.samples
        if sample.name == "respool_http_requests_total"
        and sample.labels["route"] == ROUTE
        and sample.labels["method"] == "GET"
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
