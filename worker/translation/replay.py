"""Rebuilding the output state a stream's events leave behind (DESIGN.md §4, "Orphans"): what a new
attempt takes over from a dead one, to end what that one had opened and keep what it told, so its
failed Response is exactly what clients saw. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from worker.translation.output import (
    CUSTOM_CALL,
    MCP_CALL,
    WEB_SEARCH,
    EventBody,
    Item,
    Output,
    Part,
    kept_fields,
)


def rebuild(events: Iterable[EventBody]) -> Output:
    """The output state that `events` (as told, in order) leave behind."""
    out = Output()
    for event in events:
        _REPLAY.get(str(event.get("type")), _replay_delta)(out, event)
    return out


def _replay_item_added(out: Output, event: EventBody) -> None:
    given = dict(event["item"])
    item = Item(
        output_index=len(out.items), fields={**kept_fields(given), "id": given["id"], "type": given["type"]}
    )
    out.items.append(item)
    if item.type in ("message", "reasoning"):  # told part by part; the rest are side items
        out.current = item
    else:
        if item.type not in ("function_call", CUSTOM_CALL, MCP_CALL):
            item.body = _body(item, given)
        out.side[item.id] = item


def _replay_item_done(out: Output, event: EventBody) -> None:
    item = _replayed(out, event)
    if item is None:
        return
    item.status = str(event["item"].get("status") or "completed")
    if item.body is not None:
        item.body = _body(item, event["item"])
    else:  # what was told last, `encrypted_content` included
        item.fields = {**kept_fields(event["item"]), "id": item.id, "type": item.type}
    for part in [*item.parts, *item.summary]:
        part.is_open = False
    if out.current is item:
        out.current = None
    out.side.pop(item.id, None)


def _body(item: Item, given: EventBody) -> dict[str, object]:
    """A hosted item's body as told; a web search's status is respool's own (`item.status`)."""
    if item.type != WEB_SEARCH:
        return dict(given)
    item.status = str(given.get("status") or item.status)
    return {key: value for key, value in given.items() if key != "status"}


def _replay_part_added(out: Output, event: EventBody) -> None:
    item = _replayed(out, event)
    if item is not None:
        item.parts.append(Part(str(event["part"]["type"])))


def _replay_summary_added(out: Output, event: EventBody) -> None:
    item = _replayed(out, event)
    if item is not None:
        item.summary.append(Part("summary_text"))


def _replay_annotation(out: Output, event: EventBody) -> None:
    item = _replayed(out, event)
    if item is not None and item.parts:
        item.parts[-1].annotations.append(event["annotation"])


def _replay_delta(out: Output, event: EventBody) -> None:
    """A delta adds to its part (or a call's arguments); a part's `.done` closes it; others say nothing new."""
    item = _replayed(out, event)
    kind = str(event.get("type"))
    if item is None:
        return
    if kind in ("response.function_call_arguments.delta", "response.mcp_call_arguments.delta"):
        item.arguments.append(str(event["delta"]))
    elif kind == "response.mcp_call_arguments.done":
        item.arguments_done = True
    elif kind == "response.reasoning_summary_text.delta" and item.summary:
        item.summary[-1].text.append(str(event["delta"]))
    elif kind.endswith(".delta") and item.parts and "content_index" in event:
        part = item.parts[event["content_index"]]
        part.text.append(str(event["delta"]))
        part.logprobs.extend(event.get("logprobs") or [])
    elif kind in {"response.content_part.done", "response.reasoning_summary_part.done"}:
        parts = item.parts if kind == "response.content_part.done" else item.summary
        if parts:
            parts[-1].is_open = False


def _replayed(out: Output, event: EventBody) -> Item | None:
    index = event.get("output_index")
    return out.items[index] if isinstance(index, int) and 0 <= index < len(out.items) else None


_REPLAY = {
    "response.output_item.added": _replay_item_added,
    "response.output_item.done": _replay_item_done,
    "response.content_part.added": _replay_part_added,
    "response.reasoning_summary_part.added": _replay_summary_added,
    "response.output_text.annotation.added": _replay_annotation,
}
