"""Minting ids in OpenAI's shapes: `resp_…`, `msg_…`, `fc_…`, `rs_…`, `call_…`."""

from __future__ import annotations

import secrets


def new_id(prefix: str) -> str:
    """A fresh id: the prefix, an underscore and 48 hex digits (as long as OpenAI's)."""
    return f"{prefix}_{secrets.token_hex(24)}"
