"""The web search backends (worker/runner/search.py) against a real HTTP server speaking their APIs
(tests/support/search_server.py): SearXNG's JSON API and Tavily's, the SSRF rule on the way."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.tool_servers import McpServerProcess, SearchServerProcess
from worker.errors import OutboundRefusedError, ToolError
from worker.outbound import OutboundPolicy
from worker.routing import RegisteredServer
from worker.runner.search import Searcher, results_text

KEY = "tvly-unit-key"


@pytest.fixture(scope="module")
def server() -> Iterator[SearchServerProcess]:
    running = SearchServerProcess.start("--key", KEY)
    yield running
    running.stop()


@pytest.fixture
def policy(server: SearchServerProcess) -> OutboundPolicy:
    return OutboundPolicy.parse(server.host_port)


@pytest.mark.parametrize("backend", ["searxng", "tavily"])
async def test_each_backend_finds_results(
    server: SearchServerProcess, policy: OutboundPolicy, backend: str
) -> None:
    found = (await Searcher(backend, server.url, KEY, max_results=2).search("job queues", policy, 10)).results
    assert [result.url for result in found] == [
        "https://example.org/job-queues",
        "https://docs.example.com/job-queues",
    ]
    assert found[0].title == "All about job queues" and "first result" in found[0].snippet
    text = results_text("job queues", found)
    assert text.startswith("Results for 'job queues':") and "[2] Reference for job queues" in text


@pytest.mark.parametrize("backend", ["searxng", "tavily"])
async def test_allowed_domains_keep_only_their_results(
    server: SearchServerProcess, policy: OutboundPolicy, backend: str
) -> None:
    """Results off those domains are dropped; SearXNG is asked with `site:` (it has no filter of its own)."""
    server.reset()
    found = (await Searcher(backend, server.url, KEY).search("x", policy, 10, ["example.com"])).results
    assert [result.url.split("/")[2] for result in found] == ["docs.example.com"]
    asked = {"searxng": "x (site:example.com)", "tavily": "x"}[backend]
    assert server.queries() == [asked]


async def test_a_wrong_key_and_a_failing_backend_are_tool_errors(
    server: SearchServerProcess, policy: OutboundPolicy
) -> None:
    with pytest.raises(ToolError, match="answered 401") as refused:
        await Searcher("tavily", server.url, "tvly-wrong").search("x", policy, 10)
    assert "tvly-wrong" not in refused.value.message
    with pytest.raises(ToolError, match="answered 500"):
        await Searcher("searxng", server.url).search("please fail", policy, 10)


async def test_a_backend_on_loopback_is_refused_without_the_allowlist(server: SearchServerProcess) -> None:
    with pytest.raises(OutboundRefusedError, match="RESPOOL_OUTBOUND_ALLOWLIST"):
        await Searcher("searxng", server.url).search("x", OutboundPolicy(), 10)


async def test_an_unreachable_backend_is_a_tool_error(policy: OutboundPolicy) -> None:
    with pytest.raises(ToolError, match="could not be reached"):
        await Searcher("searxng", "http://127.0.0.1:9").search("x", OutboundPolicy.parse("127.0.0.1"), 5)


async def test_an_operators_mcp_search_tool(mcp_server: McpServerProcess) -> None:
    """The `mcp` backend calls the registered server's tool with the query: its text is what the model
    is told, the URLs in it the pages found."""
    registered = RegisteredServer("tools", mcp_server.url)
    searcher = Searcher("mcp", server=registered, tool="search")
    found = await searcher.search("job queues", OutboundPolicy.parse(mcp_server.host_port), 10)
    assert found.text.startswith("1. Guide to job queues - https://guide.example.org/job-queues")
    assert [result.url for result in found.results] == [
        "https://guide.example.org/job-queues",
        "https://more.example.com/job-queues",
    ]
    with pytest.raises(ToolError, match="'tools/nothing' failed"):
        await Searcher("mcp", server=registered, tool="nothing").search(
            "x", OutboundPolicy.parse(mcp_server.host_port), 10
        )


def test_a_backend_configured_by_halves_is_refused_at_start() -> None:
    """A backend without what it needs stops the process with a message naming the missing setting."""
    from pydantic import ValidationError

    from worker.errors import ConfigError
    from worker.routing import Routes
    from worker.runner.runtime import searcher_of
    from worker.settings import Settings

    for given, missing in [
        ({"web_search_backend": "searxng"}, "RESPOOL_WEB_SEARCH_URL"),
        ({"web_search_backend": "tavily"}, "RESPOOL_WEB_SEARCH_API_KEY"),
        ({"web_search_backend": "mcp"}, "RESPOOL_WEB_SEARCH_MCP_TOOL"),
    ]:
        with pytest.raises(ValidationError, match=missing):
            Settings(**given)  # type: ignore[arg-type]
    settings = Settings(web_search_backend="mcp", web_search_mcp_tool="docs/search")
    with pytest.raises(ConfigError, match="'docs'"):
        searcher_of(settings, Routes(models={}))
    registered = Routes(
        models={}, mcp_servers={"docs": RegisteredServer("docs", "https://docs.internal/mcp")}
    )
    searcher = searcher_of(settings, registered)
    assert searcher is not None and (searcher.tool, searcher.server) == (
        "search",
        registered.mcp_servers["docs"],
    )
