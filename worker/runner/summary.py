"""Asking the model for a compaction's summary: the one upstream call that both
`POST /responses/compact` (in the API process, as `input_tokens` counts there) and a compaction
inside a response (in the worker) make.

The model is sent the conversation to compact (already expanded, `compaction.expand`) and then a
user message asking for the summary (`compaction.SUMMARY_PROMPT`), streamed like any turn (the
same client, retry policy and errors as `worker.runner.upstream`), on either kind of upstream; the text it
answers (its reasoning left out) is the summary.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx2

from worker.errors import UpstreamError
from worker.protocol import compaction
from worker.routing import Route, UpstreamApi
from worker.runner.synthetic import synthetic_chunks
from worker.runner.upstream import (
    CHAT_STREAM,
    RESPONSES_STREAM,
    Call,
    RetryPolicy,
    consume_all,
    post_json,
    stream_into,
    stream_json,
)
from worker.translation import chat_request, chat_stream, native

log = logging.getLogger("respool.runner")

_FAILED = ("response.failed", "error")


@dataclass(frozen=True)
class Summary:
    text: str
    usage: dict[str, Any] | None  # the summary call's, in the Responses shape


def chat_call(
    http: httpx2.AsyncClient, route: Route, body: dict[str, Any], retry: RetryPolicy, synthetic_delay: float
) -> Call:
    """A chat route's streamed call for `body`, handing each chunk to the consumer it is given: the
    synthetic model's, or its upstream's (`stream_into`)."""
    if route.api is UpstreamApi.SYNTHETIC:
        return partial(consume_all, synthetic_chunks(body, synthetic_delay))
    return partial(stream_into, http, route, "/chat/completions", body, retry, CHAT_STREAM)


def chat_chunks(
    http: httpx2.AsyncClient, route: Route, body: dict[str, Any], retry: RetryPolicy, synthetic_delay: float
) -> AsyncGenerator[dict[str, Any]]:
    """A chat route's streamed chunks for `body`: the synthetic model's, or its upstream's."""
    if route.api is UpstreamApi.SYNTHETIC:
        return synthetic_chunks(body, synthetic_delay)
    return stream_json(http, route, "/chat/completions", body, retry, CHAT_STREAM)


async def summarize(
    http: httpx2.AsyncClient,
    route: Route,
    items: Sequence[dict[str, Any]],
    *,
    instructions: str | None,
    retry: RetryPolicy,
    synthetic_delay: float = 0.0,
    progress: Callable[[], None] | None = None,
    max_tokens: int = 2048,
) -> Summary:
    """The model's summary of `items`, at most `max_tokens` long (a summary cut there is kept, and
    logged); `progress` is called as its text comes. Raises `UpstreamError` if the upstream fails
    or answers no text."""
    model = route.upstream_model or route.model
    conversation = compaction.summary_request(items)
    request: dict[str, Any] = {"max_output_tokens": max_tokens}
    if instructions:
        request["instructions"] = instructions
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    cut = False
    if route.api is UpstreamApi.RESPONSES:
        body = native.to_responses_request(request, conversation, model)
        async for event in stream_json(http, route, "/responses", body, retry, RESPONSES_STREAM):
            kind = event.get("type")
            if kind == "response.output_text.delta":
                pieces.append(str(event.get("delta") or ""))
            elif kind in ("response.completed", "response.incomplete"):
                usage = native.usage_of((event.get("response") or {}).get("usage"))
                cut = kind == "response.incomplete"
            elif kind in _FAILED:
                raise UpstreamError(native.failure_message(event))
            else:
                continue
            if progress is not None and kind == "response.output_text.delta":
                progress()
    else:
        body = chat_request.to_chat_request(request, conversation, model)
        async for chunk in chat_chunks(http, route, body, retry, synthetic_delay):
            if isinstance(chunk.get("usage"), dict):
                usage = chat_stream.responses_usage(chunk["usage"])
            for choice in chunk.get("choices") or []:
                cut = cut or choice.get("finish_reason") == "length"
                text = (choice.get("delta") or {}).get("content")
                if text:
                    pieces.append(str(text))
                    if progress is not None:
                        progress()
    text = "".join(pieces).strip()
    if not text:
        raise UpstreamError("The model answered no summary to compact the conversation with.")
    if cut:
        log.warning(
            "a compaction's summary was cut at %d tokens (RESPOOL_COMPACT_SUMMARY_TOKENS)", max_tokens
        )
    return Summary(text, usage)


async def upstream_compact(
    http: httpx2.AsyncClient,
    route: Route,
    items: Sequence[dict[str, Any]],
    model: str,
    instructions: str | None,
    retry: RetryPolicy,
) -> dict[str, Any] | None:
    """A Responses upstream's own compaction of `items` (its `POST /responses/compact`, OpenAI's),
    or None when it serves no such route (404, 405 or 501: vLLM's, for one)."""
    request: dict[str, Any] = {"instructions": instructions} if instructions else {}
    sent = native.to_responses_request(request, list(items), model)
    body = {key: value for key, value in sent.items() if key in ("model", "input", "instructions")}
    try:
        answered = await post_json(http, route, "/responses/compact", body, retry)
    except UpstreamError as exc:
        if exc.status in (404, 405, 501):
            return None
        raise
    if answered.get("object") != "response.compaction" or not isinstance(answered.get("output"), list):
        raise UpstreamError("the upstream's /responses/compact answered something other than a compaction")
    return {**answered, "usage": native.usage_of(answered.get("usage") or {})}
