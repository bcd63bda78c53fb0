"""A search backend for the integration tests, speaking the two APIs respool's web search reads.

    GET  /search?q=...&format=json   SearXNG's JSON API: {"query", "number_of_results", "results":
                                     [{"url", "title", "content", "engine", "score"}], ...}; as
                                     SearXNG, a `format` other than json is a 403
    POST /search                     Tavily's: a JSON body {"query", "max_results", ...} and
                                     `Authorization: Bearer <key>` (else 401); {"query", "results":
                                     [{"url", "title", "content", "score"}], "response_time"}

Every query finds three results, made from the query (`results_for`); a query containing "fail"
is answered 500. Control routes, which neither API has:

    GET  /_queries      every query received, in order
    POST /_reset        forgets them

Run: `python -m tests.support.search_server --port 0 [--key K]` prints
`LISTENING http://127.0.0.1:<port>`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import socket
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

QUERIES: list[str] = []


def results_for(query: str) -> list[dict[str, Any]]:
    slug = re.sub(r"[^a-z0-9]+", "-", query.lower()).strip("-") or "nothing"
    return [
        {"url": f"https://{host}/{slug}", "title": f"{title} {query}", "content": f"{query}: {snippet}"}
        for host, title, snippet in (
            ("example.org", "All about", "the first result's snippet."),
            ("docs.example.com", "Reference for", "the second result's snippet."),
            ("news.example.net", "News on", "the third result's snippet."),
        )
    ]


async def searxng(request: Request) -> Response:
    query = request.query_params.get("q", "")
    if request.query_params.get("format") != "json":
        return Response("Forbidden", status_code=403)  # what SearXNG answers for a format not enabled
    QUERIES.append(query)
    if "fail" in query:
        return JSONResponse({"error": "engines failed"}, status_code=500)
    results = [{**result, "engine": "test", "score": 1.0} for result in results_for(query)]
    body = {"query": query, "number_of_results": len(results), "results": results, "answers": []}
    return JSONResponse(
        {**body, "corrections": [], "infoboxes": [], "suggestions": [], "unresponsive_engines": []}
    )


async def tavily(request: Request) -> Response:
    key = request.app.state.key
    if request.headers.get("authorization") != f"Bearer {key}":
        return JSONResponse({"detail": {"error": "Unauthorized: missing or invalid API key."}}, 401)
    if request.headers.get("content-type", "").partition(";")[0] != "application/json":
        return JSONResponse({"detail": {"error": "Send JSON."}}, 400)
    body = json.loads(await request.body())
    query = str(body.get("query") or "")
    QUERIES.append(query)
    if not query or "fail" in query:
        return JSONResponse({"detail": {"error": "Bad request."}}, 400 if not query else 500)
    results = [{**result, "score": 0.9} for result in results_for(query)][: int(body.get("max_results", 5))]
    return JSONResponse({"query": query, "results": results, "response_time": 0.01, "images": []})


async def queries(request: Request) -> Response:
    return JSONResponse(QUERIES)


async def reset(request: Request) -> Response:
    QUERIES.clear()
    return Response(status_code=204)


def build_app(key: str) -> Starlette:
    app = Starlette(
        routes=[
            Route("/search", searxng, methods=["GET"]),
            Route("/search", tavily, methods=["POST"]),
            Route("/_queries", queries),
            Route("/_reset", reset, methods=["POST"]),
        ]
    )
    app.state.key = key
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--key", default="tvly-test-key")
    args = parser.parse_args()
    sock = socket.create_server(("127.0.0.1", args.port))
    config = uvicorn.Config(build_app(args.key), log_level="warning", lifespan="off")
    print(f"LISTENING http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


if __name__ == "__main__":
    main()
