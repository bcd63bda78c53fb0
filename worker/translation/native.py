"""Translation for upstreams that speak the Responses API natively (DESIGN.md §6, "Native").

respool owns all state: the upstream is sent `store: false` and the whole conversation. Its
events are read for what the model said, never relayed as they are: the output is re-told through
`worker.translation.output`, so a client gets respool's ids, output and content indexes, and
`.added`/`.done` pairs whatever the upstream's quirks, and the final output is exactly what the
events add up to. Lifecycle events and sequence numbers are the caller's. Pure: no I/O.

Request rules:
- fields respool handles itself (`background`, `store`, `previous_response_id`, `conversation`, `stream`,
  `stream_options`, `metadata`) => not forwarded; `store: false`, `stream: true` always sent
- conversation items => `input`, without respool's item ids and statuses (a `store: false`
  upstream cannot resolve them), except reasoning items, which the upstream reads whole
- tools respool runs (`mcp`, DESIGN.md §10) => not forwarded: the tool loop offers each of their
  tools as a function (`ServerTool`, `mcp__<server_label>__<name>`), and `tool_choice` naming one
  as the choice of its function; an `mcp_call` of the conversation => a `function_call` and its
  `function_call_output` (the result, or the error, as the model is told it); a `web_search_call`
  respool ran => a `web_search` `function_call` and what it found; the listing, approval requests
  and answers => nothing (as on Chat Completions)

Stream rules (upstream event => what respool tells):
- `response.created` / `.queued` / `.in_progress`, `keepalive`, unknown events of no known item
  => nothing
- `output_item.added` message / reasoning => a new item of that type (its extra fields kept);
  function_call => a new call (of a tool respool runs: that tool's item, `mcp_call` or
  `mcp_approval_request`, which the tool loop runs or hands back); any other type (hosted tools)
  => a new item carried as given
- `content_part.added` (and vLLM's `reasoning_part.added`) => a new part of the item's kind:
  message parts as given (`output_text` / `refusal`), reasoning parts always `reasoning_text`
- `output_text.delta` / `refusal.delta` / `reasoning_text.delta` (and vLLM's older
  `reasoning.delta`, whose `delta` may be `{"content": ...}`) => text of that kind, appended to
  the item the upstream names; an item never announced continues the open item of that kind, or
  starts one. The upstream's `content_index` is not trusted (vLLM numbers every token anew, and
  counts on across items)
- `reasoning_summary_part.added` => the next summary; `reasoning_summary_text.delta` => its text
- `function_call_arguments.delta` => arguments of the call the upstream names (or the one open)
- `output_text.annotation.added` => an annotation on the open text part
- `.done` of text, parts and arguments => only what the deltas did not already say (an upstream
  that sends a whole text at `.done` without deltas)
- `output_item.done` => that item is done, with the upstream's extra fields (`encrypted_content`)
- events of a hosted tool item (`response.web_search_call.searching`, ...) => relayed with
  respool's `item_id` and `output_index`
- `response.completed` / `.incomplete` => the outcome (status, incomplete_details, usage with
  every count PROTOCOL.md §1.4 requires); the output is respool's own
- `response.failed` / `error` => `UpstreamStreamError` with the upstream's message
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from worker.errors import UpstreamStreamError
from worker.protocol.tools import RUN_BY_RESPOOL
from worker.translation import output
from worker.translation.chat_messages import SEARCH_RESULTS, search_text, tool_result_text
from worker.translation.chat_stream import Outcome
from worker.translation.chat_tools import CallShape, ServerTool, server_tool_choice
from worker.translation.output import CALLS, EventBody, Item, Output

_NOT_FORWARDED = {
    "background",
    "store",
    "previous_response_id",
    "conversation",
    "stream",
    "stream_options",
    "metadata",
    "input",
    "context_management",  # respool compacts (worker/runner/compacting.py)
}
_IGNORED = {"response.created", "response.queued", "response.in_progress", "keepalive"}
_DONE = {"response.completed", "response.incomplete"}
_MODELLED = {"message", "reasoning", "function_call"}
# Text deltas: upstream event type => (item type, part type).
_TEXT_DELTAS = {
    "response.output_text.delta": ("message", "output_text"),
    "response.refusal.delta": ("message", "refusal"),
    "response.reasoning_text.delta": ("reasoning", "reasoning_text"),
    "response.reasoning.delta": ("reasoning", "reasoning_text"),  # vLLM before reasoning_text
}
# Text `.done` events: upstream event type => (item type, part type, the field with the whole text).
_TEXT_DONES = {
    "response.output_text.done": ("message", "output_text", "text"),
    "response.refusal.done": ("message", "refusal", "refusal"),
    "response.reasoning_text.done": ("reasoning", "reasoning_text", "text"),
    "response.reasoning.done": ("reasoning", "reasoning_text", "text"),
}


@dataclass
class NativeStream:
    """The state of one native stream: respool's output, and the upstream's item ids mapped onto it."""

    output: Output = field(default_factory=Output)
    items: dict[str, Item] = field(default_factory=dict)  # upstream item id => respool's item
    by_index: dict[int, Item] = field(default_factory=dict)  # upstream output_index => respool's item
    outcome: Outcome | None = None
    call_shapes: dict[str, CallShape] = field(default_factory=dict)  # function name => a tool respool runs


def start_stream(out: Output, server_tools: tuple[ServerTool, ...] = ()) -> NativeStream:
    """The state of a native stream whose items go on `out` (a tool loop's output so far)."""
    return NativeStream(output=out, call_shapes={tool.chat_name: tool.shape() for tool in server_tools})


def to_responses_request(
    request: dict[str, Any],
    conversation: list[dict[str, Any]],
    model: str,
    server_tools: tuple[ServerTool, ...] = (),
) -> dict[str, Any]:
    """The body for the upstream's `POST /responses`."""
    body = {key: value for key, value in request.items() if key not in _NOT_FORWARDED and value is not None}
    items = [native for item in conversation for native in _native_items(item)]
    body.update(model=model, input=items, store=False, stream=True)
    tools = [tool for tool in body.get("tools") or [] if tool.get("type") not in RUN_BY_RESPOOL]
    tools += [_function_tool(tool) for tool in server_tools]
    choice = server_tool_choice(body.get("tool_choice"), server_tools)
    body.pop("tools", None)
    body.pop("tool_choice", None)
    if tools:
        body["tools"] = tools
        if choice is not None:
            body["tool_choice"] = choice
    elif choice in ("none", "auto"):
        body["tool_choice"] = choice
    return body


def _function_tool(tool: ServerTool) -> dict[str, Any]:
    function = {"type": "function", "name": tool.chat_name, "parameters": tool.parameters, "strict": False}
    return {**function, "description": tool.description} if tool.description else function


def _native_items(item: dict[str, Any]) -> list[dict[str, Any]]:
    """A conversation item as the upstream is sent it (rules above)."""
    kind = item.get("type")
    if kind in ("mcp_list_tools", "mcp_approval_request", "mcp_approval_response"):
        return []
    if kind == "web_search_call" and SEARCH_RESULTS in item:  # a search respool ran
        if item.get("status") in ("in_progress", "searching", "incomplete"):
            return []
        query = orjson.dumps({"query": (item.get("action") or {}).get("query") or ""}).decode()
        return _function_pair(str(item["id"]), "web_search", query, search_text(item))
    if kind != "mcp_call":
        return [_strip(item)]
    if item.get("output") is None and item.get("error") is None:
        return []  # a call cut short: the model never saw it finish
    name = f"mcp__{item.get('server_label')}__{item.get('name')}"
    return _function_pair(str(item["id"]), name, item.get("arguments") or "{}", tool_result_text(item))


def _function_pair(call_id: str, name: str, arguments: str, result: str) -> list[dict[str, Any]]:
    call = {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}
    return [call, {"type": "function_call_output", "call_id": call_id, "output": result}]


def _strip(item: dict[str, Any]) -> dict[str, Any]:
    if item.get("type") == "reasoning":
        return item
    return {key: value for key, value in item.items() if key not in {"id", "status"}}


def translate_event(state: NativeStream, event: dict[str, Any]) -> list[EventBody]:
    """respool's events for one upstream event (often none)."""
    kind = str(event.get("type", ""))
    if kind in _IGNORED:
        return []
    if kind in _DONE:
        state.outcome = _outcome(state, event.get("response") or {})
        return []
    if kind in {"response.failed", "error"}:
        raise UpstreamStreamError(failure_message(event))
    handler = _HANDLERS.get(kind)
    if handler is not None:
        return handler(state, event)
    if kind in _TEXT_DELTAS:
        return _on_text_delta(state, event)
    if kind in _TEXT_DONES:
        return _on_text_done(state, event)
    return _on_other(state, event)


def finish_stream(state: NativeStream) -> tuple[list[EventBody], Outcome]:
    """The `.done` events of items the upstream left open, and the outcome.

    An upstream stream that ended without a terminal event is a failure.
    """
    if state.outcome is None:
        raise UpstreamStreamError("the upstream's stream ended before the response was complete")
    events = output.close_open(state.output, state.outcome.status)
    outcome = Outcome(
        status=state.outcome.status,
        incomplete_details=state.outcome.incomplete_details,
        output=output.output_items(state.output),
        usage=state.outcome.usage,
    )
    return events, outcome


# --- one function per kind of upstream event ----------------------------------------------------


def _on_item_added(state: NativeStream, event: dict[str, Any]) -> list[EventBody]:
    item = event.get("item") or {}
    kind, upstream_id = str(item.get("type", "")), _item_id(event)
    shape = state.call_shapes.get(str(item.get("name"))) if kind == "function_call" else None
    if shape is not None:
        fields = {"server_label": shape.server_label}
        events = output.open_call(
            state.output, upstream_id, None, shape.name, fields, item_type=shape.item_type
        )
        opened = output.call(state.output, upstream_id)
        assert opened is not None
        events += output.append_arguments(opened, item.get("arguments"))
    elif kind == "function_call":
        events = output.open_call(state.output, upstream_id, item.get("call_id"), item.get("name"), item)
        opened = output.call(state.output, upstream_id)
        assert opened is not None
        events += output.append_arguments(opened, item.get("arguments"))
    elif kind in _MODELLED:
        events = output.start_item(state.output, kind, item)
        opened = state.output.current
    else:
        events = output.open_other(state.output, upstream_id, item)
        opened = output.call(state.output, upstream_id)
    assert opened is not None
    state.items[upstream_id] = opened
    if isinstance(event.get("output_index"), int):
        state.by_index[event["output_index"]] = opened
    return events


def _on_part_added(state: NativeStream, event: dict[str, Any]) -> list[EventBody]:
    part_type = str((event.get("part") or {}).get("type") or "output_text")
    item_type = _known_type(state, event) or ("reasoning" if part_type == "reasoning_text" else "message")
    if item_type == "reasoning":
        part_type = "reasoning_text"  # vLLM announces reasoning parts as output_text
    elif part_type not in {"output_text", "refusal"}:
        part_type = "output_text"
    events = _follow(state, event, item_type)
    return events + output.start_part(state.output, item_type, part_type)


def _on_text_delta(state: NativeStream, event: dict[str, Any]) -> list[EventBody]:
    item_type, part_type = _TEXT_DELTAS[str(event["type"])]
    delta = event.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else delta  # vLLM's older object form
    events = _follow(state, event, item_type)
    logprobs = event.get("logprobs") or []
    return events + output.append_text(state.output, item_type, part_type, text, logprobs)


def _on_text_done(state: NativeStream, event: dict[str, Any]) -> list[EventBody]:
    item_type, part_type, text_field = _TEXT_DONES[str(event["type"])]
    item = _known_item(state, event)
    whole = str(event.get(text_field) or "")
    part = item.parts[-1] if item is not None and item.parts else None
    said = "".join(part.text) if part is not None and part.type == part_type else ""
    if not whole.startswith(said) or whole == said:
        return []  # nothing new, or a text that contradicts the deltas: the deltas stand
    events = _follow(state, event, item_type)
    return events + output.append_text(state.output, item_type, part_type, whole[len(said) :])


def _on_summary_part_added(state: NativeStream, event: dict[str, Any]) -> list[EventBody]:
    events = _follow(state, event, "reasoning")
    return events + output.append_summary(state.output, None, new_part=True)


def _on_summary_delta(state: NativeStream, event: dict[str, Any]) -> list[EventBody]:
    events = _follow(state, event, "reasoning")
    return events + output.append_summary(state.output, event.get("delta"))


def _on_arguments_delta(state: NativeStream, event: dict[str, Any]) -> list[EventBody]:
    item = _call_for(state, event)
    return output.append_arguments(item, event.get("delta"))


def _on_arguments_done(state: NativeStream, event: dict[str, Any]) -> list[EventBody]:
    item = _call_for(state, event)
    said, whole = "".join(item.arguments), str(event.get("arguments") or "")
    if whole.startswith(said) and whole != said:
        return output.append_arguments(item, whole[len(said) :])
    return []


def _on_annotation(state: NativeStream, event: dict[str, Any]) -> list[EventBody]:
    annotation = event.get("annotation")
    if not isinstance(annotation, dict):
        return []
    return _follow(state, event, "message") + output.add_annotation(state.output, annotation)


def _on_item_done(state: NativeStream, event: dict[str, Any]) -> list[EventBody]:
    given = event.get("item") or {}
    item = _done_item(state, event, given)
    if item is None:  # an item told only now, whole
        events = _on_item_added(state, {"item": {**given, "status": "in_progress"}})
        item = state.items[_item_id(event)]
        events += _fill_from(state, item, given)
    else:
        events = _fill_from(state, item, given)
    if item.type != output.MCP_APPROVAL and not item.runs_here:  # a call of respool's keeps its own fields
        output.update_fields(item, given)
    key = next((key for key, open_item in state.output.side.items() if open_item is item), None)
    if key is not None:
        return events + output.close_side(state.output, key)
    if state.output.current is item:
        return events + output.close_current(state.output)
    return events


def _done_item(state: NativeStream, event: dict[str, Any], given: dict[str, Any]) -> Item | None:
    """The item an `output_item.done` ends: by its id, by `item_id` (vLLM's harmony tool calls put
    the id there and announced the call under a stale one), or by the upstream's output_index."""
    for upstream_id in (given.get("id"), given.get("item_id")):
        if upstream_id and str(upstream_id) in state.items:
            return state.items[str(upstream_id)]
    item = state.by_index.get(event.get("output_index", -1))
    return item if item is not None and item.type == given.get("type") else None


def _fill_from(state: NativeStream, item: Item, given: dict[str, Any]) -> list[EventBody]:
    """What a whole item at `.done` says that no delta did: its arguments, or its text."""
    if item.type in CALLS:
        return _on_arguments_done(state, {"item_id": item.id, "arguments": given.get("arguments")})
    if item.type != "message" or item.parts or not isinstance(given.get("content"), list):
        return []
    events: list[EventBody] = []
    for part in given["content"]:
        kind = "refusal" if part.get("type") == "refusal" else "output_text"
        events += output.append_text(state.output, "message", kind, part.get("refusal") or part.get("text"))
    return events


def _on_other(state: NativeStream, event: dict[str, Any]) -> list[EventBody]:
    """An event of a hosted tool item: relayed re-addressed; of no known item: nothing."""
    item = state.items.get(str(event.get("item_id", "")))
    if item is None or item.body is None:
        return []
    relayed = {key: value for key, value in event.items() if key != "sequence_number"}
    return [{**relayed, **output.address(item)}]


def _nothing(state: NativeStream, event: dict[str, Any]) -> list[EventBody]:
    """A `.done` whose content respool already told from the deltas, or tells at `output_item.done`."""
    return []


_HANDLERS = {
    "response.output_item.added": _on_item_added,
    "response.output_item.done": _on_item_done,
    "response.content_part.added": _on_part_added,
    "response.reasoning_part.added": _on_part_added,  # vLLM's name for a reasoning content part
    "response.content_part.done": _nothing,
    "response.reasoning_part.done": _nothing,
    "response.reasoning_summary_part.added": _on_summary_part_added,
    "response.reasoning_summary_part.done": _nothing,
    "response.reasoning_summary_text.delta": _on_summary_delta,
    "response.reasoning_summary_text.done": _nothing,
    "response.function_call_arguments.delta": _on_arguments_delta,
    "response.function_call_arguments.done": _on_arguments_done,
    "response.output_text.annotation.added": _on_annotation,
}


# --- finding the item an upstream event is about ------------------------------------------------


def _item_id(event: dict[str, Any]) -> str:
    return str(event.get("item_id") or (event.get("item") or {}).get("id") or event.get("output_index", ""))


def _known_item(state: NativeStream, event: dict[str, Any]) -> Item | None:
    return state.items.get(_item_id(event))


def _known_type(state: NativeStream, event: dict[str, Any]) -> str | None:
    item = _known_item(state, event)
    return item.type if item is not None else None


def _follow(state: NativeStream, event: dict[str, Any], item_type: str) -> list[EventBody]:
    """Make the item the event names the open one of `item_type`, and remember it under its id.

    A known item that is still open stays; an id never announced continues the open item of that
    type (vLLM names a message only in its parts), or starts a new one.
    """
    upstream_id = _item_id(event)
    item = state.items.get(upstream_id)
    current = state.output.current
    if item is not None and item is current and item.type == item_type:
        return []
    events: list[EventBody] = []
    if current is None or current.type != item_type or (item is not None and item is not current):
        events = output.start_item(state.output, item_type)
    state.items[upstream_id] = state.output.current  # type: ignore[assignment]
    return events


def _call_for(state: NativeStream, event: dict[str, Any]) -> Item:
    item = state.items.get(_item_id(event))
    if item is not None and item.type in CALLS:
        return item
    open_calls = [open_item for open_item in state.output.side.values() if open_item.type in CALLS]
    if open_calls:
        return open_calls[-1]
    raise UpstreamStreamError("the upstream streamed function call arguments outside of any call")


def _outcome(state: NativeStream, response: dict[str, Any]) -> Outcome:
    incomplete = response.get("status") == "incomplete"
    return Outcome(
        status="incomplete" if incomplete else "completed",
        incomplete_details=(response.get("incomplete_details") or {"reason": "max_output_tokens"})
        if incomplete
        else None,
        output=[],  # respool's own, made by finish_stream
        usage=usage_of(response.get("usage")),
    )


def usage_of(usage: Any) -> dict[str, Any] | None:
    """The upstream's usage with every int PROTOCOL.md §1.4 requires (OpenAI omits `cache_write_tokens`)."""
    if not isinstance(usage, dict):
        return None
    input_tokens, output_tokens = int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)
    input_details = usage.get("input_tokens_details") or {}
    output_details = usage.get("output_tokens_details") or {}
    return {
        **usage,
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0, **input_details},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0, **output_details},
        "total_tokens": int(usage.get("total_tokens") or input_tokens + output_tokens),
    }


def failure_message(event: dict[str, Any]) -> str:
    error = (event.get("response") or {}).get("error") or event.get("error") or event
    return str(error.get("message") or "the upstream reported a failure")
