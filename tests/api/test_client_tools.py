"""Tools the client runs, in the shapes agent clients send them (issue 17), through the real API, a
real worker and the scripted upstream: Codex CLI's `namespace` groups, `custom` tools, and server-side
tools this deployment has no backend for (left out and named, or refused when the operator says so).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import KEY_A, own_stack
from tests.support.stack import Servers, Stack
from tests.support.upstream_process import ScriptedUpstream

pytestmark = pytest.mark.integration

# Captured from Codex CLI 0.169 (shared/fixtures), kept here so a clean clone has it.
CODEX_REQUEST = Path(__file__).resolve().parent / "fixtures" / "codex-0.169-first-request.json"
AGENTS = {
    "type": "namespace",
    "name": "agents",
    "description": "Sub-agents.",
    "tools": [
        {"type": "function", "name": "spawn", "parameters": {"type": "object", "properties": {}}},
        {"type": "custom", "name": "note", "description": "A note to self."},
    ],
}
PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
}


def tool_call(index: int, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    call = {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
    return {"delta": {"tool_calls": [call]}}


def test_namespaced_and_custom_calls_round_trip(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """The upstream is offered `agents__spawn` and `apply_patch` (one string argument); its calls come
    back as a namespaced `function_call` and a `custom_tool_call`; their outputs continue the chain."""
    calls = [
        tool_call(0, "call_s", "agents__spawn", '{"task": "tests"}'),
        tool_call(1, "call_p", "apply_patch", json.dumps({"input": "*** Begin Patch\n*** End Patch"})),
        {"delta": {}, "finish_reason": "tool_calls"},
    ]
    upstream.script(model, {"chunks": calls, "times": 1, "then": {"text": "Both done."}})
    with client.responses.stream(model=model, input="go", tools=[AGENTS, PATCH]) as stream:  # type: ignore[list-item]
        kinds = [event.type for event in stream]
        first = stream.get_final_response()
    assert "response.custom_tool_call_input.done" in kinds
    spawn, patch = first.output
    assert (spawn.type, spawn.name, spawn.namespace, spawn.arguments) == (  # type: ignore[union-attr]
        "function_call",
        "spawn",
        "agents",
        '{"task": "tests"}',
    )
    assert (patch.type, patch.name, patch.input) == (  # type: ignore[union-attr]
        "custom_tool_call",
        "apply_patch",
        "*** Begin Patch\n*** End Patch",
    )
    offered = upstream.requests(model)[0]["tools"]
    assert [tool["function"]["name"] for tool in offered] == ["agents__spawn", "agents__note", "apply_patch"]
    assert offered[2]["function"]["parameters"]["required"] == ["input"]
    assert "start: /.+/" in offered[2]["function"]["description"]

    outputs = [
        {"type": "function_call_output", "call_id": "call_s", "output": "spawned"},
        {"type": "custom_tool_call_output", "call_id": "call_p", "output": "patched"},
    ]
    second = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input=outputs,
        tools=[AGENTS, PATCH],  # type: ignore[arg-type, list-item]
    )
    assert second.output_text == "Both done."
    messages = upstream.requests(model)[1]["messages"]
    assistant = next(message for message in messages if message["role"] == "assistant")
    assert [call["function"]["name"] for call in assistant["tool_calls"]] == ["agents__spawn", "apply_patch"]
    assert json.loads(assistant["tool_calls"][1]["function"]["arguments"]) == {
        "input": "*** Begin Patch\n*** End Patch"
    }
    assert [(m["tool_call_id"], m["content"]) for m in messages if m["role"] == "tool"] == [
        ("call_s", "spawned"),
        ("call_p", "patched"),
    ]
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [item.type for item in listed.data][-2:] == ["function_call_output", "custom_tool_call_output"]


def test_a_custom_call_output_without_its_call_is_a_400(client: openai.OpenAI, model: str) -> None:
    """As for function calls: an output must follow its call."""
    orphan = {"type": "custom_tool_call_output", "call_id": "call_nope", "output": "x"}
    with pytest.raises(openai.BadRequestError, match="No tool call found for custom tool call output"):
        client.responses.create(model=model, input=[orphan])  # type: ignore[list-item]


SERVER_SIDE = [
    {"type": "web_search"},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}},
]


@pytest.mark.parametrize("is_stream", [False, True])
def test_tools_this_deployment_cannot_run_are_left_out_and_named(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str, is_stream: bool
) -> None:
    """By default a server-side tool with no backend here is not offered to the model, and the
    Response names it (`unavailable_tools`), as created, streamed and retrieved."""
    upstream.script(model, {"text": "No search here."})
    if is_stream:
        with client.responses.stream(model=model, input="search", tools=SERVER_SIDE) as stream:  # type: ignore[arg-type]
            events = list(stream)
        created = events[0].response  # type: ignore[union-attr]
        response = stream.get_final_response()
    else:
        response = created = client.responses.create(model=model, input="search", tools=SERVER_SIDE)  # type: ignore[arg-type]
    left_out = [{"type": "web_search", "reason": "this server has no backend for 'web_search' tools"}]
    left_out.append(
        {"type": "code_interpreter", "reason": "this server has no backend for 'code_interpreter' tools"}
    )
    assert created.unavailable_tools == left_out  # type: ignore[attr-defined]
    assert response.output_text == "No search here."
    assert [tool.type for tool in response.tools] == ["web_search", "code_interpreter", "function"]
    assert client.responses.retrieve(response.id).unavailable_tools == left_out  # type: ignore[attr-defined]
    offered = upstream.requests(model)[0]["tools"]
    assert [tool["function"]["name"] for tool in offered] == ["get_time"]


def test_a_tool_choice_forcing_an_unavailable_tool_is_a_400(client: openai.OpenAI, model: str) -> None:
    """Left out, the tool cannot be forced: the request is refused rather than answered without it."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model=model,
            input="q",
            tools=SERVER_SIDE,
            tool_choice={"type": "web_search"},  # type: ignore[arg-type, typeddict-item]
        )
    assert refused.value.body["param"] == "tool_choice"  # type: ignore[index]


@pytest.fixture(scope="module")
def rejecting(backing: Servers, session_dir: Path, stack: Stack, upstream: ScriptedUpstream) -> Any:
    """An API whose operator set RESPOOL_UNAVAILABLE_TOOLS=reject (no worker: nothing gets queued)."""
    running = own_stack(
        backing,
        session_dir,
        "reject-tools",
        RESPOOL_UNAVAILABLE_TOOLS="reject",
        RESPOOL_UPSTREAM_URL=upstream.url,
        RESPOOL_UPSTREAM_API="chat",
    )
    running.start_api("api-reject-tools")
    yield running
    running.stop_all()


def test_reject_refuses_an_unavailable_tool_naming_it(rejecting: Stack, model: str) -> None:
    sdk = openai.OpenAI(base_url=rejecting.url + "/v1", api_key="any", max_retries=0)
    with sdk, pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(model=model, input="q", tools=SERVER_SIDE)  # type: ignore[arg-type]
    assert refused.value.body["param"] == "tools[0]"  # type: ignore[index]
    assert "'web_search'" in refused.value.body["message"]  # type: ignore[index]
    assert "RESPOOL_UNAVAILABLE_TOOLS" in refused.value.body["message"]  # type: ignore[index]


def test_codex_clis_first_request_is_answered(stack: Stack, upstream: ScriptedUpstream, model: str) -> None:
    """The body Codex CLI 0.169 sent (captured, headers and all) is accepted by a default respool and
    streamed an answer: its `multi_agent_v1` namespace offered as functions, its `web_search` left out."""
    captured = json.loads(CODEX_REQUEST.read_text(encoding="utf-8"))
    body = {**captured["body"], "model": model}
    headers = {
        name: value
        for name, value in captured["headers"].items()
        if name not in ("host", "content-length", "authorization")
    }
    upstream.script(model, {"text": "Hello from the model."})
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        answer = http.post(
            "/v1/responses", json=body, headers={**headers, "authorization": f"Bearer {KEY_A}"}
        )
    assert answer.status_code == 200, answer.text
    events = [
        json.loads(line.removeprefix("data: "))
        for line in answer.text.splitlines()
        if line.startswith("data: ")
    ]
    final = events[-1]
    assert final["type"] == "response.completed", final
    assert final["response"]["unavailable_tools"] == [
        {"type": "web_search", "reason": "this server has no backend for 'web_search' tools"}
    ]
    assert (
        "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        == "Hello from the model."
    )
    offered = [tool["function"]["name"] for tool in upstream.requests(model)[0]["tools"]]
    assert "multi_agent_v1__spawn_agent" in offered and "exec_command" in offered
    assert len(offered) == 12
