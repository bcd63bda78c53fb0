"""Owners, auth and errors: every route's answer to another owner, bad keys and bad input (PROTOCOL.md §5.4, §5.6)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from tests.support.stack import Stack

pytestmark = pytest.mark.integration

ROUTES: dict[str, Callable[[openai.OpenAI, str], Any]] = {
    "retrieve": lambda c, rid: c.responses.retrieve(rid),
    "stream": lambda c, rid: list(c.responses.retrieve(rid, stream=True)),
    "cancel": lambda c, rid: c.responses.cancel(rid),
    "delete": lambda c, rid: c.responses.delete(rid),
    "input_items": lambda c, rid: c.responses.input_items.list(rid),
}


@pytest.mark.parametrize("route", ROUTES)
def test_another_owner_sees_nothing(
    client: openai.OpenAI, other_client: openai.OpenAI, model: str, route: str
) -> None:
    """Every route answers 404 to a key of another owner, and the response is untouched."""
    response = client.responses.create(model=model, input="mine", background=True)
    with pytest.raises(openai.NotFoundError):
        ROUTES[route](other_client, response.id)
    assert client.responses.retrieve(response.id).id == response.id


def test_another_owner_cannot_chain(client: openai.OpenAI, other_client: openai.OpenAI, model: str) -> None:
    """previous_response_id of another owner's response is a 400 previous_response_not_found."""
    response = client.responses.create(model=model, input="mine")
    with pytest.raises(openai.BadRequestError) as caught:
        other_client.responses.create(model=model, input="x", previous_response_id=response.id)
    assert caught.value.code == "previous_response_not_found"


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_bad_keys_are_401(stack: Stack, key: str | None) -> None:
    """A missing or unknown bearer key is a 401 in OpenAI's envelope, with an x-request-id."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    answer = httpx.post(
        stack.url + "/v1/responses", json={"model": "synthetic", "input": "x"}, headers=headers
    )
    assert answer.status_code == 401
    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    assert answer.headers["x-request-id"].startswith("req_")


BAD_BODIES = [
    ({"input": "x"}, "model", "missing_required_parameter"),
    ({"model": "m"}, "input", "missing_required_parameter"),
    ({"model": "m", "input": "x", "temperature": 3}, "temperature", "invalid_value"),
    ({"model": "m", "input": "x", "temperature": "hot"}, "temperature", "invalid_value"),
    (
        {"model": "m", "input": "x", "metadata": {f"k{n}": "v" for n in range(17)}},
        "metadata",
        "invalid_value",
    ),
    ({"model": "m", "input": "x", "metadata": {"k": "v" * 513}}, "metadata", "invalid_value"),
    ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input[0].role", "invalid_value"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0]", None),
    ({"model": "m", "input": "x", "conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    (
        {"model": "m", "input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
        "input[0]",
        "invalid_value",
    ),
]


@pytest.mark.parametrize(("body", "param", "code"), BAD_BODIES)
def test_bad_requests_are_400_naming_the_param(
    stack: Stack, body: dict[str, Any], param: str, code: str | None
) -> None:
    """Each malformed create is a 400 invalid_request_error naming the offending `param`."""
    from tests.conftest import KEY_A

    answer = httpx.post(stack.url + "/v1/responses", json=body, headers={"authorization": f"Bearer {KEY_A}"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    if code is not None:
        assert error["code"] == code


def test_invalid_json_is_400(stack: Stack) -> None:
    """A body that is not JSON (or not UTF-8) is a 400, not a 500."""
    from tests.conftest import KEY_A

    for content in (b"{not json", b"\xff\xfe"):
        answer = httpx.post(
            stack.url + "/v1/responses", content=content, headers={"authorization": f"Bearer {KEY_A}"}
        )
        assert answer.status_code == 400
        assert answer.json()["error"]["type"] == "invalid_request_error"


def test_unknown_response_is_404(client: openai.OpenAI) -> None:
    """An id that names no response is a 404 on `response_id`."""
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve("resp_nothing_here")
    assert caught.value.param == "response_id"


def test_no_keys_means_open_and_says_so(queue_only: Stack, open_client: openai.OpenAI) -> None:
    """Without RESPOOL_API_KEYS the API serves anyone, and warns loudly at start."""
    assert open_client.responses.create(model="synthetic", input="x", background=True).status == "queued"
    assert "NO AUTHENTICATION" in queue_only.log("api-queue-only")


def test_unrouted_model_is_404(open_client: openai.OpenAI) -> None:
    """With no pass-through upstream, a model that is not routed is a 404 model_not_found."""
    with pytest.raises(openai.NotFoundError) as caught:
        open_client.responses.create(model="no-such-model", input="x")
    assert (caught.value.code, caught.value.param) == ("model_not_found", "model")


def test_cancel_while_queued_never_reaches_a_worker(
    queue_only: Stack, open_client: openai.OpenAI, rq_queue: Callable[[Stack], Queue]
) -> None:
    """A response cancelled while queued leaves the queue, ends its stream, and its job is cancelled."""
    client = open_client
    created = client.responses.create(model="synthetic", input="x", background=True)
    queue = rq_queue(queue_only)
    assert created.id in queue.job_ids
    assert client.responses.cancel(created.id).status == "cancelled"
    assert created.id not in queue.job_ids
    job = Job.fetch(created.id, connection=queue.connection, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.CANCELED
    events = list(client.responses.retrieve(created.id, stream=True))
    assert [e.type for e in events] == ["response.created", "response.queued", "response.failed"]
    assert events[-1].response.status == "cancelled"
