"""Chat Completions stream chunks => Responses stream events (DESIGN.md §6, "Stream").

Owns the shape and order of the output events a translated response streams (PROTOCOL.md §0.4,
§4.1, §6): `output_item.added` before any delta of its `output_index`, `content_part.added` before
any text delta, an `output_index` per item in order of first appearance, the open item closed
before a new one starts (parallel tool calls stay open side by side until something else starts
or the stream ends), and every `.added` paired with its `.done`. Also the outcome: status,
`incomplete_details`, the final output items and usage.

Events come out as on the wire, without `sequence_number` and without lifecycle events
(`response.created` ... `response.completed`): both belong to the caller. Pure: no I/O.

Rules:
- `delta.reasoning_content` / `delta.reasoning` => `reasoning` item, `reasoning_text` part,
  `response.reasoning_text.delta`
- `delta.content` => `message` item, `output_text` part, `response.output_text.delta` (with the
  chunk's `logprobs.content` when logprobs were asked for, else `[]`)
- `delta.refusal` => `message` item, `refusal` part, `response.refusal.delta`
- `delta.tool_calls[i]` => `function_call` item per upstream `index` (a new `id` at a known index
  starts another call), `response.function_call_arguments.delta`
- empty, role-only or null deltas => nothing
- `finish_reason` `length` => incomplete (`max_output_tokens`), `content_filter` => incomplete
  (`content_filter`), anything else => completed; items still open at the end are closed with
  the outcome's status
- `usage` on any chunk (the last one wins) => Responses usage (PROTOCOL.md §1.4)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from worker.errors import RespoolError
from worker.ids import new_id

Event = dict[str, Any]

# PROTOCOL.md §4: per part type, the event type prefix of its deltas and the field its `.done`
# event (and the part itself) carries the full text in.
_PART_EVENTS = {
    "output_text": ("response.output_text", "text"),
    "refusal": ("response.refusal", "refusal"),
    "reasoning_text": ("response.reasoning_text", "text"),
}

# PROTOCOL.md §1.2: `incomplete_details.reason` per chat `finish_reason` that ends a response early.
_INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}


@dataclass(frozen=True)
class Outcome:
    """How a response ended: what the terminal lifecycle event and the stored record carry."""

    status: Literal["completed", "incomplete"]
    incomplete_details: dict[str, str] | None
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


@dataclass
class _Part:
    type: str
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    is_open: bool = True


@dataclass
class _Item:
    output_index: int
    fields: dict[str, Any]  # `type`, `id` and the item's other fixed fields
    parts: list[_Part] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)
    upstream_id: str | None = None  # function calls: the tool call id the upstream sent
    status: str = "in_progress"


@dataclass
class ChatStream:
    """The state of one translated stream; make it with `start_stream`."""

    include_logprobs: bool = False
    items: list[_Item] = field(default_factory=list)  # every item so far, by output_index
    current: _Item | None = None  # the open message or reasoning item
    calls: dict[int, _Item] = field(default_factory=dict)  # open function calls by upstream index
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None


def start_stream(*, include_logprobs: bool = False) -> ChatStream:
    """A fresh stream; `include_logprobs` puts the upstream's token logprobs on text events."""
    return ChatStream(include_logprobs=include_logprobs)


def translate_chunk(state: ChatStream, chunk: dict[str, Any]) -> list[Event]:
    """The events one `chat.completion.chunk` adds (often none)."""
    if chunk.get("usage"):
        state.usage = _responses_usage(chunk["usage"])
    choices = chunk.get("choices") or []
    if not choices:
        return []
    # respool never asks for n > 1, so the first choice is the only one.
    choice = choices[0]
    delta = choice.get("delta") or {}
    events = _on_reasoning(state, delta)
    events += _on_content(state, delta, choice.get("logprobs"))
    events += _on_refusal(state, delta)
    for call in delta.get("tool_calls") or []:
        events += _on_tool_call(state, call)
    if choice.get("finish_reason"):
        state.finish_reason = choice["finish_reason"]
    return events


def finish_stream(state: ChatStream) -> tuple[list[Event], Outcome]:
    """The `.done` events of every item still open, and the outcome."""
    reason = _INCOMPLETE_REASONS.get(state.finish_reason or "")
    status: Literal["completed", "incomplete"] = "incomplete" if reason else "completed"
    events = _close_open_items(state, status)
    outcome = Outcome(
        status=status,
        incomplete_details={"reason": reason} if reason else None,
        output=[_item_body(item) for item in state.items],
        usage=state.usage,
    )
    return events, outcome


# --- one function per kind of delta -------------------------------------------------------------


def _on_reasoning(state: ChatStream, delta: dict[str, Any]) -> list[Event]:
    # llama.cpp and vLLM before its rename send `reasoning_content`, vLLM after it and Ollama
    # `reasoning`; vLLM releases in between sent both with the same text (vllm-project/vllm#27752),
    # so one is read, never both.
    text = delta.get("reasoning_content") or delta.get("reasoning")
    return _append_text(state, "reasoning", "reasoning_text", text, [])


def _on_content(state: ChatStream, delta: dict[str, Any], logprobs: dict[str, Any] | None) -> list[Event]:
    tokens = ((logprobs or {}).get("content") or []) if state.include_logprobs else []
    return _append_text(state, "message", "output_text", delta.get("content"), [_logprob(t) for t in tokens])


def _on_refusal(state: ChatStream, delta: dict[str, Any]) -> list[Event]:
    return _append_text(state, "message", "refusal", delta.get("refusal"), [])


def _on_tool_call(state: ChatStream, call: dict[str, Any]) -> list[Event]:
    index = call.get("index") or 0
    function = call.get("function") or {}
    name, arguments = function.get("name"), function.get("arguments")
    item = state.calls.get(index)
    events: list[Event] = []
    if item is None or (call.get("id") and item.upstream_id and call["id"] != item.upstream_id):
        if not (call.get("id") or name):
            return _orphan_arguments(index, arguments)
        item, events = _open_call(state, index, call.get("id"), name)
    if name and not item.fields["name"]:
        item.fields["name"] = name
    if arguments:
        item.arguments.append(arguments)
        events.append(
            {"type": "response.function_call_arguments.delta", **_address(item), "delta": arguments}
        )
    return events


def _orphan_arguments(index: int, arguments: str | None) -> list[Event]:
    """Arguments for a call that never started or has ended: nothing if empty, else a failure."""
    if not arguments:
        return []
    raise RespoolError(f"The upstream streamed arguments for tool call {index} outside of that call.")


# --- opening and closing items and parts --------------------------------------------------------


def _append_text(
    state: ChatStream, item_type: str, part_type: str, text: str | None, logprobs: list[Event]
) -> list[Event]:
    if not text:
        return []
    item, events = _open_part(state, item_type, part_type)
    part = item.parts[-1]
    part.text.append(text)
    part.logprobs.extend(logprobs)
    prefix, _ = _PART_EVENTS[part_type]
    delta: Event = {
        "type": f"{prefix}.delta",
        **_address(item),
        "content_index": len(item.parts) - 1,
        "delta": text,
    }
    if part_type == "output_text":
        delta["logprobs"] = logprobs
    return [*events, delta]


def _open_part(state: ChatStream, item_type: str, part_type: str) -> tuple[_Item, list[Event]]:
    """The open item of `item_type` with an open `part_type` part, opened (others closed) as needed."""
    events: list[Event] = []
    item = state.current
    if item is None or item.fields["type"] != item_type:
        # PROTOCOL.md §4.1: one item at a time; what was open is done once something else starts.
        events += _close_open_items(state, "completed")
        item = _new_item(state, _fresh_fields(item_type))
        state.current = item
        events.append(_item_event("added", item))
    if not item.parts or item.parts[-1].type != part_type:
        if item.parts:
            events += _close_part(item, len(item.parts) - 1)
        item.parts.append(_Part(part_type))
        # PROTOCOL.md §0.4: `content_part.added` before any delta for its `content_index`.
        events.append(_part_event("added", item, len(item.parts) - 1))
    return item, events


def _fresh_fields(item_type: str) -> dict[str, Any]:
    if item_type == "message":
        return {"id": new_id("msg"), "type": "message", "role": "assistant"}
    return {"id": new_id("rs"), "type": "reasoning"}


def _open_call(
    state: ChatStream, index: int, call_id: str | None, name: str | None
) -> tuple[_Item, list[Event]]:
    events = _close_current(state)
    if index in state.calls:  # a new call id at a known index: the old call is over
        events += _close_item(state.calls.pop(index), "completed")
    fields = {
        "id": new_id("fc"),
        "type": "function_call",
        "call_id": call_id or new_id("call"),
        "name": name or "",
    }
    item = _new_item(state, fields)
    item.upstream_id = call_id
    state.calls[index] = item
    return item, [*events, _item_event("added", item)]


def _new_item(state: ChatStream, fields: dict[str, Any]) -> _Item:
    item = _Item(output_index=len(state.items), fields=fields)
    state.items.append(item)
    return item


def _close_current(state: ChatStream) -> list[Event]:
    item, state.current = state.current, None
    return _close_item(item, "completed") if item else []


def _close_open_items(state: ChatStream, status: str) -> list[Event]:
    items = sorted(
        [*state.calls.values(), *([state.current] if state.current else [])], key=lambda i: i.output_index
    )
    state.current, state.calls = None, {}
    return [event for item in items for event in _close_item(item, status)]


def _close_item(item: _Item, status: str) -> list[Event]:
    events: list[Event] = []
    if item.parts and item.parts[-1].is_open:
        events += _close_part(item, len(item.parts) - 1)
    if item.fields["type"] == "function_call":
        arguments = "".join(item.arguments)
        events.append(
            {"type": "response.function_call_arguments.done", **_address(item), "arguments": arguments}
        )
    item.status = status
    return [*events, _item_event("done", item)]


def _close_part(item: _Item, index: int) -> list[Event]:
    part = item.parts[index]
    part.is_open = False
    prefix, text_field = _PART_EVENTS[part.type]
    done: Event = {
        "type": f"{prefix}.done",
        **_address(item),
        "content_index": index,
        text_field: "".join(part.text),
    }
    if part.type == "output_text":
        done["logprobs"] = list(part.logprobs)
    return [done, _part_event("done", item, index)]


# --- shapes -------------------------------------------------------------------------------------


def _address(item: _Item) -> Event:
    return {"item_id": item.fields["id"], "output_index": item.output_index}


def _item_event(kind: str, item: _Item) -> Event:
    return {
        "type": f"response.output_item.{kind}",
        "output_index": item.output_index,
        "item": _item_body(item),
    }


def _part_event(kind: str, item: _Item, index: int) -> Event:
    part = _part_body(item.parts[index])
    return {"type": f"response.content_part.{kind}", **_address(item), "content_index": index, "part": part}


def _item_body(item: _Item) -> dict[str, Any]:
    """The item as it stands (PROTOCOL.md §1.5)."""
    body = {**item.fields}
    if item.fields["type"] == "function_call":
        body["arguments"] = "".join(item.arguments)
    else:
        if item.fields["type"] == "reasoning":
            body["summary"] = []  # open models stream raw reasoning text, never summaries
        body["content"] = [_part_body(part) for part in item.parts]
    body["status"] = item.status
    return body


def _part_body(part: _Part) -> dict[str, Any]:
    _, text_field = _PART_EVENTS[part.type]
    body: dict[str, Any] = {"type": part.type, text_field: "".join(part.text)}
    if part.type == "output_text":
        body.update(annotations=[], logprobs=list(part.logprobs))
    return body


def _logprob(token: dict[str, Any]) -> dict[str, Any]:
    """A chat token logprob => a Responses one (PROTOCOL.md §1.5, `logprobs`)."""
    top = [_top_logprob(candidate) for candidate in token.get("top_logprobs") or []]
    return {**_top_logprob(token), "top_logprobs": top}


def _top_logprob(token: dict[str, Any]) -> dict[str, Any]:
    text = str(token.get("token") or "")
    # `bytes` may be null upstream (OpenAI documents it); the Responses shape requires the list.
    return {
        "token": text,
        "logprob": token.get("logprob"),
        "bytes": token.get("bytes") or list(text.encode()),
    }


def _responses_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Chat usage => Responses usage (PROTOCOL.md §1.4): every int present, 0 where unreported."""
    input_tokens = int(usage.get("prompt_tokens") or 0)
    output_tokens = int(usage.get("completion_tokens") or 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": int(cached or 0), "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": int(reasoning or 0)},
        "total_tokens": int(usage.get("total_tokens") or input_tokens + output_tokens),
    }
