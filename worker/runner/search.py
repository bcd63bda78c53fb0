"""Web search, as the tool loop runs the `web_search` tools (DESIGN.md §10): through the search
backend the operator configures, on an httpx client whose connections follow the SSRF rule (§13).

Backends (`RESPOOL_WEB_SEARCH_BACKEND`):
- `searxng`: a self-hosted SearXNG's JSON API, `GET <url>/search?q=...&format=json` (its
  `search.formats` setting must list `json`); results `[{url, title, content}]`
- `tavily`: Tavily's hosted API, `POST <url>/search` with `{"query", "max_results",
  "include_domains"}` and `Authorization: Bearer <key>` (`RESPOOL_WEB_SEARCH_API_KEY`); results
  `[{url, title, content}]`

- `mcp`: a tool of an MCP server registered in respool.toml (`RESPOOL_WEB_SEARCH_MCP_TOOL=
  <label>/<tool>`), called with `{"query": ...}`; its text is what the model is told, and the URLs
  in it are the pages found (to cite, and as sources)

A search that fails (the backend unreachable, an error status, a body not of its shape) is a
`ToolError` whose message the model is told; the key never appears in one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from worker.errors import ToolError
from worker.outbound import OutboundPolicy, guard_transport
from worker.routing import RegisteredServer
from worker.runner import mcp

BACKENDS = ("searxng", "tavily", "mcp")
DEFAULT_URLS = {"tavily": "https://api.tavily.com"}
_URL = re.compile(r"https?://[^\s<>\"'()\[\]]+")


@dataclass(frozen=True)
class Result:
    url: str
    title: str
    snippet: str


@dataclass(frozen=True)
class Found:
    """What a search found: the pages, and the text the model is told."""

    results: list[Result]
    text: str


@dataclass(frozen=True)
class Searcher:
    """The configured search backend."""

    backend: str  # one of BACKENDS
    url: str = ""
    api_key: str = ""
    max_results: int = 5
    server: RegisteredServer | None = None  # the `mcp` backend's server, and its tool
    tool: str = ""

    async def search(
        self, query: str, policy: OutboundPolicy, seconds: float, allowed_domains: list[str] | None = None
    ) -> Found:
        if self.server is not None:  # its headers read from the environment now, as for every use
            server = mcp.Server(self.server.label, self.server.url, self.server.headers())
            return await self._mcp(server, query, policy, seconds)
        results = await self._results(query, policy, seconds, allowed_domains)
        return Found(results, results_text(query, results))

    async def _mcp(self, server: mcp.Server, query: str, policy: OutboundPolicy, seconds: float) -> Found:
        called = await mcp.call_tool(server, policy, self.tool, {"query": query}, seconds)
        if called.error is not None or called.output is None:
            error = called.error or {}
            reason = error.get("message") or orjson.dumps(error.get("content")).decode()
            raise ToolError(f"The search tool '{server.label}/{self.tool}' failed: {reason}")
        urls = list(dict.fromkeys(match.rstrip(".,;:") for match in _URL.findall(called.output)))
        return Found([Result(url, url, "") for url in urls[: self.max_results * 4]], called.output)

    async def _results(
        self, query: str, policy: OutboundPolicy, seconds: float, allowed_domains: list[str] | None
    ) -> list[Result]:
        transport = guard_transport(httpx.AsyncHTTPTransport(trust_env=False), policy)
        timeout = httpx.Timeout(seconds, connect=min(seconds, 10.0))
        async with httpx.AsyncClient(transport=transport, timeout=timeout) as http:
            try:
                if self.backend == "tavily":
                    answer = await self._tavily(http, query, allowed_domains)
                else:
                    answer = await self._searxng(http, query, allowed_domains)
            except ToolError:
                raise
            except httpx.TimeoutException as exc:
                raise ToolError(f"The search backend did not answer in {seconds:g} s.") from exc
            except httpx.HTTPError as exc:
                cause = exc.__cause__ if isinstance(exc.__cause__, ToolError) else None
                reason = cause.message if cause else f"{type(exc).__name__}: {exc}"
                raise ToolError(f"The search backend could not be reached: {reason}") from exc
        results = [_result(entry) for entry in answer if isinstance(entry, dict) and entry.get("url")]
        kept = [result for result in results if _allowed(result.url, allowed_domains)]
        return kept[: self.max_results]

    async def _searxng(
        self, http: httpx.AsyncClient, query: str, allowed_domains: list[str] | None
    ) -> list[Any]:
        # SearXNG has no domain filter parameter; `site:` in the query is what its engines read.
        sites = " OR ".join(f"site:{domain}" for domain in allowed_domains or [])
        params = {"q": f"{query} ({sites})" if sites else query, "format": "json"}
        response = await http.get(self.url.rstrip("/") + "/search", params=params)
        return _results(response, "results")

    async def _tavily(
        self, http: httpx.AsyncClient, query: str, allowed_domains: list[str] | None
    ) -> list[Any]:
        body: dict[str, Any] = {"query": query, "max_results": self.max_results}
        if allowed_domains:
            body["include_domains"] = allowed_domains
        headers = {"Authorization": f"Bearer {self.api_key}"}
        response = await http.post(self.url.rstrip("/") + "/search", json=body, headers=headers)
        return _results(response, "results")


def _results(response: httpx.Response, key: str) -> list[Any]:
    if response.status_code != 200:
        raise ToolError(f"The search backend answered {response.status_code}.")
    try:
        found = response.json().get(key)
    except (ValueError, AttributeError) as exc:
        raise ToolError("The search backend answered something that is not its JSON results.") from exc
    if not isinstance(found, list):
        raise ToolError(f"The search backend's answer has no '{key}' list.")
    return found


def _result(entry: dict[str, Any]) -> Result:
    return Result(str(entry["url"]), str(entry.get("title") or ""), str(entry.get("content") or ""))


def _allowed(url: str, domains: list[str] | None) -> bool:
    """Whether `url` is on one of `domains` or a subdomain of one (none: every URL)."""
    if not domains:
        return True
    host = (urlsplit(url).hostname or "").lower()
    return any(host == domain.lower() or host.endswith("." + domain.lower()) for domain in domains)


def results_text(query: str, results: list[Result]) -> str:
    """What the model is told a search found: each result numbered, with its title, URL and snippet."""
    if not results:
        return f"No results for {query!r}."
    lines = [f"Results for {query!r}:"]
    for number, result in enumerate(results, 1):
        lines.append(f"[{number}] {result.title}\n{result.url}\n{result.snippet}".rstrip())
    return "\n\n".join(lines)
