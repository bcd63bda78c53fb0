"""Output items under construction: how what a model says is told as Responses stream events.

Both translations drive this one state machine: `chat_stream` from Chat Completions chunks and
`native` from an upstream's Responses events. They decide *what* the model said (text, a refusal,
reasoning, a tool call); this module decides how it is told (PROTOCOL.md §0.4, §4.1, §6):
`output_item.added` before any delta of its `output_index`, `content_part.added` before any delta
of its `content_index`, an `output_index` per item in order of first appearance, ids minted here
(`msg_`, `rs_`, `fc_`, ...), every `.added` paired with its `.done`, and the items' final bodies,
so the final Response is exactly what its events add up to. Pure: no I/O.

Rules:
- text of another item type than the open message/reasoning item => that item is done, a new one
  starts; text of another part type => the open part is done, a new one starts
- message and reasoning items are open one at a time, and starting one ends every open item;
  tool calls ("side" items, keyed by the caller) stay open side by side until closed, until a
  message or reasoning item starts, until the stream ends, or (function calls) until their key
  is reused
- `close_open` ends every open item with one status: `completed`, or `incomplete` when the
  response ended early or failed
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from worker.ids import new_id, new_item_id

# An event as translation tells it: its JSON as a dict, not yet numbered (the numbered, encoded,
# stored one is `worker.events.stream.Event`).
EventBody = dict[str, Any]

CUSTOM_CALL = "custom_tool_call"
MCP_CALL = "mcp_call"
MCP_APPROVAL = "mcp_approval_request"
WEB_SEARCH = "web_search_call"
COMPACTION = "compaction"
# The item types whose arguments are a call's: told as deltas (function and MCP calls), at once
# (custom tool calls, approval requests), or in their action (web searches).
CALLS = frozenset({"function_call", CUSTOM_CALL, MCP_CALL, MCP_APPROVAL, WEB_SEARCH})

# PROTOCOL.md §4: per part type, the event type prefix of its deltas and the field its `.done`
# event (and the part itself) carries the full text in.
PART_EVENTS = {
    "output_text": ("response.output_text", "text"),
    "refusal": ("response.refusal", "refusal"),
    "reasoning_text": ("response.reasoning_text", "text"),
    "summary_text": ("response.reasoning_summary_text", "text"),
}

# Per part type, the type of its delta events.
_DELTA_TYPES = {part_type: f"{prefix}.delta" for part_type, (prefix, _) in PART_EVENTS.items()}

# The fields of an item that this module owns; any other field a caller gives is kept as given.
# `item_id` is no item field: vLLM's harmony tool calls put the upstream's own id there.
_OWNED = frozenset({"id", "type", "status", "content", "summary", "arguments", "input", "item_id"})


@dataclass
class Part:
    type: str  # a key of PART_EVENTS
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    annotations: list[dict[str, Any]] = field(default_factory=list)
    is_open: bool = True


# The citations a finished output_text part's text earns (`url_citation` annotations of the web
# pages a search found that it names), given by the tool loop.
Cite = Callable[[str], list[dict[str, Any]]]


@dataclass
class Item:
    output_index: int
    fields: dict[str, Any]  # `type`, `id` and the item's other fixed fields
    parts: list[Part] = field(default_factory=list)  # content parts
    summary: list[Part] = field(default_factory=list)  # reasoning summary parts
    arguments: list[str] = field(default_factory=list)  # function calls
    body: dict[str, Any] | None = None  # any other item type: its whole body, as last given
    status: str = "in_progress"
    arguments_done: bool = False  # an MCP call's: its `response.mcp_call_arguments.done` was told
    runs_here: bool = False  # a call of a tool respool runs (not one a Responses upstream ran)
    cite: Cite | None = None  # a message's: the citations its output text earns when a part ends

    @property
    def type(self) -> str:
        return str(self.fields["type"])

    @property
    def id(self) -> str:
        return str(self.fields["id"])


@dataclass
class Output:
    """Every item so far, by output_index; the open message or reasoning item; open side items."""

    items: list[Item] = field(default_factory=list)
    current: Item | None = None
    side: dict[Hashable, Item] = field(default_factory=dict)
    pending: list[Item] = field(default_factory=list)  # calls the model made that respool runs
    cite: Cite | None = None  # given to every message started from now on


# --- what the model says ------------------------------------------------------------------------


def append_text(
    out: Output, item_type: str, part_type: str, text: str | None, logprobs: Iterable[EventBody] = ()
) -> list[EventBody]:
    """A delta of `part_type` text in the open `item_type` item, opening item and part as needed."""
    if not text:
        return []
    # A token's case first: the open part takes it as it is (the general path's checks
    # and dicts were half this function's cost).
    events = (
        [] if _has_open_part(out.current, item_type, part_type) else _ensure_part(out, item_type, part_type)
    )
    item = out.current
    assert item is not None
    part = item.parts[-1]
    part.text.append(text)
    delta: EventBody = {
        "type": _DELTA_TYPES[part_type],
        "item_id": item.id,
        "output_index": item.output_index,
        "content_index": len(item.parts) - 1,
        "delta": text,
    }
    if part_type == "output_text":
        tokens = list(logprobs)
        part.logprobs.extend(tokens)
        delta["logprobs"] = tokens
    events.append(delta)
    return events


def start_item(out: Output, item_type: str, fields: dict[str, Any] | None = None) -> list[EventBody]:
    """Close every open item and open a new `item_type` one (an explicit boundary)."""
    # PROTOCOL.md §4.1: what was open is done once something else starts.
    events = close_open(out, "completed")
    item = _new_item(out, {**kept_fields(fields), "id": new_item_id(item_type), "type": item_type})
    if item_type == "message":
        item.fields.setdefault("role", "assistant")
    out.current = item
    return [*events, item_event("added", item)]


def start_part(out: Output, item_type: str, part_type: str) -> list[EventBody]:
    """Open a new `part_type` part in the open `item_type` item, even if one of that type is open."""
    events = _ensure_item(out, item_type)
    item = out.current
    assert item is not None
    return events + _open_part(item, part_type)


def append_summary(out: Output, text: str | None, *, new_part: bool = False) -> list[EventBody]:
    """Reasoning summary text (PROTOCOL.md §4.1, "Reasoning (summaries)"); `new_part` starts the next summary."""
    events = _ensure_item(out, "reasoning")
    item = out.current
    assert item is not None
    if new_part or not item.summary or not item.summary[-1].is_open:
        events += _close_summary(item) + _open_summary(item)
    if text:
        item.summary[-1].text.append(text)
        where = {**address(item), "summary_index": len(item.summary) - 1}
        events.append({"type": "response.reasoning_summary_text.delta", **where, "delta": text})
    return events


def add_annotation(out: Output, annotation: dict[str, Any]) -> list[EventBody]:
    """An annotation on the open output_text part (a citation, a file path)."""
    events = _ensure_part(out, "message", "output_text")
    item = out.current
    assert item is not None
    part = item.parts[-1]
    part.annotations.append(annotation)
    where = {**address(item), "content_index": len(item.parts) - 1}
    index = len(part.annotations) - 1
    added = {"type": "response.output_text.annotation.added", **where, "annotation_index": index}
    return [*events, {**added, "annotation": annotation}]


def open_call(
    out: Output,
    key: Hashable,
    call_id: str | None,
    name: str | None,
    fields: dict[str, Any] | None = None,
    *,
    item_type: str = "function_call",
) -> list[EventBody]:
    """Open a call under `key`: a `function_call`, or a `custom_tool_call` (whose arguments are the
    JSON `{"input": ...}` a chat upstream was asked for, told as its input when it ends), or a call of
    a tool respool runs (an MCP call, an approval request, a web search, whose arguments are the
    query the loop runs it with: told in its `action`, never as arguments); an open call under the
    same key is done first."""
    events = close_current(out)
    if key in out.side:
        events += _end(out, out.side.pop(key), "completed")
    if item_type == WEB_SEARCH:
        search = _new_item(out, {"id": new_item_id(WEB_SEARCH), "type": WEB_SEARCH})
        search.body = {"action": {"type": "search"}}
        search.runs_here = True
        out.side[key] = search
        return [
            *events,
            item_event("added", search),
            {"type": f"response.{WEB_SEARCH}.in_progress", **address(search)},
        ]
    item = _new_item(
        out,
        {
            **kept_fields(fields),
            "id": new_item_id(item_type),
            "type": item_type,
            **({} if item_type in (MCP_CALL, MCP_APPROVAL) else {"call_id": call_id or new_id("call")}),
            "name": name or "",
        },
    )
    out.side[key] = item
    item.runs_here = item_type == MCP_CALL
    events.append(item_event("added", item))
    if item_type == MCP_CALL:
        events.append({"type": "response.mcp_call.in_progress", **address(item)})
    return events


def call(out: Output, key: Hashable) -> Item | None:
    """The open side item under `key`, if any."""
    return out.side.get(key)


def append_arguments(item: Item, arguments: str | None) -> list[EventBody]:
    """More of a call's arguments: told as they come for a function call; a custom tool call's input
    is told when it ends (its arguments are JSON around it, which cannot be told as input piecemeal)."""
    if not arguments:
        return []
    item.arguments.append(arguments)
    if item.type in (CUSTOM_CALL, MCP_APPROVAL, WEB_SEARCH):
        return []
    kind = "mcp_call_arguments" if item.type == MCP_CALL else "function_call_arguments"
    return [{"type": f"response.{kind}.delta", **address(item), "delta": arguments}]


def custom_input(arguments: str) -> str:
    """A custom tool call's input from the arguments a chat upstream sent: `{"input": ...}`'s string,
    or the arguments as they are if they are not that."""
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    value = parsed.get("input") if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else arguments


def open_other(out: Output, key: Hashable, body: dict[str, Any]) -> list[EventBody]:
    """Open an item of a type this module does not model (a hosted tool call): its body is the caller's."""
    events = close_current(out)
    prefix = str(body.get("id") or "").partition("_")[0]
    item_id = new_id(prefix) if prefix else new_item_id(str(body["type"]))
    item = _new_item(out, {"id": item_id, "type": body["type"]})
    item.body = dict(body)
    out.side[key] = item
    return [*events, item_event("added", item)]


def open_compaction(out: Output) -> list[EventBody]:
    """Start a compaction item (respool compacting the conversation), after whatever was open; its
    `encrypted_content` is told when it ends (`end_compaction`)."""
    events = close_current(out)
    item = _new_item(out, {"id": new_item_id(COMPACTION), "type": COMPACTION})
    item.body = {"encrypted_content": ""}
    out.side[COMPACTION] = item
    return [*events, item_event("added", item)]


def compacting(out: Output) -> list[EventBody]:
    """More of the open compaction's summary was sampled (the event carries none of it)."""
    item = out.side.get(COMPACTION)
    return [{"type": "response.compaction.compacting", **address(item)}] if item else []


def end_compaction(out: Output, content: str) -> tuple[dict[str, Any], list[EventBody]]:
    """The open compaction item, done with its sealed `content`; and its events."""
    item = out.side.pop(COMPACTION)
    assert item.body is not None
    item.body["encrypted_content"] = content
    item.status = "completed"
    return item_body(item), [item_event("done", item)]


def add_whole(out: Output, body: dict[str, Any]) -> list[EventBody]:
    """An item given whole (an upstream compaction's output, a user message it keeps): added and
    done at once, under an id of its own kind."""
    key = ("whole", len(out.items))
    return [*open_other(out, key, body), *close_side(out, key)]


def update_fields(item: Item, fields: dict[str, Any]) -> None:
    """Add the fields this module does not own (e.g. `encrypted_content`) that the item lacks.

    A field already told (a `call_id`, a `name`) is never changed: clients match on it
    (PROTOCOL.md §6.3: `output_item.done` keeps the added item's identity). Hosted tool items are
    the caller's: their body is replaced.
    """
    if item.body is not None:
        item.body.update(fields)
        return
    for key, value in kept_fields(fields).items():
        if not item.fields.get(key):
            item.fields[key] = value


def tell_whole(items: list[dict[str, Any]]) -> list[EventBody]:
    """The events that tell finished `items` (a final Response's output) as a model turn tells them,
    their ids kept, each part's text in one delta: what a stream that told none of them needs to add
    up to that Response (DESIGN.md §4: a response whose end was committed while its last append,
    which carried its whole output, was lost). An item of a type told whole (a hosted tool's call)
    is added and done at once."""
    return tell_rest(Output(), items)


def tell_rest(out: Output, items: list[dict[str, Any]]) -> list[EventBody]:
    """The events that tell the rest of finished `items` after what a stream told of them (`out`,
    its events rebuilt: `replay.rebuild`): an item it left open goes on where it stopped (each open
    part's text that was not told in one delta, then its `.done` events), an item it never added is
    told whole (`tell_whole`), one it ended is left as it is. So a stream whose last append (the end
    of a model turn, kept for the response's end: DESIGN.md §4) was lost adds up to the Response.

    What was told is a beginning of what the turn told: were a part's told text not the start of
    its final text, or an item at an index another, its final text or item is told in its `.done`
    event alone (which the SDK's accumulator takes), as nothing told can be taken back."""
    events: list[EventBody] = []
    for index, body in enumerate(items):
        if index < len(out.items):
            item = out.items[index]
            if item.id == body.get("id") and (out.current is item or out.side.get(item.id) is item):
                events += _tell_end(out, item, body)
            continue
        events += _tell_item(out, body)
    return events


def _tell_item(out: Output, body: dict[str, Any]) -> list[EventBody]:
    """A finished item told whole, at the next output index (`tell_whole`)."""
    item_type = str(body["type"])
    if _has_text_parts(body) or item_type == "function_call":  # told as a turn tells them
        item = _new_item(out, _fields_of(body))
        return [item_event("added", item), *_tell_end(out, item, body)]
    item = _new_item(out, {"id": body["id"], "type": item_type})
    item.body = dict(body)
    item.status = str(body.get("status") or "completed")
    return [item_event("added", item), item_event("done", item)]


def _tell_end(out: Output, item: Item, body: dict[str, Any]) -> list[EventBody]:
    """The rest of an open `item`, to its finished `body`, and its `.done` event."""
    out.side.pop(item.id, None)
    if out.current is item:
        out.current = None
    status = str(body.get("status") or "completed")
    if item.body is None and item.type in ("message", "reasoning") and _has_text_parts(body):
        item.fields = _fields_of(body)
        events = _rest_of_parts(item, item.summary, body.get("summary") or ())
        events += _rest_of_parts(item, item.parts, body.get("content") or ())
        item.status = status
        return [*events, item_event("done", item)]
    if item.body is None and item.type == "function_call":
        item.fields = _fields_of(body)
        told, whole = "".join(item.arguments), str(body.get("arguments") or "")
        if whole.startswith(told):
            events = append_arguments(item, whole[len(told) :])
        else:
            item.arguments, events = [whole], []
        return [*events, *close_item(item, status)]
    item.body = dict(body)  # told whole in its `.done` event
    item.status = status
    return [item_event("done", item)]


def _rest_of_parts(item: Item, told: list[Part], parts: Iterable[dict[str, Any]]) -> list[EventBody]:
    """The rest of an item's content parts (or its reasoning summary's, `told` being
    `item.summary`): the last told part, if open, goes on; those not told are opened, told, closed."""
    events: list[EventBody] = []
    is_summary = told is item.summary
    for index, given in enumerate(parts):
        if index < len(told) and not told[index].is_open:
            continue
        if index >= len(told):
            events += _open_summary(item) if is_summary else _open_part(item, str(given["type"]))
        part = told[index]
        _, text_field = PART_EVENTS[part.type]
        text, said = str(given.get(text_field) or ""), "".join(part.text)
        if not text.startswith(said):  # told in its `.done` event alone
            part.text, said = [], text
        rest = {
            "logprobs": list(given.get("logprobs") or ())[len(part.logprobs) :],
            "annotations": list(given.get("annotations") or ())[len(part.annotations) :],
        }
        events += _told_text(item, part, index, text[len(said) :], rest)
        if not part.text and said:
            part.text.append(said)
        events += _close_summary(item) if is_summary else _close_part(item, index)
    return events


def _has_text_parts(body: dict[str, Any]) -> bool:
    """Whether `body` is a message or reasoning item whose parts are all of types told as text."""
    parts = [*(body.get("summary") or ()), *(body.get("content") or ())]
    return body["type"] in ("message", "reasoning") and all(part.get("type") in PART_EVENTS for part in parts)


def _fields_of(body: dict[str, Any]) -> dict[str, Any]:
    return {**kept_fields(body), "id": body["id"], "type": str(body["type"])}


def _told_text(item: Item, part: Part, index: int, text: str, given: dict[str, Any]) -> list[EventBody]:
    """More of the `index`th part's text as one delta (its logprobs with it), and its annotations
    not told yet."""
    events: list[EventBody] = []
    where: EventBody = {
        **address(item),
        ("summary_index" if part.type == "summary_text" else "content_index"): index,
    }
    logprobs = list(given.get("logprobs") or ()) if part.type == "output_text" else []
    part.logprobs.extend(logprobs)
    if text:
        part.text.append(text)
        delta: EventBody = {"type": _DELTA_TYPES[part.type], **where, "delta": text}
        if part.type == "output_text":
            delta["logprobs"] = logprobs
        events.append(delta)
    for annotation in given.get("annotations") or ():
        part.annotations.append(annotation)
        added = {"type": "response.output_text.annotation.added", **where}
        events.append({**added, "annotation_index": len(part.annotations) - 1, "annotation": annotation})
    return events


# --- closing ------------------------------------------------------------------------------------


def close_side(out: Output, key: Hashable, status: str = "completed") -> list[EventBody]:
    item = out.side.pop(key, None)
    return _end(out, item, status) if item else []


def close_current(out: Output) -> list[EventBody]:
    item, out.current = out.current, None
    return close_item(item, "completed") if item else []


def close_open(out: Output, status: str) -> list[EventBody]:
    """The `.done` events of every open item, in output order, each ending with `status`."""
    items = sorted(
        [*out.side.values(), *([out.current] if out.current else [])], key=lambda i: i.output_index
    )
    out.current, out.side = None, {}
    return [event for item in items for event in _end(out, item, status)]


def _end(out: Output, item: Item, status: str) -> list[EventBody]:
    """An item's end: a call of a tool respool runs that the model completed waits to be run
    (`settle_call`); the rest close."""
    if item.runs_here and status == "completed":
        return settle_call(out, item)
    return close_item(item, status)


def settle_call(out: Output, item: Item) -> list[EventBody]:
    """A call of a tool respool runs whose arguments are complete: kept open in `out.pending` to be
    run (an MCP call's arguments told done)."""
    out.pending.append(item)
    return _arguments_done(item) if item.type == MCP_CALL else []


def _arguments_done(item: Item) -> list[EventBody]:
    if item.arguments_done:
        return []
    item.arguments_done = True
    arguments = "".join(item.arguments)
    return [{"type": "response.mcp_call_arguments.done", **address(item), "arguments": arguments}]


def end_call(
    out: Output, item: Item, *, output: str | None = None, error: dict[str, Any] | None = None
) -> list[EventBody]:
    """A pending MCP call, run: its result (`output`, or `error`) told, and the item done."""
    if item in out.pending:
        out.pending.remove(item)
    item.fields.update(
        {key: value for key, value in (("output", output), ("error", error)) if value is not None}
    )
    kind = "failed" if error is not None else "completed"
    item.status = kind
    return [{"type": f"response.mcp_call.{kind}", **address(item)}, item_event("done", item)]


def search_started(item: Item, query: str) -> list[EventBody]:
    """A pending web search, run now with `query`: told as searching."""
    assert item.body is not None
    item.body["action"] = {"type": "search", "query": query}
    return [{"type": f"response.{WEB_SEARCH}.searching", **address(item)}]


def end_search(
    out: Output, item: Item, action: dict[str, Any], *, is_failed: bool = False
) -> list[EventBody]:
    """A pending web search, run: its `action` (query, and sources when asked for) told, the item done.
    A failed search has no event of its own: its item is done `failed`."""
    if item in out.pending:
        out.pending.remove(item)
    assert item.body is not None
    item.body["action"] = action
    item.status = "failed" if is_failed else "completed"
    told = [] if is_failed else [{"type": f"response.{WEB_SEARCH}.completed", **address(item)}]
    return [*told, item_event("done", item)]


def close_item(item: Item, status: str) -> list[EventBody]:
    events: list[EventBody] = []
    if item.parts and item.parts[-1].is_open:
        events += _close_part(item, len(item.parts) - 1)
    events += _close_summary(item)
    if item.type == "function_call":
        arguments = "".join(item.arguments)
        events.append(
            {"type": "response.function_call_arguments.done", **address(item), "arguments": arguments}
        )
    elif item.type == MCP_CALL:
        events += _arguments_done(item)
    elif item.type == CUSTOM_CALL and item.body is None:
        text = custom_input("".join(item.arguments))
        if text:
            events.append({"type": "response.custom_tool_call_input.delta", **address(item), "delta": text})
        events.append({"type": "response.custom_tool_call_input.done", **address(item), "input": text})
    item.status = status
    return [*events, item_event("done", item)]


def output_items(out: Output) -> list[dict[str, Any]]:
    """The items as they stand, in output order (the final Response's `output`)."""
    return [item_body(item) for item in out.items]


# --- internals ----------------------------------------------------------------------------------


def _ensure_item(out: Output, item_type: str) -> list[EventBody]:
    """The open item is of `item_type`, opened (the other one closed) as needed."""
    if out.current is not None and out.current.type == item_type:
        return []
    return start_item(out, item_type)


def _has_open_part(item: Item | None, item_type: str, part_type: str) -> bool:
    """Whether `item` is of `item_type` and its last part an open one of `part_type`."""
    return item is not None and item.type == item_type and _last_part_is_open(item, part_type)


def _last_part_is_open(item: Item, part_type: str) -> bool:
    return bool(item.parts) and item.parts[-1].is_open and item.parts[-1].type == part_type


def _ensure_part(out: Output, item_type: str, part_type: str) -> list[EventBody]:
    events = _ensure_item(out, item_type)
    item = out.current
    assert item is not None
    if not _last_part_is_open(item, part_type):
        events += _open_part(item, part_type)
    return events


def _open_part(item: Item, part_type: str) -> list[EventBody]:
    events = _close_part(item, len(item.parts) - 1) if item.parts and item.parts[-1].is_open else []
    item.parts.append(Part(part_type))
    # PROTOCOL.md §0.4: `content_part.added` before any delta for its `content_index`.
    return [*events, _part_event("added", item, len(item.parts) - 1)]


def _close_part(item: Item, index: int) -> list[EventBody]:
    part = item.parts[index]
    part.is_open = False
    prefix, text_field = PART_EVENTS[part.type]
    text = "".join(part.text)
    done: EventBody = {"type": f"{prefix}.done", **address(item), "content_index": index}
    done[text_field] = text
    cited: list[EventBody] = []
    if part.type == "output_text":
        done["logprobs"] = list(part.logprobs)
        for annotation in item.cite(text) if item.cite else []:
            if annotation not in part.annotations:
                part.annotations.append(annotation)
                where = {
                    **address(item),
                    "content_index": index,
                    "annotation_index": len(part.annotations) - 1,
                }
                cited.append(
                    {"type": "response.output_text.annotation.added", **where, "annotation": annotation}
                )
    return [*cited, done, _part_event("done", item, index)]


def _open_summary(item: Item) -> list[EventBody]:
    item.summary.append(Part("summary_text"))
    return [_summary_event("added", item)]


def _close_summary(item: Item) -> list[EventBody]:
    if not item.summary or not item.summary[-1].is_open:
        return []
    part = item.summary[-1]
    part.is_open = False
    where = {**address(item), "summary_index": len(item.summary) - 1}
    text = "".join(part.text)
    return [
        {"type": "response.reasoning_summary_text.done", **where, "text": text},
        _summary_event("done", item),
    ]


def _new_item(out: Output, fields: dict[str, Any]) -> Item:
    item = Item(output_index=len(out.items), fields=fields)
    if fields["type"] == "message":
        item.cite = out.cite
    out.items.append(item)
    return item


def kept_fields(fields: dict[str, Any] | None) -> dict[str, Any]:
    """The fields of `fields` this module does not own (see `_OWNED`), set."""
    return {key: value for key, value in (fields or {}).items() if key not in _OWNED and value is not None}


# --- shapes -------------------------------------------------------------------------------------


def address(item: Item) -> EventBody:
    return {"item_id": item.id, "output_index": item.output_index}


def item_event(kind: str, item: Item) -> EventBody:
    return {
        "type": f"response.output_item.{kind}",
        "output_index": item.output_index,
        "item": item_body(item),
    }


def _part_event(kind: str, item: Item, index: int) -> EventBody:
    part = _part_body(item.parts[index])
    return {"type": f"response.content_part.{kind}", **address(item), "content_index": index, "part": part}


def _summary_event(kind: str, item: Item) -> EventBody:
    index = len(item.summary) - 1
    where = {**address(item), "summary_index": index}
    return {
        "type": f"response.reasoning_summary_part.{kind}",
        **where,
        "part": _part_body(item.summary[index]),
    }


def item_body(item: Item) -> dict[str, Any]:
    """The item as it stands (PROTOCOL.md §1.5)."""
    if item.type == COMPACTION:  # the SDK's compaction item has no status
        return {**(item.body or {}), "id": item.id, "type": item.type}
    if item.body is not None:  # the upstream's status words differ per hosted tool: its own win
        return {"status": item.status, **item.body, "id": item.id, "type": item.type}
    body = {**item.fields}
    if item.type in ("function_call", MCP_CALL, MCP_APPROVAL):
        body["arguments"] = "".join(item.arguments)
    elif item.type == CUSTOM_CALL:
        body["input"] = custom_input("".join(item.arguments))
    else:
        if item.type == "reasoning":
            body["summary"] = [_part_body(part) for part in item.summary]
        body["content"] = [_part_body(part) for part in item.parts]
    body["status"] = item.status
    return body


def _part_body(part: Part) -> dict[str, Any]:
    _, text_field = PART_EVENTS[part.type]
    body: dict[str, Any] = {"type": part.type, text_field: "".join(part.text)}
    if part.type == "output_text":
        body.update(annotations=list(part.annotations), logprobs=list(part.logprobs))
    return body
