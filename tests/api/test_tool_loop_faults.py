"""The tool loop when things die or are cancelled (issue 17, DESIGN.md §10 "Durable"): a worker
killed mid-loop, a cancel while a tool runs. A real MCP server, real respool processes, the SDK."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import make_sdk, own_stack
from tests.support.faults import KILL, check_ended, signal_process, wait_until_ended
from tests.support.stack import Servers, Stack, wait_for
from tests.support.tool_servers import McpServerProcess, SearchServerProcess
from tests.support.upstream_process import ScriptedUpstream

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def loop_stack(
    backing: Servers,
    upstream: ScriptedUpstream,
    session_dir: Path,
    stack: Stack,
    search_server: SearchServerProcess,
) -> Iterator[Stack]:
    """An API of this module's own, searching on the test's SearXNG; the kill test starts the
    workers it kills."""
    running = own_stack(
        backing,
        session_dir,
        "tool-loop-faults",
        RESPOOL_UPSTREAM_URL=upstream.url,
        RESPOOL_UPSTREAM_API="chat",
        RESPOOL_OUTBOUND_ALLOWLIST="127.0.0.0/8",
        RESPOOL_WEB_SEARCH_BACKEND="searxng",
        RESPOOL_WEB_SEARCH_URL=search_server.url,
    )
    running.start_api()
    yield running
    running.stop_all()


def mcp_tool(server: McpServerProcess) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "tools", "server_url": server.url, "require_approval": "never"}


def test_a_worker_killed_mid_loop_is_taken_over_from_its_last_finished_step(
    loop_stack: Stack,
    upstream: ScriptedUpstream,
    mcp_server: McpServerProcess,
    search_server: SearchServerProcess,
    model: str,
) -> None:
    """A loop (a web search, MCP lookup, MCP add, then the answer) whose worker is killed -9 while
    the answer streams: the next worker continues from the finished steps (the search backend and
    the MCP server saw each exactly once), closes the half-told answer `incomplete`, asks the model
    again with the same history (the search's results from the journal), and completes; the
    client's one stream tells all of it, and every replay is gapless."""
    mcp_server.reset()
    search_server.reset()
    steps = {"tools": ["web_search", "lookup", "add"], "steps": 3}
    upstream.script(model, {"tool_loop": steps, "delay": 0.4})
    loop_stack.start_worker("doomed")
    seen: list[Any] = []
    killed_at: float | None = None
    with make_sdk(loop_stack.url, "unused") as sdk:
        try:
            stream = sdk.responses.create(
                model=model,
                input="weather, then a sum",
                tools=[mcp_tool(mcp_server), {"type": "web_search"}],  # type: ignore[list-item]
                background=True,
                stream=True,
            )
            with stream:
                for event in stream:
                    seen.append(event)
                    if event.type == "response.in_progress":  # "doomed" holds it
                        # Not waited for here: the kill must land while the answer streams, and a
                        # worker takes seconds to start on a loaded machine (it takes over when up).
                        loop_stack.start_worker("survivor", ready=False)
                    if event.type == "response.output_text.delta" and killed_at is None:
                        signal_process(loop_stack, "doomed", KILL)
                        killed_at = time.monotonic()
            assert killed_at is not None
            print(f"mid-loop kill -9: the response ended {time.monotonic() - killed_at:.1f} s after the kill")
            response_id = seen[0].response.id
            stored = check_ended(sdk, response_id, offsets=range(0, len(seen), 7))
            assert stored["status"] == "completed"
            kinds = [(item["type"], item.get("name"), item["status"]) for item in stored["output"]]
            assert kinds == [
                ("mcp_list_tools", None, "completed"),
                ("web_search_call", None, "completed"),
                ("mcp_call", "lookup", "completed"),
                ("mcp_call", "add", "completed"),
                ("message", None, "incomplete"),  # the dead attempt's half-told answer, closed
                ("message", None, "completed"),
            ]
            assert stored["output"][-1]["content"][0]["text"] == "The tool said: 4"
            # The usage of every finished turn, the dead attempt's from the journal: three calls of
            # one token each, and the answer's four words (the turn cut short never reported any).
            assert stored["usage"]["output_tokens"] == 3 + 4
            # The client's stream went on through the takeover and told what the replay tells.
            replay = list(sdk.responses.retrieve(response_id, stream=True))
            assert [e.model_dump(exclude_unset=True) for e in seen] == [
                e.model_dump(exclude_unset=True) for e in replay
            ]
        finally:
            for name in ("doomed", "survivor"):
                if name in loop_stack.processes:
                    loop_stack.stop(name, KILL)
    assert mcp_server.calls() == {"lookup": [{"city": "Paris"}], "add": [{"a": 2, "b": 2}]}
    assert search_server.queries() == ["Paris"]
    requests = upstream.requests(model)
    assert len(requests) == 5  # search, lookup, add, the answer cut short, the answer again
    assert requests[4]["messages"] == requests[3]["messages"]
    assert "https://example.org/paris" in requests[4]["messages"][2]["content"]  # the search's results


def test_a_cancel_reaches_a_loop_waiting_on_a_tool(
    client: openai.OpenAI, upstream: ScriptedUpstream, mcp_server: McpServerProcess, model: str
) -> None:
    """A cancel while a tool runs for a minute ends the response at once, the call closed with an error."""
    mcp_server.reset()
    upstream.script(model, {"tool_loop": {"tool": "slow", "arguments": {"seconds": 60}}})
    created = client.responses.create(
        model=model,
        input="wait",
        tools=[mcp_tool(mcp_server)],  # type: ignore[list-item]
        background=True,
    )
    wait_for(lambda: mcp_server.calls().get("slow"), timeout=30, what="the slow tool to be called")
    started = time.monotonic()
    assert client.responses.cancel(created.id).status == "cancelled"
    wait_until_ended(client, [created.id], timeout=30)
    print(f"cancel during a tool call: ended {time.monotonic() - started:.2f} s after the cancel")
    stored = check_ended(client, created.id)
    assert stored["status"] == "cancelled"
    # A cancelled Response keeps no output (PROTOCOL.md §7); its stream closes the call it cut short.
    events = list(client.responses.retrieve(created.id, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "mcp_call"]
    assert [(call.name, call.status) for call in done] == [("slow", "failed")]  # type: ignore[union-attr]
    assert done[0].error is not None and done[0].error.message.startswith("Cancelled")  # type: ignore[union-attr]
    assert "response.mcp_call.failed" in [e.type for e in events]
    assert len(upstream.requests(model)) == 1  # no model turn after the cancel


def test_a_call_is_told_while_it_runs(
    client: openai.OpenAI, upstream: ScriptedUpstream, mcp_server: McpServerProcess, model: str
) -> None:
    """A response on a chain that listed its server's tools already (so it lists none: no output of
    its own before its turn), whose turn's whole answer, a call of a tool respool runs, came in one
    read: the call is told to a client following the stream while the tool runs (a minute here), not
    kept for the response's end (`ResponseWriter.end_turn`, then `ToolLoop.run`)."""
    mcp_server.reset()
    slow_call = {"tool_loop": {"tool": "slow", "arguments": {"seconds": 60}}, "together": True}
    upstream.script(model, {"times": 1, "text": "ready", "then": slow_call})
    first = client.responses.create(model=model, input="hi", tools=[mcp_tool(mcp_server)])  # type: ignore[list-item]
    assert [item.type for item in first.output] == ["mcp_list_tools", "message"]
    stream = client.responses.create(
        model=model,
        input="wait",
        previous_response_id=first.id,
        tools=[mcp_tool(mcp_server)],  # type: ignore[list-item]
        background=True,
        stream=True,
    )
    response_id = ""

    def until_the_call() -> list[str]:
        nonlocal response_id
        seen = []
        for event in stream:
            seen.append(event.type)
            if event.type == "response.created":
                response_id = event.response.id
            if event.type == "response.mcp_call.in_progress":
                return seen
        return seen

    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(until_the_call)
        try:
            seen = reading.result(timeout=30)  # told before the call: it runs for a minute after
            wait_for(lambda: mcp_server.calls().get("slow"), timeout=30, what="the slow tool to be called")
        finally:
            wait_for(lambda: response_id, timeout=30, what="the response's id")
            client.responses.cancel(response_id)  # ends the stream the thread reads, if it still does
            stream.close()
    assert seen[-1] == "response.mcp_call.in_progress" and "response.mcp_list_tools.in_progress" not in seen
    assert client.responses.retrieve(response_id).status == "cancelled"
