"""Minting ids in OpenAI's shapes: `resp_…`, `msg_…`, `fc_…`, `rs_…`, `call_…`, and every item's."""

from __future__ import annotations

import secrets

# The id prefix of each item type respool mints ids for (input items, and the output it models);
# any other item type's ids are `item_…`.
ITEM_PREFIXES = {
    "message": "msg",
    "reasoning": "rs",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "mcp_list_tools": "mcpl",
    "mcp_call": "mcp",
    "mcp_approval_request": "mcpr",
    "mcp_approval_response": "mcpa",
    "web_search_call": "ws",
    "compaction": "cmp",
    "compaction_trigger": "cmpt",
}


def new_id(prefix: str) -> str:
    """A fresh id: the prefix, an underscore and 48 hex digits (as long as OpenAI's)."""
    return f"{prefix}_{secrets.token_hex(24)}"


def new_item_id(item_type: str) -> str:
    """A fresh id for an item of `item_type`."""
    return new_id(ITEM_PREFIXES.get(item_type, "item"))
