"""Web search through the tool loop (issue 17): a search backend speaking SearXNG's JSON API on
loopback, real respool processes configured to use it, the scripted upstream's tool-loop model, and
the `openai` SDK."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import NATIVE_MODEL, make_sdk, own_stack
from tests.support.stack import Servers, Stack
from tests.support.tool_servers import SearchServerProcess
from tests.support.upstream_process import ScriptedUpstream

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def searching(
    backing: Servers,
    upstream: ScriptedUpstream,
    session_dir: Path,
    stack: Stack,
    search_server: SearchServerProcess,
) -> Iterator[openai.OpenAI]:
    """The SDK on a respool whose web search goes to the test's SearXNG."""
    running = own_stack(
        backing,
        session_dir,
        "web-search",
        RESPOOL_UPSTREAM_URL=upstream.url,
        RESPOOL_UPSTREAM_API="chat",
        RESPOOL_CONFIG=stack.env["RESPOOL_CONFIG"],  # routes NATIVE_MODEL to the Responses API
        RESPOOL_WEB_SEARCH_BACKEND="searxng",
        RESPOOL_WEB_SEARCH_URL=search_server.url,
        RESPOOL_OUTBOUND_ALLOWLIST=search_server.host_port,
    )
    running.start_api()
    running.start_worker()
    with make_sdk(running.url, "unused") as sdk:
        yield sdk
    running.stop_all()


def test_a_search_and_an_answer_from_its_results(
    searching: openai.OpenAI, upstream: ScriptedUpstream, search_server: SearchServerProcess, model: str
) -> None:
    """The model's call of web_search runs on the backend: a `web_search_call` with its action (and
    sources, as `include` asks) told with OpenAI's events; the results reach the model's next turn."""
    search_server.reset()
    upstream.script(model, {"tool_loop": {"tool": "web_search", "arguments": {"query": "respool queues"}}})
    with searching.responses.stream(
        model=model,
        input="what is respool?",
        tools=[{"type": "web_search"}],
        include=["web_search_call.action.sources"],
    ) as stream:
        events = list(stream)
        response = stream.get_final_response()
    call, message = response.output
    assert call.type == "web_search_call" and call.status == "completed"
    assert call.action.type == "search" and call.action.query == "respool queues"  # type: ignore[union-attr]
    urls = [source.url for source in call.action.sources or []]  # type: ignore[union-attr]
    assert urls == [
        "https://example.org/respool-queues",
        "https://docs.example.com/respool-queues",
        "https://news.example.net/respool-queues",
    ]
    told = [event.type for event in events if getattr(event, "item_id", None) == call.id]
    told += [event.type for event in events if getattr(getattr(event, "item", None), "id", None) == call.id]
    kinds = [event.type for event in events]
    assert kinds.index("response.web_search_call.in_progress") < kinds.index(
        "response.web_search_call.searching"
    )
    assert kinds.index("response.web_search_call.searching") < kinds.index(
        "response.web_search_call.completed"
    )
    assert set(told) == {
        "response.output_item.added",
        "response.web_search_call.in_progress",
        "response.web_search_call.searching",
        "response.web_search_call.completed",
        "response.output_item.done",
    }
    assert search_server.queries() == ["respool queues"]
    first, second = upstream.requests(model)
    assert [tool["function"]["name"] for tool in first["tools"]] == ["web_search"]
    result = second["messages"][-1]
    assert result["role"] == "tool" and result["tool_call_id"] == call.id
    assert "https://docs.example.com/respool-queues" in result["content"]
    assert "the second result's snippet" in result["content"]
    assert message.type == "message" and response.output_text.startswith("The tool said: Results for")
    # The answer names the pages the search found: each place is a url_citation, told before the text's end.
    text = message.content[0]  # type: ignore[union-attr]
    cited = [(a.url, a.title, text.text[a.start_index : a.end_index]) for a in text.annotations]  # type: ignore[union-attr]
    assert cited == [
        (url, title, url)
        for url, title in zip(
            urls,
            ["All about respool queues", "Reference for respool queues", "News on respool queues"],
            strict=True,
        )
    ]
    assert kinds.index("response.output_text.annotation.added") < kinds.index("response.output_text.done")
    assert searching.responses.retrieve(response.id).output[0] == call


def test_without_include_no_sources_and_a_preview_tool_choice(
    searching: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """`web_search_preview` works alike; `tool_choice` naming it forces the search function; the
    action carries no sources unless `include` asks."""
    upstream.script(model, {"tool_loop": {"tool": "web_search"}})
    response = searching.responses.create(
        model=model,
        input="q",
        tools=[{"type": "web_search_preview"}],
        tool_choice={"type": "web_search_preview"},
    )
    call = response.output[0]
    assert call.type == "web_search_call" and call.action.query == "Paris"  # type: ignore[union-attr]
    assert call.action.sources is None  # type: ignore[union-attr]
    assert upstream.requests(model)[0]["tool_choice"] == {
        "type": "function",
        "function": {"name": "web_search"},
    }
    assert response.unavailable_tools is None if hasattr(response, "unavailable_tools") else True  # type: ignore[attr-defined]


def test_a_failing_search_is_told_to_the_model(
    searching: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    upstream.script(model, {"tool_loop": {"tool": "web_search", "arguments": {"query": "make it fail"}}})
    response = searching.responses.create(model=model, input="q", tools=[{"type": "web_search"}])
    call = response.output[0]
    assert (call.type, call.status) == ("web_search_call", "failed")
    assert response.status == "completed"
    assert response.output_text == "The tool said: Error: The search backend answered 500."


def test_a_responses_upstream_searches_through_respool_too(
    searching: openai.OpenAI, upstream: ScriptedUpstream
) -> None:
    """On a Responses upstream the search is respool's as well: the upstream is offered a function
    (never the hosted tool), and is sent the search as a function call and what it found."""
    upstream.script(NATIVE_MODEL, {"times": 2, "tool_loop": {"tool": "web_search"}, "then": {}})
    before = len(upstream.requests(NATIVE_MODEL))
    response = searching.responses.create(model=NATIVE_MODEL, input="q", tools=[{"type": "web_search"}])
    assert [item.type for item in response.output] == ["web_search_call", "message"]
    first, second = upstream.requests(NATIVE_MODEL)[before:]
    assert first["tools"] == [
        {
            "type": "function",
            "name": "web_search",
            "parameters": first["tools"][0]["parameters"],
            "strict": False,
            "description": first["tools"][0]["description"],
        }
    ]
    call, result = second["input"][-2:]
    assert (call["type"], call["name"], call["arguments"]) == (
        "function_call",
        "web_search",
        '{"query":"Paris"}',
    )
    assert result["type"] == "function_call_output" and "https://example.org/paris" in result["output"]
