"""Remote MCP through the tool loop (issue 17): a real MCP server (the `mcp` package's, Streamable
HTTP on loopback), the scripted upstream's tool-loop model, real respool processes, the `openai` SDK."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.support.mcp_process import McpServerProcess
from tests.support.stack import Stack
from tests.support.upstream_process import ScriptedUpstream

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mcp_server() -> Iterator[McpServerProcess]:
    server = McpServerProcess.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def guarded_server() -> Iterator[McpServerProcess]:
    server = McpServerProcess.start(token="s3cret-token")
    yield server
    server.stop()


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
    refused = client.responses.create(model=model, input="q", tools=[mcp_tool(guarded_server, "vault")])  # type: ignore[list-item]
    assert refused.status == "failed" and refused.error is not None
    assert "'vault'" in refused.error.message and "401" in refused.error.message
    tool = mcp_tool(guarded_server, "vault", headers={"Authorization": "Bearer s3cret-token"})
    done = client.responses.create(model=model, input="q", tools=[tool])  # type: ignore[list-item]
    assert done.output_text == "The tool said: Sunny in Paris, 21C."
    assert "s3cret-token" not in client.responses.retrieve(done.id).model_dump_json()
    with client.responses.retrieve(done.id, stream=True) as replay:
        assert all("s3cret-token" not in event.model_dump_json() for event in replay)


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
