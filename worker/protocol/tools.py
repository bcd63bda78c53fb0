"""The tools of a create request, sorted by who runs them (DESIGN.md §10). Pure: no I/O.

- client-side: `function` and `custom` tools, and `namespace` groups of them: offered to the model;
  a call ends the response and goes back to the client, which runs it;
- everything else (`web_search`, `mcp`, `code_interpreter`, `image_generation`, `file_search`, ...)
  is run by the server: by respool's worker where it has a backend for it (`runnable`), else it is
  unavailable. An unavailable tool is, by default, left out of what the model is offered and named
  on the Response (`unavailable_tools`); `RESPOOL_UNAVAILABLE_TOOLS=reject` refuses the request
  instead, as a 400 naming it.

A Responses upstream runs its own hosted tools, except those respool always runs itself
(`RUN_BY_RESPOOL`: MCP servers, whose secrets, approvals and calls the worker keeps): this sorting
is for the other backends.
"""

from __future__ import annotations

from typing import Any

from worker.errors import InvalidRequestError, MissingParameterError, UnsupportedParameterError

CLIENT_SIDE = frozenset({"function", "custom", "namespace"})
# The tool types respool's worker runs itself, on either backend (DESIGN.md §10); and web search,
# which it runs on either backend when a search backend is configured.
RUN_BY_RESPOOL = frozenset({"mcp"})
WEB_SEARCH_TYPES = frozenset(
    {"web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11"}
)
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


# --- MCP (DESIGN.md §10) ------------------------------------------------------------------------

# What a client's `mcp` tool carries that is a secret: kept out of every row, event and log; the
# worker gets it through Redis for the response's life (`split_secrets`).
SECRET_FIELDS = ("headers", "authorization")


def check_tool_choice(tools: list[dict[str, Any]], choice: object, runnable: frozenset[str]) -> None:
    """A `tool_choice` that forces a server-side tool forces one this deployment runs and the request
    offers: else a 400 naming it (the model would be answered without it)."""
    if not isinstance(choice, dict) or choice.get("type") in CLIENT_SIDE | {"allowed_tools"}:
        return
    kind = choice.get("type")
    if kind == "mcp":
        labels = {tool.get("server_label") for _, tool in mcp_tools(tools)}
        if choice.get("server_label") not in labels:
            raise InvalidRequestError(
                f"'tool_choice' names the mcp server '{choice.get('server_label')}', which is not in 'tools'.",
                param="tool_choice.server_label",
            )
        return
    if kind not in runnable:
        raise UnsupportedParameterError(
            f"'tool_choice' forces '{kind}' tools, which this server cannot run.", param="tool_choice"
        )
    if kind in WEB_SEARCH_TYPES and web_search_tool(tools) is None:
        raise InvalidRequestError(
            f"'tool_choice' forces '{kind}', which is not in 'tools'.", param="tool_choice"
        )


def web_search_tool(tools: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The request's web search tool (the first, if it names several), or None."""
    return next((tool for tool in tools if tool.get("type") in WEB_SEARCH_TYPES), None)


def mcp_tools(tools: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """The request's `mcp` tools, with their index in `tools`."""
    return [(index, tool) for index, tool in enumerate(tools) if tool.get("type") == "mcp"]


def check_mcp(tools: list[dict[str, Any]], registered: frozenset[str]) -> None:
    """Each `mcp` tool names a server it can reach: a `server_label`, and a `server_url` unless the
    operator registered that label; one label per server; the fields respool cannot honour refused."""
    labels: set[str] = set()
    for index, tool in mcp_tools(tools):
        param = f"tools[{index}]"
        label = tool.get("server_label")
        if not isinstance(label, str) or not label:
            raise MissingParameterError(f"{param}.server_label")
        if label in labels:
            raise InvalidRequestError(
                f"Two mcp tools have server_label '{label}'.", param=f"{param}.server_label"
            )
        labels.add(label)
        if tool.get("connector_id"):
            raise UnsupportedParameterError(
                "OpenAI connectors are not available here; give a server_url.", param=f"{param}.connector_id"
            )
        url = tool.get("server_url")
        if url is None and label not in registered:
            raise InvalidRequestError(
                f"The mcp tool '{label}' needs a server_url: no server is registered under that label.",
                param=f"{param}.server_url",
            )
        if url is not None and not isinstance(url, str):
            raise InvalidRequestError("'server_url' must be a string.", param=f"{param}.server_url")
        headers = tool.get("headers")
        if headers is not None and (
            not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values())
        ):
            raise InvalidRequestError("'headers' must map names to strings.", param=f"{param}.headers")


def split_secrets(tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, dict[str, str]]]:
    """The tools without their secrets, and the secrets: per server label, the headers to send
    (`authorization` becomes `Authorization: Bearer …`, as OpenAI sends it)."""
    clean, secrets = [], {}
    for tool in tools:
        if tool.get("type") != "mcp" or not any(tool.get(name) for name in SECRET_FIELDS):
            clean.append(tool)
            continue
        headers = dict(tool.get("headers") or {})
        if tool.get("authorization"):
            headers["Authorization"] = f"Bearer {tool['authorization']}"
        secrets[str(tool["server_label"])] = headers
        clean.append({key: value for key, value in tool.items() if key not in SECRET_FIELDS})
    return clean, secrets


def _matches(spec: object, name: str, read_only: bool) -> bool:
    """Whether a tool filter (a list of names, or `{tool_names, read_only}`) matches a tool."""
    if isinstance(spec, list):
        return name in spec
    if not isinstance(spec, dict):
        return False
    names, flag = spec.get("tool_names"), spec.get("read_only")
    if names is None and flag is None:
        return False
    return (names is None or name in names) and (flag is None or flag == read_only)


def mcp_allows(tool: dict[str, Any], name: str, read_only: bool) -> bool:
    """Whether the `mcp` tool's `allowed_tools` lets the model see `name` (none given: all)."""
    allowed = tool.get("allowed_tools")
    return allowed is None or _matches(allowed, name, read_only)


def mcp_needs_approval(tool: dict[str, Any], name: str, read_only: bool) -> bool:
    """Whether a call of `name` waits for the client's approval: `require_approval` `"never"`,
    `"always"`, or `{always: filter, never: filter}`; unset, approval is required (OpenAI's default)."""
    rule = tool.get("require_approval")
    if rule in (None, "always"):
        return True
    if rule == "never":
        return False
    if isinstance(rule, dict):
        if _matches(rule.get("never"), name, read_only):
            return False
        if _matches(rule.get("always"), name, read_only):
            return True
        # Unmatched: no approval when only `always` names tools, else OpenAI's default.
        return not ("always" in rule and "never" not in rule)
    return True
