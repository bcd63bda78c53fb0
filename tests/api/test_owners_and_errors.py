"""Owners, auth and errors: every route's answer to another owner, bad keys and bad input (PROTOCOL.md §5.4, §5.6)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from fastapi.routing import APIRoute

from api.routes import router
from tests.conftest import KEY_B
from tests.support.faults import wait_until_ended
from tests.support.queue import QueueView
from tests.support.stack import Stack, wait_for
from tests.support.upstream_process import ScriptedUpstream
from worker.ids import new_id

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Probe:
    """A request naming a response by id, in its path (`{response_id}`) or as `previous_response_id`."""

    name: str
    method: str
    route: str  # the route's template, as /openapi.json lists it
    params: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] | None = None

    @property
    def status(self) -> int:
        """What it answers for an id that names nothing (PROTOCOL.md §5.4)."""
        return 400 if self.body is not None else 404

    def send(self, http: httpx.Client, key: str, response_id: str) -> httpx.Response:
        path = self.route.replace("{response_id}", response_id)
        body = None if self.body is None else {**self.body, "previous_response_id": response_id}
        headers = {"authorization": f"Bearer {key}"}
        return http.request(self.method, path, params=self.params, json=body, headers=headers)


ONE = "/v1/responses/{response_id}"
CREATE = {"model": "synthetic", "input": "x"}
# Every path to a response, by route. A route under /v1 that is neither here nor in OWNERLESS fails
# test_every_route_is_probed, so a new one cannot be forgotten.
PROBES = [
    Probe("retrieve", "GET", ONE),
    Probe("stream", "GET", ONE, {"stream": "true"}),
    Probe("replay", "GET", ONE, {"stream": "true", "starting_after": "1"}),
    Probe("cancel", "POST", ONE + "/cancel"),
    Probe("delete", "DELETE", ONE),
    Probe("input_items", "GET", ONE + "/input_items"),
    Probe("input_items page", "GET", ONE + "/input_items", {"order": "asc", "limit": "1", "after": "msg_1"}),
    Probe("previous_response_id", "POST", "/v1/responses", body=CREATE),
    Probe("previous_response_id streamed", "POST", "/v1/responses", body={**CREATE, "stream": True}),
    Probe("previous_response_id background", "POST", "/v1/responses", body={**CREATE, "background": True}),
    Probe("input_tokens previous_response_id", "POST", "/v1/responses/input_tokens", body=CREATE),
    Probe("compact previous_response_id", "POST", "/v1/responses/compact", body=CREATE),
]
# Routes that name no response: the same answer for every owner.
OWNERLESS = {("GET", "/v1/models"), ("POST", "/v1/conversations")}
# Routes that name a conversation: tests/api/test_conversations.py sends each another owner's id.
CONVERSATION = "/v1/conversations/{conversation_id}"
CONVERSATION_ROUTES = {
    ("GET", CONVERSATION),
    ("POST", CONVERSATION),
    ("DELETE", CONVERSATION),
    ("GET", CONVERSATION + "/items"),
    ("POST", CONVERSATION + "/items"),
    ("GET", CONVERSATION + "/items/{item_id}"),
    ("DELETE", CONVERSATION + "/items/{item_id}"),
}


@pytest.fixture(scope="module")
def owned(client: openai.OpenAI, upstream: ScriptedUpstream) -> Iterator[dict[str, str]]:
    """Tenant A's responses, by state: one completed, and one live (its upstream never answers)."""
    model = f"owned-{uuid.uuid4().hex[:8]}"
    upstream.script(f"{model}-hung", {"hang": True})
    completed = client.responses.create(model=model, input="mine", background=True).id
    live = client.responses.create(model=f"{model}-hung", input="mine", background=True).id
    wait_until_ended(client, [completed], timeout=30)
    wait_for(lambda: client.responses.retrieve(live).status == "in_progress", what="the live one to start")
    yield {"completed": completed, "live": live}
    client.responses.cancel(live)


def test_every_route_is_probed(stack: Stack) -> None:
    """Every route under /v1, as the API's /openapi.json lists it or its router holds it (one left out
    of the schema too), is probed below, or names no response at all."""
    paths = httpx.get(stack.url + "/openapi.json").json()["paths"]
    listed = {
        (method.upper(), path) for path, ops in paths.items() if path.startswith("/v1") for method in ops
    }
    held = {
        (method, route.path_format)
        for route in router.routes
        if isinstance(route, APIRoute)
        for method in route.methods
    }
    assert (
        listed | held == {(probe.method, probe.route) for probe in PROBES} | OWNERLESS | CONVERSATION_ROUTES
    )


def _seen(answer: httpx.Response, response_id: str) -> tuple[int, dict[str, str], str]:
    """What a caller can tell from an answer, the id it asked about and per-request headers aside."""
    headers = {name: value for name, value in answer.headers.items() if name not in {"date", "x-request-id"}}
    return answer.status_code, headers, answer.text.replace(response_id, "<id>")


def _state(client: openai.OpenAI, response_id: str) -> tuple[Any, ...]:
    """Tenant A's view of its response: status, event types, input items."""
    response = client.responses.retrieve(response_id)
    events = (
        [] if response.status == "in_progress" else list(client.responses.retrieve(response_id, stream=True))
    )
    items = [item.id for item in client.responses.input_items.list(response_id)]
    return response.status, [event.type for event in events], items


@pytest.mark.parametrize("state", ["completed", "live"])
@pytest.mark.parametrize("probe", PROBES, ids=lambda probe: probe.name)
def test_another_owners_response_is_indistinguishable_from_none(
    stack: Stack, client: openai.OpenAI, owned: dict[str, str], probe: Probe, state: str
) -> None:
    """With tenant B's key, A's response gets exactly the answer a guessed id that names nothing
    gets (404, or 400 previous_response_not_found): same status, headers and body but for the id.
    A's response is as it was."""
    response_id = owned[state]
    before = _state(client, response_id)
    guessed = new_id("resp")
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        theirs = probe.send(http, KEY_B, response_id)
        nothing = probe.send(http, KEY_B, guessed)
    assert theirs.status_code == probe.status, theirs.text
    assert _seen(theirs, response_id) == _seen(nothing, guessed)
    error = theirs.json()["error"]
    if probe.body is None:
        assert (error["type"], error["param"]) == ("invalid_request_error", "response_id")
    else:
        assert (error["code"], error["param"]) == ("previous_response_not_found", "previous_response_id")
    assert _state(client, response_id) == before


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
    ({"model": "m", "input": "x", "tools": [{"type": "web_surf"}]}, "tools[0].type", None),
    ({"model": "m", "input": "x", "tools": [{"name": "f"}]}, "tools[0].type", None),
    ({"model": "m", "input": "x", "conversation": {"name": "c"}}, "conversation", "invalid_value"),
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
    queue_only: Stack, open_client: openai.OpenAI, queue_view: Callable[[Stack], QueueView]
) -> None:
    """A response cancelled while queued leaves the queue (nothing of it is held there) and ends its stream."""
    client = open_client
    created = client.responses.create(model="synthetic", input="x", background=True)
    queue = queue_view(queue_only)
    assert created.id in queue.waiting() and queue.held()[created.id] == float("inf")
    assert client.responses.cancel(created.id).status == "cancelled"
    assert created.id not in queue.waiting() and created.id not in queue.held()
    events = list(client.responses.retrieve(created.id, stream=True))
    assert [e.type for e in events] == ["response.created", "response.queued", "response.failed"]
    assert events[-1].response.status == "cancelled"
