"""The web search backends (worker/runner/search.py) against a real HTTP server speaking their APIs
(tests/support/search_server.py): SearXNG's JSON API and Tavily's, the SSRF rule on the way."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.tool_servers import SearchServerProcess
from worker.errors import OutboundRefusedError, ToolError
from worker.outbound import OutboundPolicy
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
    found = await Searcher(backend, server.url, KEY, max_results=2).search("job queues", policy, 10)
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
    found = await Searcher(backend, server.url, KEY).search("x", policy, 10, ["example.com"])
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
