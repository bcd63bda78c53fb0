"""A Responses conversation => Chat Completions `messages` (DESIGN.md §6, "Request"): input items of
every kind, and their content parts. The rules are listed in `to_chat_messages`'s docstring; what a
chat conversation cannot carry is refused with a 400 naming where it is. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from worker.errors import InvalidRequestError, MissingParameterError, UnsupportedParameterError

Message = dict[str, Any]

# PROTOCOL.md §3: the input item types a Chat Completions conversation can express.
_ITEM_TYPES = frozenset(
    {
        "message",
        "function_call",
        "function_call_output",
        "reasoning",
        "custom_tool_call",
        "custom_tool_call_output",
        "mcp_call",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "web_search_call",
    }
)
# The key under which the tool loop hands a web search's found text to the translation (never sent).
SEARCH_RESULTS = "_respool_search_results"


@dataclass
class _AssistantTurn:
    """Consecutive assistant items, gathered into one chat `assistant` message."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    results: list[Message] = field(default_factory=list)  # the tool messages of calls respool ran

    def to_messages(self) -> list[Message]:
        """The assistant message and the results of the calls respool ran, or none when the turn is empty."""
        if not (self.text or self.reasoning or self.tool_calls):
            return []
        # Some chat templates fail on a null `content`, so an empty string stands in for none.
        message: Message = {"role": "assistant", "content": "".join(self.text)}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.reasoning:
            reasoning = "".join(self.reasoning)
            # llama.cpp and older vLLM read `reasoning_content`; vLLM since its rename (which
            # still accepts the old name as input) and Ollama read `reasoning`.
            message["reasoning_content"] = reasoning
            message["reasoning"] = reasoning
        return [message, *self.results]


def to_chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[Message]:
    """Chat messages for `instructions` and the conversation (earlier turns first).

    Rules:
    - `instructions` => a leading `system` message
    - message role `user` => `user`; `system` and `developer` => `system`, because the chat
      templates of open models know only system/user/assistant/tool and drop or reject other
      roles (and OpenAI treats `developer` as `system` for non-reasoning models)
    - `input_text` => `text` part; `input_image{image_url, detail}` => `image_url{url, detail}`;
      `input_file{file_id|file_data, filename}` => `file{...}`; one text part => string content
    - `input_image` by `file_id`, `input_file` by `file_url`, non-text parts in system/developer
      messages => 400, param `input[i].content[j]...` (Chat Completions cannot carry them)
    - consecutive assistant `message`, `function_call` and `reasoning` items => one `assistant`
      message: text and refusal parts joined without separator (as `Response.output_text` joins
      them, PROTOCOL.md §1.1), `tool_calls[{id: call_id, type: function, function{name,
      arguments}}]`, and the reasoning text as `reasoning_content` and `reasoning`; a call's
      `name` is `<namespace>__<name>` when it has a `namespace` (as `chat_tools` offers it)
    - `custom_tool_call` => a tool call like a function call's, its arguments `{"input": <input>}`
    - `reasoning` item text: its `reasoning_text` content, else its summaries; an item with only
      `encrypted_content` adds nothing, as no Chat Completions server can read it
    - `mcp_call` (finished) => a tool call `mcp__<server_label>__<name>` and its result as a `tool`
      message; `web_search_call` (finished) => a tool call `web_search({query})` and what it found;
      `mcp_list_tools`, approval requests and answers => nothing
    - `function_call_output`, `custom_tool_call_output` => `tool` message with `tool_call_id`; list
      output => its text parts joined; image or file parts => 400, param `input[i].output[j]`
    - any other item type => 400, param `input[i]`
    """
    messages: list[Message] = [{"role": "system", "content": instructions}] if instructions else []
    turn = _AssistantTurn()
    for index, item in enumerate(items):
        kind = _item_kind(item, index)
        if kind in _ASSISTANT_ITEMS:
            _ASSISTANT_ITEMS[kind](turn, item, index)
            continue
        messages.extend(turn.to_messages())
        turn = _AssistantTurn()
        messages.append(_STANDALONE_ITEMS[kind](item, index))
    messages.extend(turn.to_messages())
    return messages


def _item_kind(item: dict[str, Any], index: int) -> str:
    # PROTOCOL.md §3: a message may come without `type`.
    kind = str(item.get("type") or "message")
    if kind == "message":
        role = item.get("role")
        if role == "assistant":
            return "assistant_message"
        if role not in ("user", "system", "developer"):
            raise InvalidRequestError(f"Unknown message role '{role}'.", param=f"input[{index}].role")
    if kind not in _ITEM_TYPES:
        raise UnsupportedParameterError(f"Input items '{kind}' are not supported.", param=f"input[{index}]")
    return kind


def _add_assistant_message(turn: _AssistantTurn, item: dict[str, Any], index: int) -> None:
    content = item.get("content") or []
    if isinstance(content, str):
        turn.text.append(content)
        return
    for position, part in enumerate(content):
        kind = part.get("type")
        if kind in ("output_text", "input_text"):
            turn.text.append(part.get("text") or "")
        elif kind == "refusal":
            # Chat templates render `content` only; a separate `refusal` field would hide from the
            # model what it said.
            turn.text.append(part.get("refusal") or "")
        else:
            param = f"input[{index}].content[{position}]"
            raise UnsupportedParameterError(f"Assistant content '{kind}' is not supported.", param=param)


def chat_name(name: str, namespace: str | None) -> str:
    """The name a chat upstream knows a tool by: `<namespace>__<name>` for one in a namespace."""
    return f"{namespace}__{name}" if namespace else name


def _add_function_call(turn: _AssistantTurn, item: dict[str, Any], index: int) -> None:
    name = chat_name(_required(item, "name", index), item.get("namespace"))
    function = {"name": name, "arguments": item.get("arguments") or ""}
    turn.tool_calls.append(
        {"id": _required(item, "call_id", index), "type": "function", "function": function}
    )


def _add_reasoning(turn: _AssistantTurn, item: dict[str, Any], index: int) -> None:
    content = item.get("content") or []
    if content:
        text = "".join(part.get("text") or "" for part in content)
    else:
        text = "\n\n".join(part.get("text") or "" for part in item.get("summary") or [])
    if text:
        turn.reasoning.append(text)


def _input_message(item: dict[str, Any], index: int) -> Message:
    role = "user" if item["role"] == "user" else "system"
    return {"role": role, "content": _input_content(item.get("content") or [], index, is_user=role == "user")}


def _tool_message(item: dict[str, Any], index: int) -> Message:
    output = item.get("output")
    if output is None:
        raise MissingParameterError(f"input[{index}].output")
    content = output if isinstance(output, str) else _tool_output_text(output, index)
    return {"role": "tool", "tool_call_id": _required(item, "call_id", index), "content": content}


def _tool_output_text(output: list[dict[str, Any]], index: int) -> str:
    texts = []
    for position, part in enumerate(output):
        if part.get("type") != "input_text":
            # Chat Completions tool messages carry text only.
            param = f"input[{index}].output[{position}]"
            raise UnsupportedParameterError("Function call outputs can be text only.", param=param)
        texts.append(part.get("text") or "")
    return "".join(texts)


def _required(item: dict[str, Any], key: str, index: int) -> str:
    value = item.get(key)
    if not value:
        raise MissingParameterError(f"input[{index}].{key}")
    return str(value)


def _add_custom_call(turn: _AssistantTurn, item: dict[str, Any], index: int) -> None:
    name = chat_name(_required(item, "name", index), item.get("namespace"))
    arguments = orjson.dumps({"input": str(item.get("input") or "")}).decode()
    turn.tool_calls.append(
        {
            "id": _required(item, "call_id", index),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
    )


def _add_mcp_call(turn: _AssistantTurn, item: dict[str, Any], index: int) -> None:
    """A call respool ran: the model's tool call, and its result as the tool message after it.
    One that never got a result (a call cut short) is left out: the model never saw it finish."""
    if item.get("output") is None and item.get("error") is None:
        return
    call_id = _required(item, "id", index)
    name = f"mcp__{item.get('server_label')}__{_required(item, 'name', index)}"
    function = {"name": name, "arguments": item.get("arguments") or "{}"}
    turn.tool_calls.append({"id": call_id, "type": "function", "function": function})
    turn.results.append({"role": "tool", "tool_call_id": call_id, "content": tool_result_text(item)})


def tool_result_text(item: dict[str, Any]) -> str:
    """What the model is told an MCP call returned: its output, or its error."""
    if item.get("error") is None:
        return str(item.get("output") or "")
    error = item["error"]
    message = error.get("message") if isinstance(error, dict) else None
    if message is None and isinstance(error, dict):
        message = orjson.dumps(error.get("content")).decode()
    return f"Error: {message if message is not None else error}"


def _add_web_search_call(turn: _AssistantTurn, item: dict[str, Any], index: int) -> None:
    """A web search: the model's call of `web_search`, and what it found as the tool message after
    it. One not finished is left out: the model never saw it finish."""
    if item.get("status") in ("in_progress", "searching", "incomplete"):
        return
    call_id = _required(item, "id", index)
    arguments = orjson.dumps({"query": (item.get("action") or {}).get("query") or ""}).decode()
    function = {"name": "web_search", "arguments": arguments}
    turn.tool_calls.append({"id": call_id, "type": "function", "function": function})
    turn.results.append({"role": "tool", "tool_call_id": call_id, "content": search_text(item)})


def search_text(item: dict[str, Any]) -> str:
    """What the model is told a web search found: the loop's journal of it, else what the item says."""
    if item.get(SEARCH_RESULTS) is not None:
        return str(item[SEARCH_RESULTS])
    action = item.get("action") or {}
    if item.get("status") == "failed":
        return f"Error: the search for {action.get('query')!r} failed."
    sources = [str(source["url"]) for source in action.get("sources") or [] if source.get("url")]
    return f"Searched the web for {action.get('query')!r}." + (
        f" Sources: {', '.join(sources)}" if sources else ""
    )


def _add_nothing(turn: _AssistantTurn, item: dict[str, Any], index: int) -> None:
    """Items that tell the model nothing: a server's tool list (offered as tools instead), an
    approval request and its answer (the approved call follows as an `mcp_call`)."""


_ASSISTANT_ITEMS: dict[str, Callable[[_AssistantTurn, dict[str, Any], int], None]] = {
    "mcp_call": _add_mcp_call,
    "mcp_list_tools": _add_nothing,
    "mcp_approval_request": _add_nothing,
    "mcp_approval_response": _add_nothing,
    "web_search_call": _add_web_search_call,
    "assistant_message": _add_assistant_message,
    "function_call": _add_function_call,
    "custom_tool_call": _add_custom_call,
    "reasoning": _add_reasoning,
}
_STANDALONE_ITEMS: dict[str, Callable[[dict[str, Any], int], Message]] = {
    "message": _input_message,
    "function_call_output": _tool_message,
    "custom_tool_call_output": _tool_message,
}


def _input_content(content: str | list[dict[str, Any]], index: int, *, is_user: bool) -> str | list[Message]:
    if isinstance(content, str):
        return content
    parts = []
    for position, part in enumerate(content):
        param = f"input[{index}].content[{position}]"
        chat_part = _content_part(part, param)
        if not is_user and chat_part["type"] != "text":
            raise UnsupportedParameterError("System and developer messages can carry text only.", param=param)
        parts.append(chat_part)
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return parts


def _content_part(part: dict[str, Any], param: str) -> Message:
    kind = part.get("type")
    if kind == "input_text":
        return {"type": "text", "text": part.get("text") or ""}
    if kind == "input_image":
        return _image_part(part, param)
    if kind == "input_file":
        return _file_part(part, param)
    raise UnsupportedParameterError(f"Content parts of type '{kind}' are not supported.", param=param)


def _image_part(part: dict[str, Any], param: str) -> Message:
    url = part.get("image_url")
    if not url:
        raise UnsupportedParameterError("Send images by 'image_url'.", param=f"{param}.file_id")
    image = {"url": url}
    if part.get("detail"):
        image["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image}


def _file_part(part: dict[str, Any], param: str) -> Message:
    if part.get("file_url"):
        raise UnsupportedParameterError("Send files by 'file_data'.", param=f"{param}.file_url")
    file = present(part, "file_id", "file_data", "filename")
    if "file_id" not in file and "file_data" not in file:
        raise MissingParameterError(f"{param}.file_data")
    return {"type": "file", "file": file}


def check_items(items: list[dict[str, Any]]) -> None:
    """Raise the 400 `to_chat_messages` would raise for `items`, assembling no message."""
    turn = _AssistantTurn()  # a scratch turn: assistant items are checked by adding them to it
    for index, item in enumerate(items):
        kind = _item_kind(item, index)
        if kind in _ASSISTANT_ITEMS:
            _ASSISTANT_ITEMS[kind](turn, item, index)
        else:
            _STANDALONE_ITEMS[kind](item, index)


def present(source: dict[str, Any], *keys: str) -> dict[str, Any]:
    """The entries of `source` under `keys` that are set (chat servers reject some explicit nulls)."""
    return {key: source[key] for key in keys if source.get(key) is not None}
