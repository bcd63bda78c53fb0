"""Compaction inside a response (PROTOCOL.md §11), on either kind of upstream.

- Every turn is sent its conversation expanded (`compaction.expand`): a compaction item of
  respool's becomes what it keeps and its summary, and what came before a window is left out.
- `POST /responses/compact` runs here too, as a response that is not stored (`compact_request`).
- `compaction_trigger` as the last input item: the response compacts its conversation and ends
  `completed` with the one `compaction` item as its output (no answer).
- `context_management: [{type: "compaction", compact_threshold}]`: before each turn (a tool loop's
  included) the input is counted (`worker.token_count`); past the threshold the conversation is
  compacted first (a `compaction` output item), and the turn runs on the compacted conversation.
  Without a threshold: 80% of the model's context length where its tokenizer says it, else
  RESPOOL_COMPACT_THRESHOLD_TOKENS.

A compaction is told as `output_item.added` (its `encrypted_content` empty), a
`response.compaction.compacting` event as each piece of the summary is sampled, and
`output_item.done` with the sealed content; its usage counts in the response's. A fault while
compacting ends the item `incomplete` and fails the response, as a fault mid-answer does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from worker import token_count
from worker.errors import MidStreamError, UpstreamError
from worker.events.writer import ResponseWriter
from worker.postgres import store
from worker.protocol import compaction
from worker.routing import Route, UpstreamApi
from worker.runner.runtime import Runtime
from worker.runner.summary import summarize, upstream_compact
from worker.translation import chat_request, native, output
from worker.translation.chat_stream import Outcome, add_usage
from worker.translation.chat_tools import ServerTool
from worker.translation.output import Output

Turn = Callable[..., Awaitable[Outcome]]
CONTEXT_SHARE = 0.8  # of the model's context, the threshold when the request names none


def applies(request: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
    """Whether a response's turns need this module (else they are sent the conversation as it is)."""
    return threshold_of(request) is not None or compaction.has_compaction(conversation)


def is_triggered(conversation: list[dict[str, Any]]) -> bool:
    return bool(conversation) and conversation[-1].get("type") == compaction.TRIGGER


def threshold_of(request: dict[str, Any]) -> int | None:
    """The request's compaction threshold: its `compact_threshold`, 0 for "the default", None when
    it asks for no compaction."""
    for entry in request.get("context_management") or []:
        if entry.get("type") == "compaction":
            return int(entry.get("compact_threshold") or 0)
    return None


async def run_turn(
    owner: str,
    turn: Turn,
    rt: Runtime,
    writer: ResponseWriter,
    route: Route,
    model: str,
    request: dict[str, Any],
    out: Output,
    server_tools: tuple[ServerTool, ...],
    conversation: list[dict[str, Any]],
) -> Outcome:
    """`turn` on the conversation expanded, compacted first when it is past the threshold."""
    sealer = await rt.sealer()
    items = compaction.expand(conversation, sealer, owner)
    wanted = threshold_of(request)
    usage = None
    if wanted is not None:
        if route.api is UpstreamApi.RESPONSES:
            sent = native.to_responses_request(request, items, model, server_tools)
        else:
            sent = chat_request.to_chat_request(request, items, model, server_tools)
        counted = await token_count.count(rt.http, route, sent)
        threshold = wanted or _default_threshold(rt, counted.context_length)
        if counted.tokens > threshold:
            made, usage = await compact(rt, writer, route, request, out, owner, items, threshold // 2)
            items = compaction.expand([made], sealer, owner)
    outcome = await turn(rt, writer, route, model, request, out, server_tools, items)
    return replace(outcome, usage=add_usage(usage, outcome.usage))


async def compact_only(
    rt: Runtime, writer: ResponseWriter, route: Route, stored: store.StoredResponse
) -> Outcome:
    """A response whose input ends with a `compaction_trigger`: its conversation compacted, the
    `compaction` item its whole output."""
    items = compaction.expand(stored.conversation, await rt.sealer(), stored.owner)
    budget = (threshold_of(stored.request) or rt.compact_threshold_tokens) // 2
    out = Output()
    _, usage = await compact(rt, writer, route, stored.request, out, stored.owner, items, budget)
    return Outcome("completed", None, output.output_items(out), usage)


async def compact_request(
    rt: Runtime, writer: ResponseWriter, route: Route, stored: store.StoredResponse
) -> Outcome:
    """A `POST /responses/compact` (its request carries `compaction.COMPACT`): the window's user
    messages, then a compaction item of it; on a Responses upstream that serves
    `/responses/compact`, that answer's items instead."""
    items = compaction.expand(stored.conversation, await rt.sealer(), stored.owner)
    out = Output()
    if route.api is UpstreamApi.RESPONSES:
        model = route.upstream_model or route.model
        instructions = stored.request.get("instructions")
        answered = await upstream_compact(rt.http, route, items, model, instructions, rt.retry)
        if answered is not None:
            for entry in answered["output"]:
                writer.send(output.add_whole(out, entry))
            await writer.drain()
            return Outcome("completed", None, output.output_items(out), answered["usage"])
    for user in compaction.user_messages(items):
        writer.send(output.add_whole(out, user))
    _, usage = await compact(rt, writer, route, stored.request, out, stored.owner, items, None, window=False)
    return Outcome("completed", None, output.output_items(out), usage)


async def compact(
    rt: Runtime,
    writer: ResponseWriter,
    route: Route,
    request: dict[str, Any],
    out: Output,
    owner: str,
    items: list[dict[str, Any]],
    user_budget: int | None,
    *,
    window: bool = True,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Tell a compaction of `items` (expanded) into `out`: the item and the summary's usage."""
    writer.send(output.open_compaction(out))
    try:
        summary = await summarize(
            rt.http,
            route,
            items,
            instructions=request.get("instructions"),
            retry=rt.retry,
            synthetic_delay=rt.synthetic_delay_seconds,
            progress=lambda: writer.send(output.compacting(out)),
            max_tokens=rt.compact_summary_tokens,
        )
    except UpstreamError as exc:
        await writer.drain()
        await writer.emit(output.close_open(out, "incomplete"))
        raise MidStreamError(exc, output.output_items(out)) from exc
    kept = compaction.kept_messages(items, window=window, user_budget=user_budget)
    sealed = compaction.Sealed(owner, summary.text, kept, window=window)
    made, events = output.end_compaction(out, (await rt.sealer()).seal(sealed))
    writer.send(events)
    await writer.drain()
    return made, summary.usage


def _default_threshold(rt: Runtime, context_length: int | None) -> int:
    if context_length:
        return int(context_length * CONTEXT_SHARE)
    return rt.compact_threshold_tokens
