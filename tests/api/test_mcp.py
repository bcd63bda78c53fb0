"""Remote MCP through the tool loop (issue 17): a real MCP server (the `mcp` package's, Streamable
HTTP on loopback), the scripted upstream's tool-loop model, real respool processes, the `openai` SDK."""

from __future__ import annotations

import socket
from typing import Any

import openai
import pytest

from tests.conftest import MCP_TOKEN, NATIVE_MODEL, REGISTERED_LABEL
from tests.support.stack import Stack
from tests.support.tool_servers import McpServerProcess
from tests.support.upstream_process import ScriptedUpstream

pytestmark = pytest.mark.integration


def mcp_tool(server: McpServerProcess, label: str = "tools", **extra: Any) -> dict[str, Any]:
    return {
        "type": "mcp",
        "server_label": label,
        "server_url": server.url,
        "require_approval": "never",
        **extra,
    }


@pytest.mark.parametrize("is_stream", [False, True])
def test_list_call_and_answer(
    client: openai.OpenAI,
    upstream: ScriptedUpstream,
    mcp_server: McpServerProcess,
    model: str,
    is_stream: bool,
) -> None:
    """The server is listed, the model's call of `lookup` runs on it, and the model answers with its result."""
    upstream.script(model, {"tool_loop": {"tool": "lookup"}})
    tools = [mcp_tool(mcp_server, allowed_tools=["lookup", "add"])]
    if is_stream:
        with client.responses.stream(model=model, input="weather?", tools=tools) as stream:  # type: ignore[list-item]
            kinds = [event.type for event in stream]
            response = stream.get_final_response()
        assert kinds.index("response.mcp_list_tools.completed") < kinds.index("response.mcp_call.in_progress")
        assert kinds.index("response.mcp_call_arguments.done") < kinds.index("response.mcp_call.completed")
    else:
        response = client.responses.create(model=model, input="weather?", tools=tools)  # type: ignore[arg-type]
    listing, call, _ = response.output
    assert listing.type == "mcp_list_tools" and [t.name for t in listing.tools] == ["lookup", "add"]  # type: ignore[union-attr]
    assert (call.type, call.name, call.server_label, call.output) == (  # type: ignore[union-attr]
        "mcp_call",
        "lookup",
        "tools",
        "Sunny in Paris, 21C.",
    )
    assert response.output_text == "The tool said: Sunny in Paris, 21C."
    offered = [tool["function"]["name"] for tool in upstream.requests(model)[0]["tools"]]
    assert offered == ["mcp__tools__lookup", "mcp__tools__add"]
    second = upstream.requests(model)[1]["messages"]
    assert second[-1] == {"role": "tool", "tool_call_id": call.id, "content": "Sunny in Paris, 21C."}


def test_a_responses_upstream_runs_the_same_loop(
    client: openai.OpenAI, upstream: ScriptedUpstream, mcp_server: McpServerProcess
) -> None:
    """On a Responses upstream respool runs the loop too (DESIGN.md §10): the server's tools are
    offered as function tools, the model's call comes back as an `mcp_call` respool runs, and the
    next turn is sent it as a `function_call` and its `function_call_output`; an approval waits, and
    the chain carries the call on."""
    upstream.script(
        NATIVE_MODEL, {"times": 3, "tool_loop": {"tools": ["lookup", "add"], "steps": 2}, "then": {}}
    )
    before = len(upstream.requests(NATIVE_MODEL))
    approval = {"never": {"tool_names": ["lookup"]}}
    tools = [mcp_tool(mcp_server, allowed_tools=["lookup", "add"], require_approval=approval)]
    with client.responses.stream(model=NATIVE_MODEL, input="weather?", tools=tools) as stream:  # type: ignore[arg-type]
        kinds = [event.type for event in stream]
        first = stream.get_final_response()
    last_added = max(i for i, kind in enumerate(kinds) if kind == "response.output_item.added")
    assert kinds.index("response.mcp_call.completed") < last_added  # the approval request's turn is after
    listing, call, asked = first.output
    assert (listing.type, call.type, asked.type) == ("mcp_list_tools", "mcp_call", "mcp_approval_request")
    assert (call.name, call.output, asked.name) == ("lookup", "Sunny in Paris, 21C.", "add")  # type: ignore[union-attr]
    sent = upstream.requests(NATIVE_MODEL)[before:]
    assert [tool["name"] for tool in sent[0]["tools"]] == ["mcp__tools__lookup", "mcp__tools__add"]
    assert all(tool["type"] == "function" for tool in sent[0]["tools"])
    call_sent, result_sent = sent[1]["input"][-2:]
    assert (call_sent["type"], call_sent["name"], call_sent["call_id"]) == (
        "function_call",
        "mcp__tools__lookup",
        call.id,
    )
    assert result_sent == {
        "type": "function_call_output",
        "call_id": call.id,
        "output": "Sunny in Paris, 21C.",
    }
    answer = {"type": "mcp_approval_response", "approval_request_id": asked.id, "approve": True}
    second = client.responses.create(
        model=NATIVE_MODEL,
        previous_response_id=first.id,
        input=[answer],
        tools=tools,  # type: ignore[arg-type, list-item]
    )
    assert [item.type for item in second.output] == ["mcp_call", "message"]
    assert second.output_text == "The tool said: 4"
    last = upstream.requests(NATIVE_MODEL)[-1]["input"]
    assert [item["type"] for item in last if item["type"].startswith("function")] == [
        "function_call",
        "function_call_output",
    ] * 2


def test_the_older_sse_transport(
    client: openai.OpenAI, upstream: ScriptedUpstream, mcp_server: McpServerProcess, model: str
) -> None:
    """A server_url ending in /sse is spoken to over the HTTP+SSE transport."""
    mcp_server.reset()
    upstream.script(model, {"tool_loop": {"tool": "add"}})
    tool = mcp_tool(mcp_server, "legacy", server_url=mcp_server.url.removesuffix("/mcp") + "/sse")
    response = client.responses.create(model=model, input="q", tools=[tool])  # type: ignore[list-item]
    assert response.output_text == "The tool said: 4", response.error
    assert mcp_server.calls() == {"add": [{"a": 2, "b": 2}]}


def test_a_tool_without_parameters(
    client: openai.OpenAI, upstream: ScriptedUpstream, mcp_server: McpServerProcess, model: str
) -> None:
    """A tool whose schema has no parameters is called with `{}` (what a real llama.cpp server,
    forced to call one, sends) and its result reaches the model."""
    upstream.script(model, {"tool_loop": {"tool": "ping"}})
    response = client.responses.create(
        model=model, input="q", tools=[mcp_tool(mcp_server, allowed_tools=["ping"])]
    )  # type: ignore[list-item]
    call = response.output[1]
    assert (call.type, call.arguments, call.output) == ("mcp_call", "{}", "pong")  # type: ignore[union-attr]
    assert response.output_text == "The tool said: pong"


def test_a_failing_tool_is_an_error_the_model_sees(
    client: openai.OpenAI, upstream: ScriptedUpstream, mcp_server: McpServerProcess, model: str
) -> None:
    upstream.script(model, {"tool_loop": {"tool": "explode"}})
    response = client.responses.create(model=model, input="go", tools=[mcp_tool(mcp_server)])  # type: ignore[list-item]
    call = response.output[1]
    assert call.type == "mcp_call" and call.error is not None and call.output is None  # type: ignore[union-attr]
    assert response.status == "completed"
    assert response.output_text.startswith("The tool said: Error:")


def test_approval_round_trip(
    client: openai.OpenAI, upstream: ScriptedUpstream, mcp_server: McpServerProcess, model: str
) -> None:
    """By default a call waits for approval: the response ends with an `mcp_approval_request`; an
    `mcp_approval_response` continuing the chain runs it, and the model answers; the listing is reused."""
    mcp_server.reset()
    upstream.script(model, {"tool_loop": {"tool": "add"}})
    tools = [{**mcp_tool(mcp_server), "require_approval": "always"}]
    first = client.responses.create(model=model, input="add", tools=tools)  # type: ignore[arg-type]
    asked = first.output[-1]
    assert asked.type == "mcp_approval_request" and asked.name == "add"  # type: ignore[union-attr]
    assert mcp_server.calls().get("add", []) == []
    answer = {"type": "mcp_approval_response", "approval_request_id": asked.id, "approve": True}
    second = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[answer],
        tools=tools,  # type: ignore[arg-type, list-item]
    )
    assert [item.type for item in second.output] == ["mcp_call", "message"]
    assert second.output[0].approval_request_id == asked.id  # type: ignore[union-attr]
    assert second.output[0].output == "4"  # type: ignore[union-attr]
    assert second.output_text == "The tool said: 4"


def test_a_server_that_needs_a_token(
    client: openai.OpenAI, upstream: ScriptedUpstream, guarded_server: McpServerProcess, model: str
) -> None:
    """Without its token the response fails naming the server; with `headers` it works, and the
    token is in no stored row or event."""
    upstream.script(model, {"tool_loop": {"tool": "lookup"}})
    refused = client.responses.create(model=model, input="q", tools=[mcp_tool(guarded_server, "locked")])  # type: ignore[list-item]
    assert refused.status == "failed" and refused.error is not None
    assert "'locked'" in refused.error.message and "401" in refused.error.message
    tool = mcp_tool(guarded_server, "locked", headers={"Authorization": f"Bearer {MCP_TOKEN}"})
    done = client.responses.create(model=model, input="q", tools=[tool])  # type: ignore[list-item]
    assert done.output_text == "The tool said: Sunny in Paris, 21C."
    assert MCP_TOKEN not in client.responses.retrieve(done.id).model_dump_json()
    with client.responses.retrieve(done.id, stream=True) as replay:
        assert all(MCP_TOKEN not in event.model_dump_json() for event in replay)
    # `authorization` (OpenAI's field for an OAuth access token) is sent as a bearer token alike.
    by_field = mcp_tool(guarded_server, "locked", authorization=MCP_TOKEN)
    also = client.responses.create(model=model, input="q", tools=[by_field])  # type: ignore[list-item]
    assert also.output_text == "The tool said: Sunny in Paris, 21C."
    assert MCP_TOKEN not in client.responses.retrieve(also.id).model_dump_json()


def test_max_tool_calls_ends_the_loop(
    client: openai.OpenAI, upstream: ScriptedUpstream, mcp_server: McpServerProcess, model: str
) -> None:
    upstream.script(model, {"tool_loop": {"tool": "lookup", "steps": 5}})
    response = client.responses.create(model=model, input="q", tools=[mcp_tool(mcp_server)], max_tool_calls=2)  # type: ignore[list-item]
    assert [item.type for item in response.output].count("mcp_call") == 2
    assert response.output_text == "The tool said: Sunny in Paris, 21C."


def test_a_loopback_url_is_refused_without_the_allowlist(queue_only: Stack) -> None:
    tool = {"type": "mcp", "server_label": "x", "server_url": "http://127.0.0.1:9/mcp"}
    sdk = openai.OpenAI(base_url=queue_only.url + "/v1", api_key="any", max_retries=0)
    with sdk, pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(model="synthetic", input="q", tools=[tool])  # type: ignore[list-item]
    assert refused.value.body["param"] == "tools[0].server_url"  # type: ignore[index]
    assert "RESPOOL_OUTBOUND_ALLOWLIST" in refused.value.body["message"]  # type: ignore[index]


def test_an_operator_registered_server_needs_only_its_label(
    client: openai.OpenAI,
    upstream: ScriptedUpstream,
    guarded_server: McpServerProcess,
    mcp_server: McpServerProcess,
    model: str,
) -> None:
    """`{"type": "mcp", "server_label": "vault"}` reaches the server respool.toml registers under that
    label, with the token the operator's environment holds; a client that gives its own URL under
    that label gets no such header sent there."""
    upstream.script(model, {"tool_loop": {"tool": "lookup"}})
    tool = {"type": "mcp", "server_label": REGISTERED_LABEL, "require_approval": "never"}
    response = client.responses.create(model=model, input="q", tools=[tool])  # type: ignore[list-item]
    assert response.output_text == "The tool said: Sunny in Paris, 21C."
    assert response.output[0].server_label == REGISTERED_LABEL  # type: ignore[union-attr]
    mcp_server.reset()
    elsewhere = client.responses.create(
        model=model, input="q", tools=[mcp_tool(mcp_server, REGISTERED_LABEL)]
    )  # type: ignore[list-item]
    assert elsewhere.output_text == "The tool said: Sunny in Paris, 21C."
    assert mcp_server.authorizations() == []


def test_tool_choice_naming_an_mcp_tool(
    client: openai.OpenAI, upstream: ScriptedUpstream, mcp_server: McpServerProcess, model: str
) -> None:
    """`tool_choice: {type: mcp, server_label, name}` is the choice of that tool's function upstream;
    once the call has run, the next turn is free to answer."""
    upstream.script(model, {"tool_loop": {"tool": "add"}})
    choice = {"type": "mcp", "server_label": "tools", "name": "add"}
    response = client.responses.create(
        model=model,
        input="q",
        tools=[mcp_tool(mcp_server)],  # type: ignore[list-item]
        tool_choice=choice,  # type: ignore[arg-type]
    )
    assert response.output_text == "The tool said: 4"
    first, second = upstream.requests(model)
    assert first["tool_choice"] == {"type": "function", "function": {"name": "mcp__tools__add"}}
    assert response.tool_choice.type == "mcp" and response.tool_choice.name == "add"  # type: ignore[union-attr]
    assert second["tool_choice"] == "auto"  # forced until the call ran, then free to answer


def test_two_servers_in_one_background_stream(
    client: openai.OpenAI,
    upstream: ScriptedUpstream,
    mcp_server: McpServerProcess,
    model: str,
) -> None:
    """A loop over two servers (the test's plain one, and the operator's registered one), run in the
    background and streamed: each is listed, each call runs on its own server, the model answers."""
    upstream.script(
        model, {"tool_loop": {"tools": ["weather__lookup", f"{REGISTERED_LABEL}__add"], "steps": 2}}
    )
    tools = [
        mcp_tool(mcp_server, "weather", allowed_tools=["lookup"]),
        {
            "type": "mcp",
            "server_label": REGISTERED_LABEL,
            "require_approval": "never",
            "allowed_tools": ["add"],
        },
    ]
    with client.responses.create(
        model=model,
        input="q",
        tools=tools,
        background=True,
        stream=True,  # type: ignore[arg-type]
    ) as stream:
        events = list(stream)
    final = events[-1].response  # type: ignore[union-attr]
    assert events[-1].type == "response.completed" and final.background
    shown = [(item.type, item.server_label) for item in final.output if item.type != "message"]  # type: ignore[union-attr]
    assert shown == [
        ("mcp_list_tools", "weather"),
        ("mcp_list_tools", REGISTERED_LABEL),
        ("mcp_call", "weather"),
        ("mcp_call", REGISTERED_LABEL),
    ]
    assert client.responses.retrieve(final.id).output_text == "The tool said: 4"


def test_a_name_that_resolves_to_a_loopback_address_is_refused_at_connect_time(
    client: openai.OpenAI, upstream: ScriptedUpstream, mcp_server: McpServerProcess, model: str
) -> None:
    """A server_url naming a host (not an address) passes at create; when the worker resolves it to
    an address the allowlist does not open (this machine's own name, a loopback or private address),
    the connection is refused and the response fails saying why."""
    host = socket.gethostname()
    port = mcp_server.host_port.rpartition(":")[2]
    upstream.script(model, {"tool_loop": {"tool": "lookup"}})
    tool = {
        "type": "mcp",
        "server_label": "named",
        "server_url": f"http://{host}:{port}/mcp",
        "require_approval": "never",
    }
    refused = client.responses.create(model=model, input="q", tools=[tool])  # type: ignore[list-item]
    assert refused.status == "failed" and refused.error is not None
    assert "RESPOOL_OUTBOUND_ALLOWLIST" in refused.error.message, refused.error.message
    assert "'named'" in refused.error.message
