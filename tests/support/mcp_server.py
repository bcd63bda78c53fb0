"""A real MCP server for the integration tests: the `mcp` package's own server, over Streamable HTTP.

Tools:
    lookup(city)        "Sunny in <city>, 21C." (read-only)
    ping()              "pong"
    add(a, b)           the sum, as text
    explode(reason)     fails: the call's result is an error naming `reason`
    slow(seconds)       sleeps, then "slept"
    search(query)       two results as text, each with its URL (a search tool an operator registers)

Control routes, which no MCP server has:
    GET  /_calls        {"<tool>": [arguments, ...]} every call received, in order
    GET  /_authorizations  every distinct `Authorization` header an MCP request carried
    POST /_reset        forgets both

The same tools over the older HTTP+SSE transport at `/sse` (the URL with `/mcp` replaced).
With `--token T`, every MCP request needs `Authorization: Bearer T` (else 401, as a server that
demands auth answers). Run: `python -m tests.support.mcp_server --port 0` prints
`LISTENING http://127.0.0.1:<port>/mcp`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from collections import defaultdict
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

CALLS: dict[str, list[dict[str, Any]]] = defaultdict(list)
AUTHORIZATIONS: set[str] = set()


def build_server() -> MCPServer:
    server = MCPServer("respool-test-tools")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def lookup(city: str) -> str:
        """The weather in a city."""
        CALLS["lookup"].append({"city": city})
        return f"Sunny in {city}, 21C."

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def ping() -> str:
        """Answers pong (a tool without parameters)."""
        CALLS["ping"].append({})
        return "pong"

    @server.tool()
    def add(a: int, b: int) -> str:
        """Add two integers."""
        CALLS["add"].append({"a": a, "b": b})
        return str(a + b)

    @server.tool()
    def explode(reason: str) -> str:
        """Always fails."""
        CALLS["explode"].append({"reason": reason})
        raise ValueError(f"exploded: {reason}")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def search(query: str) -> str:
        """Search the web (an operator's search tool: respool's `mcp` web search backend calls it)."""
        CALLS["search"].append({"query": query})
        slug = "-".join(query.lower().split())
        return f"1. Guide to {query} - https://guide.example.org/{slug}\n2. More: https://more.example.com/{slug}."

    @server.tool()
    async def slow(seconds: float) -> str:
        """Sleeps."""
        CALLS["slow"].append({"seconds": seconds})
        await asyncio.sleep(seconds)
        return "slept"

    return server


class Guarded:
    """The MCP app behind a bearer token (when one is set), with the control routes beside it; the
    older HTTP+SSE transport's app serves `/sse` and `/messages/`."""

    def __init__(self, app: ASGIApp, sse: ASGIApp, token: str | None) -> None:
        self.app = app
        self.sse = sse
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        if scope["path"] == "/_calls":
            await JSONResponse(dict(CALLS))(scope, receive, send)
            return
        if scope["path"] == "/_authorizations":
            await JSONResponse(sorted(AUTHORIZATIONS))(scope, receive, send)
            return
        if scope["path"] == "/_reset":
            CALLS.clear()
            AUTHORIZATIONS.clear()
            await Response(status_code=204)(scope, receive, send)
            return
        if "authorization" in request.headers:
            AUTHORIZATIONS.add(request.headers["authorization"])
        if self.token and request.headers.get("authorization") != f"Bearer {self.token}":
            body = {"error": "unauthorized", "error_description": "a bearer token is required"}
            await JSONResponse(body, 401, {"www-authenticate": "Bearer"})(scope, receive, send)
            return
        if scope["path"] == "/sse" or scope["path"].startswith("/messages/"):
            await self.sse(scope, receive, send)
            return
        await self.app(scope, receive, send)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token")
    args = parser.parse_args()
    server = build_server()
    streamable = server.streamable_http_app(stateless_http=True, json_response=False)
    app = Guarded(streamable, server.sse_app(), args.token)
    sock = socket.create_server(("127.0.0.1", args.port))
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    print(f"LISTENING http://127.0.0.1:{sock.getsockname()[1]}/mcp", flush=True)
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


if __name__ == "__main__":
    main()
