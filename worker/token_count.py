"""Counting a request's input tokens (`POST /v1/responses/input_tokens`), as exactly as the
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
import time
from dataclasses import dataclass
from typing import Any

import httpx2
import orjson

from worker.routing import Route, UpstreamApi

log = logging.getLogger("respool.service")

ESTIMATE_CHARACTERS_PER_TOKEN = 4
TIMEOUT_SECONDS = 10.0
MISSING_SECONDS = 300.0
# Tokenizer URLs (and the model asked) the server answered 404 or 405 (it has no such route), until
# when: this process estimates meanwhile rather than ask again on every count.
_missing: dict[tuple[str, str], float] = {}


def server_root(base_url: str) -> str:
    """The server a base URL is on: vLLM's and llama.cpp's `/tokenize` sit beside `/v1`, not under it."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


def estimate(sent: dict[str, Any]) -> int:
    """A token per 4 characters of what the model would be sent (its messages or input, and tools)."""
    shown = {key: sent.get(key) for key in ("messages", "input", "instructions", "tools") if sent.get(key)}
    return math.ceil(len(orjson.dumps(shown).decode()) / ESTIMATE_CHARACTERS_PER_TOKEN)


@dataclass(frozen=True)
class Count:
    """A count of input tokens; how it was made (`tokenizer` or `estimate`); and the model's context
    length where the tokenizer told it (vLLM's `max_model_len`)."""

    tokens: int
    how: str
    context_length: int | None = None


async def count(http: httpx2.AsyncClient, route: Route, sent: dict[str, Any]) -> Count:
    """The input tokens of `sent` (the body the upstream would get), and how they were counted."""
    if route.api is UpstreamApi.SYNTHETIC or not route.base_url:
        return Count(estimate(sent), "estimate")
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
        return Count(estimate(sent), "estimate")
    return Count(counted[0], "tokenizer", counted[1])


async def _ask(
    http: httpx2.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], field: str
) -> tuple[int, int | None] | None:
    """A count from a tokenizer's answer (its `field`, or the length of its `tokens`) and the
    context length it names (`max_model_len`); None if it gives no count."""
    data = await _post(http, url, body, headers)
    if data is None:
        return None
    counted = data.get(field)
    if not isinstance(counted, int) and isinstance(data.get("tokens"), list):
        counted = len(data["tokens"])
    if not isinstance(counted, int):
        return None
    context = data.get("max_model_len")
    return counted, context if isinstance(context, int) and context > 0 else None


async def _post(
    http: httpx2.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any] | None:
    """The route's JSON answer, or None. A route the server does not have (404, 405: llama-cpp-python
    has neither `/tokenize` nor `/apply-template`) is not asked again for `MISSING_SECONDS`."""
    known = (url, str(body.get("model")))  # a server serves its routes for every model; a test's, not
    if _missing.get(known, 0.0) > time.monotonic():
        return None
    try:
        answer = await http.post(url, json=body, headers=headers, timeout=TIMEOUT_SECONDS)
        if answer.status_code == 200:
            data = answer.json()
            if isinstance(data, dict):
                return data
        if answer.status_code in (404, 405):
            _missing[known] = time.monotonic() + MISSING_SECONDS
        log.info("%s answered %s", url, answer.status_code)
    except (httpx2.HTTPError, ValueError) as exc:
        log.info("%s failed (%s)", url, type(exc).__name__)
    return None
