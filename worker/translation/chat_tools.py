"""A Responses request's tools => Chat Completions `tools` and `tool_choice`, and back: which item a
chat tool call is (DESIGN.md §6, §10). Pure: no I/O.

Rules:
- `function` => `{type: function, function{name, description, parameters, strict}}`
- `custom` (free-form input) => a function of one string argument, `input`; its grammar, if any, is
  told in the description (a chat upstream cannot enforce it); a call comes back as a
  `custom_tool_call` whose `input` is that argument
- `namespace` => each of its functions and custom tools, named `<namespace>__<name>`; a call comes
  back as the item of that tool, its `name` the tool's own and its `namespace` set (Codex CLI's
  `multi_agent_v1` group, for one)
- a tool respool runs (an MCP server's tool, DESIGN.md §10) => a function (`ServerTool`, given by
  the tool loop: named `mcp__<server_label>__<name>`); its calls come back as that tool's item
  (`mcp_call`, or `mcp_approval_request` when the call waits for the client's approval)
- any other type (`web_search`, `mcp`, ... as the request names them) => not offered as such: the
  tool loop offers what it runs, and the service left out, or refused, what it cannot, at create
- web search (when respool runs it) => a function `web_search(query)`; its calls come back as
  `web_search_call` items
- `tool_choice` `none`/`auto`/`required` => as is; `{type: function | custom, name}` =>
  `{type: function, function{name}}`; `{type: mcp, server_label, name}` => that tool's function
  (without `name`: `required`), or nothing once the loop offers no server tools; `{type:
  web_search_preview | web_search...}` => the `web_search` function, or nothing likewise; `{type: allowed_tools, mode, tools}` => `tools` restricted
  to those named and `tool_choice: mode`; any other type => 400, param `tool_choice`
- two tools with one chat name => 400, param `tools[i]`
- `parallel_tool_calls` => as is, only with tools
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.errors import InvalidRequestError, MissingParameterError, UnsupportedParameterError
from worker.protocol.tools import WEB_SEARCH_TYPES
from worker.translation.chat_messages import chat_name, present

CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The tool's input, as free-form text."}},
    "required": ["input"],
}


@dataclass(frozen=True)
class CallShape:
    """The Responses item a chat tool call of one name is: its type, and the tool's own name and
    namespace (or, for a tool respool runs, its server's label)."""

    item_type: str  # `function_call`, `custom_tool_call`, `mcp_call` or `mcp_approval_request`
    name: str
    namespace: str | None = None
    server_label: str | None = None


@dataclass(frozen=True)
class ServerTool:
    """A tool respool runs, offered to the model as a function (DESIGN.md §10): an MCP server's
    tool, or web search (`kind` "web_search", offered as `web_search(query)`)."""

    name: str
    server_label: str
    description: str | None
    parameters: dict[str, Any]
    needs_approval: bool = False
    kind: str = "mcp"

    @property
    def chat_name(self) -> str:
        if self.kind == "web_search":
            return WEB_SEARCH_NAME
        return f"mcp__{self.server_label}__{self.name}"

    def shape(self) -> CallShape:
        if self.kind == "web_search":
            return CallShape("web_search_call", WEB_SEARCH_NAME)
        kind = "mcp_approval_request" if self.needs_approval else "mcp_call"
        return CallShape(kind, self.name, server_label=self.server_label)


WEB_SEARCH_NAME = "web_search"
WEB_SEARCH_TOOL = ServerTool(
    name=WEB_SEARCH_NAME,
    server_label="",
    description="Search the web. Returns the top results, each with its title, URL and a snippet; "
    "cite the URLs you use.",
    parameters={
        "type": "object",
        "properties": {"query": {"type": "string", "description": "What to search for."}},
        "required": ["query"],
    },
    kind="web_search",
)


def call_shapes(request: dict[str, Any], server_tools: tuple[ServerTool, ...] = ()) -> dict[str, CallShape]:
    """Each offered chat tool's name => the item its calls are."""
    return {name: shape for name, (_, shape) in _offered(request, server_tools).items()}


def tool_params(request: dict[str, Any], server_tools: tuple[ServerTool, ...] = ()) -> dict[str, Any]:
    """`tools`, `tool_choice` and `parallel_tool_calls` for the chat request (rules above)."""
    offered = _offered(request, server_tools)
    tools = [tool for tool, _ in offered.values()]
    choice = server_tool_choice(request.get("tool_choice"), server_tools)
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        tools, choice = _allowed_tools(tools, choice)
    chat_choice = _chat_tool_choice(choice, {tool["function"]["name"] for tool in tools})
    if not tools:
        # Servers reject `tool_choice` without `tools`; none/auto without tools mean no tool call.
        if chat_choice not in (None, "none", "auto"):
            raise InvalidRequestError("'tool_choice' needs at least one function tool.", param="tool_choice")
        return {}
    params: dict[str, Any] = {"tools": tools}
    if chat_choice is not None:
        params["tool_choice"] = chat_choice
    if request.get("parallel_tool_calls") is not None:
        params["parallel_tool_calls"] = request["parallel_tool_calls"]
    return params


def server_tool_choice(
    choice: str | dict[str, Any] | None, server_tools: tuple[ServerTool, ...]
) -> str | dict[str, Any] | None:
    """A choice of a tool respool runs, as a choice of its function (rules above)."""
    if isinstance(choice, dict) and choice.get("type") in WEB_SEARCH_TYPES:
        offered = any(tool.kind == "web_search" for tool in server_tools)
        return {"type": "function", "name": WEB_SEARCH_NAME} if offered else None
    if not isinstance(choice, dict) or choice.get("type") != "mcp":
        return choice
    label, name = choice.get("server_label"), choice.get("name")
    named = [tool for tool in server_tools if tool.server_label == label and name in (None, tool.name)]
    if not named:
        return None
    return {"type": "function", "name": named[0].chat_name} if name else "required"


def _offered(
    request: dict[str, Any], server_tools: tuple[ServerTool, ...] = ()
) -> dict[str, tuple[dict[str, Any], CallShape]]:
    """Chat name => (the chat tool, the item its calls are), for every client-side tool and every
    tool respool runs."""
    offered: dict[str, tuple[dict[str, Any], CallShape]] = {}
    for index, tool in enumerate(request.get("tools") or []):
        param = f"tools[{index}]"
        if tool.get("type") == "namespace":
            namespace = tool.get("name")
            if not namespace:
                raise MissingParameterError(f"{param}.name")
            for position, member in enumerate(tool.get("tools") or []):
                _offer(offered, member, f"{param}.tools[{position}]", str(namespace))
        elif tool.get("type") in ("function", "custom"):
            _offer(offered, tool, param, None)
    for server_tool in server_tools:
        function = {"name": server_tool.chat_name, "parameters": server_tool.parameters}
        if server_tool.description:
            function["description"] = server_tool.description
        offered[server_tool.chat_name] = ({"type": "function", "function": function}, server_tool.shape())
    return offered


def _offer(
    offered: dict[str, tuple[dict[str, Any], CallShape]],
    tool: dict[str, Any],
    param: str,
    namespace: str | None,
) -> None:
    kind, name = tool.get("type"), tool.get("name")
    if kind not in ("function", "custom"):
        raise UnsupportedParameterError(f"Tools of type '{kind}' cannot be in a namespace.", param=param)
    if not name:
        raise MissingParameterError(f"{param}.name")
    called = chat_name(str(name), namespace)
    if called in offered:
        raise InvalidRequestError(f"Two tools would be offered as '{called}'.", param=param)
    if kind == "function":
        function = {**present(tool, "name", "description", "parameters", "strict"), "name": called}
        shape = CallShape("function_call", str(name), namespace)
    else:
        function = {"name": called, "parameters": CUSTOM_PARAMETERS}
        description = _custom_description(tool)
        if description:
            function["description"] = description
        shape = CallShape("custom_tool_call", str(name), namespace)
    offered[called] = ({"type": "function", "function": function}, shape)


def _custom_description(tool: dict[str, Any]) -> str:
    """A custom tool's description, with its grammar told (a chat upstream cannot enforce it)."""
    text = str(tool.get("description") or "")
    grammar = tool.get("format") or {}
    if grammar.get("type") == "grammar" and grammar.get("definition"):
        syntax = grammar.get("syntax") or "grammar"
        text = f"{text}\nIts input follows this {syntax}:\n{grammar['definition']}".strip()
    return text


def _chat_tool_choice(choice: str | dict[str, Any] | None, names: set[str]) -> str | dict[str, Any] | None:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if not isinstance(choice, dict) or choice.get("type") not in ("function", "custom"):
        kind = choice.get("type") if isinstance(choice, dict) else choice
        raise UnsupportedParameterError(f"'tool_choice' type '{kind}' is not supported.", param="tool_choice")
    if choice.get("name") not in names:
        raise InvalidRequestError(f"'{choice.get('name')}' is not in 'tools'.", param="tool_choice.name")
    return {"type": "function", "function": {"name": choice["name"]}}


def _allowed_tools(tools: list[dict[str, Any]], choice: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """`allowed_tools` => the tools it names, and its mode as the tool choice."""
    known = {tool["function"]["name"] for tool in tools}
    allowed = set()
    for position, entry in enumerate(choice.get("tools") or []):
        param = f"tool_choice.tools[{position}]"
        if entry.get("type") not in ("function", "custom"):
            raise UnsupportedParameterError(
                "Only function and custom tools can be allowed tools.", param=param
            )
        if entry.get("name") not in known:
            raise InvalidRequestError(f"'{entry.get('name')}' is not in 'tools'.", param=f"{param}.name")
        allowed.add(entry["name"])
    return [tool for tool in tools if tool["function"]["name"] in allowed], str(choice.get("mode") or "auto")
