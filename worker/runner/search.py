"""Web search, as the tool loop runs the `web_search` tools (DESIGN.md §10): through the search
backend the operator configures, on an httpx client whose connections follow the SSRF rule (§13).

Backends (`RESPOOL_WEB_SEARCH_BACKEND`):
- `searxng`: a self-hosted SearXNG's JSON API, `GET <url>/search?q=...&format=json` (its
  `search.formats` setting must list `json`); results `[{url, title, content}]`
- `tavily`: Tavily's hosted API, `POST <url>/search` with `{"query", "max_results",
  "include_domains"}` and `Authorization: Bearer <key>` (`RESPOOL_WEB_SEARCH_API_KEY`); results
  `[{url, title, content}]`

A search that fails (the backend unreachable, an error status, a body not of its shape) is a
`ToolError` whose message the model is told; the key never appears in one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from worker.errors import ToolError
from worker.outbound import OutboundPolicy, guard_transport

BACKENDS = ("searxng", "tavily")
DEFAULT_URLS = {"tavily": "https://api.tavily.com"}


@dataclass(frozen=True)
class Result:
    url: str
    title: str
    snippet: str


@dataclass(frozen=True)
class Searcher:
    """The configured search backend."""

    backend: str  # one of BACKENDS
    url: str
    api_key: str = ""
    max_results: int = 5

    async def search(
        self, query: str, policy: OutboundPolicy, seconds: float, allowed_domains: list[str] | None = None
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
