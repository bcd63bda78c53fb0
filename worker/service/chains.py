"""`previous_response_id` chains (PROTOCOL.md §2): the earlier turns a new response runs on.

Each response row holds its whole conversation, so continuing a chain is one row read: the previous
response's conversation and its output. Each row also records its depth in its chain, which is
bounded (RESPOOL_MAX_CHAIN_DEPTH): rows would otherwise grow without end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from worker.errors import InvalidRequestError, PreviousResponseNotFoundError
from worker.postgres import store
from worker.protocol.response import LIVE


@dataclass(frozen=True)
class History:
    """What a new response continues: the earlier turns (`items`), its depth in the chain, and the
    model the previous response ran on (None: there is none)."""

    items: list[dict[str, Any]] = field(default_factory=list)
    depth: int = 0
    model: str | None = None


async def history(conn: store.Connection, owner: str, previous_id: str | None, max_depth: int) -> History:
    """What a new response continues (nothing without `previous_id`); a 400 naming
    `previous_response_id` if that response is not `owner`'s and stored, is still running, or ends a
    chain of `max_depth` responses."""
    if previous_id is None:
        return History()
    previous = await store.get_response(conn, previous_id, owner)
    if previous is None or not previous.store:
        raise PreviousResponseNotFoundError(previous_id)
    if previous.status in LIVE:
        raise InvalidRequestError(
            f"Previous response with id '{previous_id}' is still {previous.status}; wait for it to finish.",
            param="previous_response_id",
        )
    depth = previous.chain_depth + 1
    if depth > max_depth:
        raise InvalidRequestError(
            f"Previous response with id '{previous_id}' ends a chain of {depth} responses; this "
            f"server continues chains of at most {max_depth} (RESPOOL_MAX_CHAIN_DEPTH). Start a new "
            "one, passing what matters as input.",
            param="previous_response_id",
            code="previous_response_chain_too_long",
        )
    items = previous.conversation + list(previous.response.get("output") or [])
    return History(items, depth, str(previous.request.get("model")))
