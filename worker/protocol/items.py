"""Input items: normalising what a client sent into stored items with ids (PROTOCOL.md §3).

String input becomes one user message with one `input_text` part; every item gets an id, so
`input_items.list` can page by id (PROTOCOL.md §5.1).
"""

from __future__ import annotations

from typing import Any

from worker.errors import InvalidRequestError, ToolOutputMissingError, UnsupportedParameterError
from worker.ids import new_item_id

ROLES = {"user", "system", "developer", "assistant"}
INPUT_PARTS = {"input_text", "input_image", "input_file"}
ASSISTANT_PARTS = {"output_text", "refusal"}

# The fields each client-side call and output item must have (as the SDK's types require them).
_REQUIRED = {
    "function_call": ("call_id", "name", "arguments"),
    "function_call_output": ("call_id", "output"),
    "custom_tool_call": ("call_id", "name", "input"),
    "custom_tool_call_output": ("call_id", "output"),
    "mcp_approval_response": ("approval_request_id", "approve"),
    "compaction": ("encrypted_content",),
}
CALLS = {"function_call": "function_call_output", "custom_tool_call": "custom_tool_call_output"}
OUTPUTS = frozenset(CALLS.values())


def normalize_input(value: str | list[dict[str, Any]], param: str = "input") -> list[dict[str, Any]]:
    """The request's `input` (or a conversation's `items`: `param`) as a list of items, each with
    `id` and `type`."""
    if isinstance(value, str):
        return [_message("user", value, None, None)]
    return [_normalize_item(item, f"{param}[{index}]") for index, item in enumerate(value)]


def _normalize_item(item: dict[str, Any], param: str) -> dict[str, Any]:
    kind = item.get("type") or ("message" if "role" in item else None)
    if kind is None:
        if "id" in item:
            kind = "item_reference"
        else:
            raise InvalidRequestError("Every input item needs a 'type' or a 'role'.", param=f"{param}.type")
    if kind == "message":
        return _message(item.get("role"), item.get("content"), item.get("id"), param, item)
    if kind == "item_reference":
        raise UnsupportedParameterError(
            "Item references are not supported; send the item itself.", param=param
        )
    if kind in _REQUIRED:
        _require(item, param, *_REQUIRED[kind])
    normalized = {**item, "type": kind}
    normalized.setdefault("id", new_item_id(kind))
    if kind in CALLS or kind in OUTPUTS:
        normalized.setdefault("status", "completed")
    return normalized


def _message(
    role: object, content: object, item_id: object, param: str | None, item: dict[str, Any] | None = None
) -> dict[str, Any]:
    where = param or "input"
    if role not in ROLES:
        raise InvalidRequestError(
            f"Invalid role {role!r}: expected one of {sorted(ROLES)}.", param=f"{where}.role"
        )
    parts = _content_parts(str(role), content, where)
    message = {**(item or {}), "type": "message", "role": role, "content": parts}
    message["id"] = item_id if isinstance(item_id, str) else new_item_id("message")
    message.setdefault("status", "completed")
    return message


def _content_parts(role: str, content: object, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        if role == "assistant":
            return [{"type": "output_text", "text": content, "annotations": []}]
        return [{"type": "input_text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequestError(
            "Message content must be a string or a list of parts.", param=f"{where}.content"
        )
    allowed = ASSISTANT_PARTS | INPUT_PARTS if role == "assistant" else INPUT_PARTS
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in allowed:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(
                f"Invalid content part type {kind!r} for a {role} message.",
                param=f"{where}.content[{index}].type",
            )
    return content


def _require(item: dict[str, Any], param: str, *keys: str) -> None:
    for key in keys:
        if key not in item or item[key] is None:
            raise InvalidRequestError(f"Missing required parameter: '{param}.{key}'.", param=f"{param}.{key}")


def check_tool_outputs(items: list[dict[str, Any]], first_new: int) -> None:
    """Every `function_call_output` (`custom_tool_call_output`) needs an earlier `function_call`
    (`custom_tool_call`) with its `call_id`, and every call its output before the next input message and by the end (PROTOCOL.md §10), as
    OpenAI answers: a chat upstream would be sent an assistant tool call followed by a user message,
    which real servers reject. `first_new` is where the request's own items start."""
    call_ids: set[str] = set()
    pending: dict[str, None] = {}  # calls still waiting for their output, in order
    for index, item in enumerate(items):
        if item["type"] in CALLS:
            call_ids.add(item["call_id"])
            pending[item["call_id"]] = None
        elif item["type"] in OUTPUTS:
            if item["call_id"] not in call_ids:
                kind = "custom tool call" if item["type"] == "custom_tool_call_output" else "function call"
                raise InvalidRequestError(
                    f"No tool call found for {kind} output with call_id {item['call_id']}.",
                    param=f"input[{index - first_new}]" if index >= first_new else "previous_response_id",
                )
            pending.pop(item["call_id"], None)
        elif item["type"] == "message" and item.get("role") != "assistant" and pending:
            raise ToolOutputMissingError(next(iter(pending)))
    if pending:
        raise ToolOutputMissingError(next(iter(pending)))


def drop_oldest_turn(items: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """`truncation: "auto"`: the conversation without its oldest turn (everything before its second
    user message, system and developer messages kept where they are), so that calls and their
    outputs go together; None when one turn is all there is."""
    users = [n for n, item in enumerate(items) if _role(item) == "user"]
    if len(users) < 2:
        return None
    return [item for n, item in enumerate(items) if n >= users[1] or _role(item) in ("system", "developer")]


def _role(item: dict[str, Any]) -> str | None:
    if (item.get("type") or "message") != "message":
        return None
    role = item.get("role")
    return role if isinstance(role, str) else None


def page(items: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    """A list page of items (`input_items.list`, a conversation's items): its first and last ids the
    cursors, null on an empty page."""
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }
