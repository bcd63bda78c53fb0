"""Which MCP tools a model sees and which calls wait for approval (worker/protocol/tools.py), in every
form the SDK's `Mcp` tool type gives `allowed_tools` and `require_approval`."""

from __future__ import annotations

from typing import Any

import pytest

from worker.protocol.tools import mcp_allows, mcp_needs_approval

LOOKUP, ADD = ("lookup", True), ("add", False)  # (name, read-only)


@pytest.mark.parametrize(
    ("allowed", "seen"),
    [
        (None, {"lookup", "add"}),
        (["add"], {"add"}),
        ({"tool_names": ["lookup"]}, {"lookup"}),
        ({"read_only": True}, {"lookup"}),
        ({"read_only": False}, {"add"}),
        ({"tool_names": ["lookup", "add"], "read_only": False}, {"add"}),
        ({}, set()),
    ],
)
def test_allowed_tools(allowed: Any, seen: set[str]) -> None:
    tool = {"type": "mcp", "server_label": "s", "allowed_tools": allowed}
    assert {name for name, read_only in (LOOKUP, ADD) if mcp_allows(tool, name, read_only)} == seen


@pytest.mark.parametrize(
    ("rule", "asked"),
    [
        (None, {"lookup", "add"}),  # OpenAI's default: every call waits
        ("always", {"lookup", "add"}),
        ("never", set()),
        ({"never": {"tool_names": ["lookup"]}}, {"add"}),
        ({"never": {"read_only": True}}, {"add"}),
        ({"always": {"tool_names": ["add"]}}, {"add"}),
        ({"always": {"tool_names": ["add"]}, "never": {"tool_names": ["lookup"]}}, {"add"}),
        ({"always": {"read_only": False}, "never": {"tool_names": []}}, {"add", "lookup"}),
    ],
)
def test_require_approval(rule: Any, asked: set[str]) -> None:
    tool = {"type": "mcp", "server_label": "s", "require_approval": rule}
    assert {name for name, read_only in (LOOKUP, ADD) if mcp_needs_approval(tool, name, read_only)} == asked
