"""The tools of a create request, sorted by who runs them (DESIGN.md §10). Pure: no I/O.

- client-side: `function` and `custom` tools, and `namespace` groups of them: offered to the model;
  a call ends the response and goes back to the client, which runs it;
- everything else (`web_search`, `mcp`, `code_interpreter`, `image_generation`, `file_search`, ...)
  is run by the server: by respool's worker where it has a backend for it (`runnable`), else it is
  unavailable. An unavailable tool is, by default, left out of what the model is offered and named
  on the Response (`unavailable_tools`); `RESPOOL_UNAVAILABLE_TOOLS=reject` refuses the request
  instead, as a 400 naming it.

A Responses upstream runs its own hosted tools: this sorting is for the other backends.
"""

from __future__ import annotations

from typing import Any

from worker.errors import InvalidRequestError, UnsupportedParameterError

CLIENT_SIDE = frozenset({"function", "custom", "namespace"})
# Every tool type the `openai` SDK's `Tool` union has (the reference for shapes, PROTOCOL.md).
KNOWN_TYPES = frozenset(
    {
        "function", "custom", "namespace", "file_search", "computer", "computer_use_preview",
        "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
        "mcp", "code_interpreter", "programmatic_tool_calling", "image_generation", "local_shell",
        "shell", "tool_search", "apply_patch",
    }
)  # fmt: skip


def check_types(tools: list[dict[str, Any]]) -> None:
    """Every tool is an object whose `type` is one the SDK knows: else a 400 naming it."""
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str) or kind not in KNOWN_TYPES:
            raise InvalidRequestError(
                f"Invalid tool type {kind!r}: expected one of {sorted(KNOWN_TYPES)}.",
                param=f"tools[{index}].type",
            )


def unavailable(tools: list[dict[str, Any]], runnable: frozenset[str]) -> list[tuple[int, dict[str, Any]]]:
    """The tools (with their index in `tools`) that neither the client nor this deployment runs."""
    return [
        (index, tool)
        for index, tool in enumerate(tools)
        if tool.get("type") not in CLIENT_SIDE and tool.get("type") not in runnable
    ]


def unavailable_note(tool: dict[str, Any]) -> dict[str, Any]:
    """How a left-out tool is named on the Response."""
    kind = str(tool.get("type"))
    named = {"server_label": tool["server_label"]} if kind == "mcp" and "server_label" in tool else {}
    return {"type": kind, **named, "reason": f"this server has no backend for '{kind}' tools"}


def refuse_unavailable(tools: list[dict[str, Any]], runnable: frozenset[str]) -> None:
    """`RESPOOL_UNAVAILABLE_TOOLS=reject`: the first unavailable tool is a 400 naming it."""
    for index, tool in unavailable(tools, runnable):
        raise UnsupportedParameterError(
            f"Tools of type '{tool.get('type')}' are not supported by this server "
            "(RESPOOL_UNAVAILABLE_TOOLS=reject).",
            param=f"tools[{index}]",
        )
