"""Counting a request's input tokens (`POST /v1/responses/input_tokens`, issue 18), as exactly as the
upstream lets us:

- a Chat Completions upstream: its tokenizer, `POST <server>/tokenize` with the chat messages (and
  tools) the request would be sent as (vLLM and SGLang count them through the model's chat template;
  the answer's `count`, or its `tokens`' length); a server whose `/tokenize` takes text only
  (llama.cpp's `llama-server`: `{content}`) is asked to render the messages first
  (`POST <server>/apply-template`), then to tokenize that prompt;
- a Responses upstream: its own `POST <base>/responses/input_tokens` (OpenAI's), sent the request as
  respool would send it;
- otherwise (the synthetic model, an upstream without either route, one that does not answer in
  time): an estimate, a token per 4 characters of the JSON the model would be sent, rounded up.

Which one answered is told in the `x-respool-token-count` header (`tokenizer` or `estimate`): the SDK's
`InputTokenCountResponse` has no field for it.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import httpx
import orjson

from worker.routing import Route, UpstreamApi

log = logging.getLogger("respool.service")

ESTIMATE_CHARACTERS_PER_TOKEN = 4
TIMEOUT_SECONDS = 10.0


def server_root(base_url: str) -> str:
    """The server a base URL is on: vLLM's and llama.cpp's `/tokenize` sit beside `/v1`, not under it."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


def estimate(sent: dict[str, Any]) -> int:
    """A token per 4 characters of what the model would be sent (its messages or input, and tools)."""
    shown = {key: sent.get(key) for key in ("messages", "input", "instructions", "tools") if sent.get(key)}
    return math.ceil(len(orjson.dumps(shown).decode()) / ESTIMATE_CHARACTERS_PER_TOKEN)


async def count(http: httpx.AsyncClient, route: Route, sent: dict[str, Any]) -> tuple[int, str]:
    """The input tokens of `sent` (the body the upstream would get), and how they were counted."""
    if route.api is UpstreamApi.SYNTHETIC or not route.base_url:
        return estimate(sent), "estimate"
    key = route.api_key()
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if route.api is UpstreamApi.RESPONSES:
        url = route.base_url.rstrip("/") + "/responses/input_tokens"
        body = {name: value for name, value in sent.items() if name not in ("stream", "store")}
        counted = await _ask(http, url, body, headers, "input_tokens")
    else:
        root = server_root(route.base_url)
        body = {"model": sent["model"], "messages": sent["messages"], "add_generation_prompt": True}
        if sent.get("tools"):
            body["tools"] = sent["tools"]
        counted = await _ask(http, root + "/tokenize", body, headers, "count")
        if counted is None:  # llama-server: render the messages, then tokenize the prompt
            rendered = await _post(http, root + "/apply-template", body, headers)
            prompt = rendered.get("prompt") if rendered else None
            if isinstance(prompt, str):
                tokenize = {"content": prompt, "add_special": True}
                counted = await _ask(http, root + "/tokenize", tokenize, headers, "count")
    if counted is None:
        return estimate(sent), "estimate"
    return counted, "tokenizer"


async def _ask(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], field: str
) -> int | None:
    """A count from a tokenizer's answer: its `field`, or the length of its `tokens`; None if none."""
    data = await _post(http, url, body, headers)
    if data is None:
        return None
    counted = data.get(field)
    if not isinstance(counted, int) and isinstance(data.get("tokens"), list):
        counted = len(data["tokens"])
    return counted if isinstance(counted, int) else None


async def _post(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any] | None:
    try:
        answer = await http.post(url, json=body, headers=headers, timeout=TIMEOUT_SECONDS)
        if answer.status_code == 200:
            data = answer.json()
            if isinstance(data, dict):
                return data
        log.info("%s answered %s", url, answer.status_code)
    except (httpx.HTTPError, ValueError) as exc:
        log.info("%s failed (%s)", url, type(exc).__name__)
    return None
