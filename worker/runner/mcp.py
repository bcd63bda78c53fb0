"""Remote MCP servers, as the tool loop calls them (DESIGN.md §10): the `mcp` SDK's client over the
Streamable HTTP transport (or the older HTTP+SSE one, for a URL ending in `/sse`), on httpx2
clients whose connections follow the SSRF rule (§13).

A session lasts one operation (a listing, or a call): the loop's steps are minutes apart at most,
and a server restarted in between costs nothing. What a server answers is turned into the shapes
the Responses API gives it: a listing's tools, a call's output or its `error`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx2
import orjson
from mcp import Client
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from worker.errors import OutboundRefusedError, ToolError
from worker.outbound import OutboundPolicy, guard_transport


@dataclass(frozen=True)
class Server:
    """One MCP server a response may use: its label, URL and the headers to send (secrets included)."""

    label: str
    url: str
    headers: dict[str, str]


@dataclass(frozen=True)
class CallResult:
    output: str | None
    error: dict[str, Any] | None


async def list_tools(server: Server, policy: OutboundPolicy, seconds: float) -> list[dict[str, Any]]:
    """The server's tools as `mcp_list_tools` lists them; `ToolError` naming the server if it cannot be listed."""
    async with _Session(server, policy, seconds) as client:
        try:
            listed = await asyncio.wait_for(client.list_tools(), seconds)
        except BaseException as exc:
            raise _failure(server, exc, client) from exc
    tools = []
    for tool in listed.tools:
        entry: dict[str, Any] = {"name": tool.name, "input_schema": tool.input_schema}
        if tool.description:
            entry["description"] = tool.description
        if tool.annotations is not None:
            entry["annotations"] = tool.annotations.model_dump(by_alias=True, exclude_none=True)
        tools.append(entry)
    return tools


async def call_tool(
    server: Server, policy: OutboundPolicy, name: str, arguments: dict[str, Any], seconds: float
) -> CallResult:
    """Run one tool. Its own failure is a result with an `error` the model is told; a server that
    cannot be reached, or that breaks the protocol, is one too (the loop goes on)."""
    try:
        async with _Session(server, policy, seconds) as client:
            try:
                result = await asyncio.wait_for(client.call_tool(name, arguments), seconds)
            except BaseException as exc:
                raise _failure(server, exc, client) from exc
    except ToolError as exc:
        return CallResult(None, {"type": "mcp_protocol_error", "code": -32000, "message": exc.message})
    text = _content_text(result.content)
    if result.is_error:
        return CallResult(None, {"type": "mcp_tool_execution_error", "content": _content(result.content)})
    return CallResult(text, None)


def uses_sse(url: str) -> bool:
    """Whether a server is reached over the older HTTP+SSE transport: its URL's path ends in `/sse`
    (as those servers' endpoints do); any other URL is a Streamable HTTP endpoint."""
    return urlsplit(url).path.rstrip("/").endswith("/sse")


class _Session:
    """An MCP client session and the HTTP statuses its requests met (to name a 401 as such)."""

    def __init__(self, server: Server, policy: OutboundPolicy, timeout: float) -> None:
        self.server = server
        self.policy = policy
        self.statuses: list[int] = []
        self.http: httpx2.AsyncClient | None = None
        limit = httpx2.Timeout(timeout, connect=min(timeout, 10.0))
        if uses_sse(server.url):
            # The SSE transport makes its client itself (through this factory) and closes it.
            transport = sse_client(
                server.url, headers=server.headers, timeout=timeout, httpx_client_factory=self._http_client
            )
        else:
            self.http = self._http_client(server.headers, limit)
            transport = streamable_http_client(server.url, http_client=self.http)
        self.client = Client(transport, mode="legacy")

    def _http_client(
        self,
        headers: dict[str, str] | None = None,
        timeout: httpx2.Timeout | None = None,
        auth: httpx2.Auth | None = None,
    ) -> httpx2.AsyncClient:
        """An httpx2 client whose connections follow the SSRF rule, recording every status met."""
        return httpx2.AsyncClient(
            transport=guard_transport(httpx2.AsyncHTTPTransport(trust_env=False), self.policy),
            headers=headers,
            timeout=timeout,
            auth=auth,
            event_hooks={"response": [self._record]},
        )

    async def _record(self, response: httpx2.Response) -> None:
        self.statuses.append(response.status_code)

    async def __aenter__(self) -> _Session:
        if self.http is not None:
            await self.http.__aenter__()
        try:
            await self.client.__aenter__()
        except BaseException as exc:
            if self.http is not None:
                await self.http.__aexit__(None, None, None)
            raise _failure(self.server, exc, self) from exc
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self.client.__aexit__(None, None, None)
        except Exception:  # the server may be gone: the result is in hand
            pass
        finally:
            if self.http is not None:
                await self.http.__aexit__(None, None, None)

    async def list_tools(self) -> Any:
        return await self.client.list_tools()

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        return await self.client.call_tool(name, arguments)


def _failure(server: Server, exc: BaseException, session: _Session) -> ToolError:
    """A `ToolError` naming the server and what went wrong, from whatever the SDK raised."""
    leaf = _leaf(exc)
    if isinstance(leaf, asyncio.CancelledError):
        raise leaf
    if isinstance(leaf, ToolError):
        return ToolError(f"MCP server '{server.label}': {leaf.message}")
    if 401 in session.statuses or 403 in session.statuses:
        status = 401 if 401 in session.statuses else 403
        return ToolError(
            f"MCP server '{server.label}' answered {status}: it needs authorization (send it in the "
            "mcp tool's `headers` or `authorization`)."
        )
    if isinstance(leaf, TimeoutError):
        return ToolError(f"MCP server '{server.label}' did not answer in time.")
    if isinstance(leaf, MCPError):
        return ToolError(f"MCP server '{server.label}' answered an error: {leaf}")
    if isinstance(leaf, httpx2.HTTPError):
        return ToolError(f"MCP server '{server.label}' could not be reached: {leaf}")
    return ToolError(f"MCP server '{server.label}' failed: {type(leaf).__name__}: {leaf}")


def _leaf(exc: BaseException) -> BaseException:
    """The first error inside (nested) exception groups: what actually went wrong."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        refused = [e for e in exc.exceptions if isinstance(_leaf(e), OutboundRefusedError)]
        exc = refused[0] if refused else exc.exceptions[0]
    if exc.__cause__ is not None and isinstance(exc.__cause__, OutboundRefusedError):
        return exc.__cause__
    return exc


def _content(blocks: list[Any]) -> list[dict[str, Any]]:
    return [block.model_dump(by_alias=True, exclude_none=True) for block in blocks]


def _content_text(blocks: list[Any]) -> str:
    """A result's text: its text blocks joined; any other block as its JSON."""
    parts = []
    for block in blocks:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else orjson.dumps(_content([block])[0]).decode())
    return "\n".join(parts)
