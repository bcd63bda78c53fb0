"""Validating the Conversations API's bodies (PROTOCOL.md §8, the SDK's `conversations` types).

- `POST /conversations`: `items` (at most 20 input items, optional) and `metadata` (optional)
- `POST /conversations/{id}`: `metadata`, required (null clears it)
- `POST /conversations/{id}/items`: `items`, required, 1 to 20
Every failure is an `InvalidRequestError` naming its `param`; items are normalized as a create's
`input` is (an `id` and a `type` each), and checked the same way.
"""

from __future__ import annotations

from typing import Any

from worker.errors import InvalidRequestError, MissingParameterError
from worker.protocol.items import normalize_input
from worker.protocol.request import check_metadata

MAX_ITEMS = 20
CONVERSATION_ID_PATTERN = r"^conv_[A-Za-z0-9_-]{1,59}$"
ITEM_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"


def _body(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.", param=None)
    return body


def _items(value: object, *, required: bool) -> list[dict[str, Any]]:
    if value is None:
        if required:
            raise MissingParameterError("items")
        return []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise InvalidRequestError("'items' must be a list of items.", param="items")
    if required and not value:
        raise InvalidRequestError("'items' must hold at least one item.", param="items")
    if len(value) > MAX_ITEMS:
        raise InvalidRequestError(
            f"'items' has {len(value)} items; at most {MAX_ITEMS} can be added at once.", param="items"
        )
    return normalize_input(value, param="items")


def _metadata(value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise InvalidRequestError("'metadata' must map keys to strings.", param="metadata")
    try:
        return check_metadata(value) or {}
    except ValueError as exc:
        raise InvalidRequestError(f"Invalid value for 'metadata': {exc}.", param="metadata") from None


def parse_create(body: object) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """A create body: its items (normalized) and its metadata."""
    given = _body(body)
    return _items(given.get("items"), required=False), _metadata(given.get("metadata"))


def parse_update(body: object) -> dict[str, str]:
    """An update body: the new metadata (`null` clears it)."""
    given = _body(body)
    if "metadata" not in given:
        raise MissingParameterError("metadata")
    return _metadata(given["metadata"])


def parse_items(body: object) -> list[dict[str, Any]]:
    """An items body: the items to add (normalized)."""
    return _items(_body(body).get("items"), required=True)


def conversation_id(value: str | dict[str, Any]) -> str:
    """The id a create request's `conversation` names (a string, or `{"id": ...}`)."""
    given = value.get("id") if isinstance(value, dict) else value
    if not isinstance(given, str) or not given:
        raise InvalidRequestError(
            "'conversation' must be a conversation id or {\"id\": ...}.", param="conversation"
        )
    return given
