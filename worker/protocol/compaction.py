"""Compaction (PROTOCOL.md §11): respool's own `compaction` items, sealed and expanded.

A compaction item stands for the turns it replaced. respool makes one by asking the model for a
summary (`worker.runner.summary`); what the item must give back later (the summary, and the messages it
keeps word for word) is sealed into its `encrypted_content` with the server's key (Fernet:
AES-128-CBC and HMAC-SHA256, from `cryptography`), so a client can neither read it nor forge one.
The seal names its owner: another owner's item is refused as if forged.

Two kinds, as OpenAI's two ways of making one:
- `POST /responses/compact` answers the user messages as they were, then a compaction item that
  stands for everything else (the model's turns, tool calls and results); it keeps the system and
  developer messages of the window (they are no user message, and instructions must not be lost);
- a compaction made inside a response (a `compaction_trigger`, or `context_management` past its
  threshold) is a *window*: it stands for everything before it, the user messages included (it
  keeps them, the most recent first, up to half the threshold), so the turns before it can be left
  out of any later request.

Expanding a conversation (`expand`, what every request to the model is made from):
- items before the last window compaction item are dropped; `compaction_trigger` items too;
- each of respool's compaction items becomes the messages it keeps and a user message with its
  summary, in its place; the system and developer messages it keeps go first in the conversation;
- any other server's compaction item (a Responses upstream's own, from its `/responses/compact`)
  stays as given: on a Responses upstream it is sent as it is; a chat upstream cannot read it (400).

Pure: no I/O.
"""

from __future__ import annotations

import base64
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from worker.errors import InvalidRequestError
from worker.ids import new_item_id

COMPACTION = "compaction"
# The key a `POST /responses/compact`'s request carries: it is recorded as a response of its own,
# not stored, that a worker runs (worker/runner/compacting.py); a client's create may not send it.
COMPACT = "_respool_compact"
TRIGGER = "compaction_trigger"
# What respool's own items' `encrypted_content` starts with (a version, then the Fernet token).
PREFIX = "rspc1."

SUMMARY_PROMPT = (
    "Context compaction: the conversation above will be replaced by your summary of it. Write a "
    "concise summary that lets you carry on the work without it: the user's goals and requests, "
    "decisions made, facts learned (tool results, names, numbers, file paths), what was done, "
    "and what remains to do. Answer with the summary only."
)
SUMMARY_HEADING = "Summary of the earlier conversation, which was compacted:\n\n"
_KEPT_ROLES = ("system", "developer")


@dataclass(frozen=True)
class Sealed:
    """What a compaction item of respool's holds."""

    owner: str
    summary: str
    kept: list[dict[str, Any]]  # messages given back word for word, in their order
    window: bool  # it stands for everything before it (made inside a response)


class Sealer:
    """Seals and opens respool's compaction items with the server's keys: the first seals, any opens
    (so a key can be rotated in: add the new one first, drop the old one later)."""

    def __init__(self, secrets: Sequence[str]) -> None:
        if not secrets:
            raise ValueError("at least one compaction key is needed")
        self._fernet = MultiFernet([Fernet(_fernet_key(secret)) for secret in secrets])

    def seal(self, sealed: Sealed) -> str:
        plain = {"o": sealed.owner, "s": sealed.summary, "k": sealed.kept, "w": sealed.window}
        return PREFIX + self._fernet.encrypt(orjson.dumps(plain)).decode()

    def open(self, content: str, owner: str, param: str) -> Sealed:
        """The item's content, for `owner`; a 400 naming `param` if it is not one of respool's
        items of this owner, sealed with a key this server has."""
        try:
            plain = orjson.loads(self._fernet.decrypt(content.removeprefix(PREFIX).encode()))
        except (InvalidToken, orjson.JSONDecodeError, ValueError):
            plain = None
        if not isinstance(plain, dict) or plain.get("o") != owner:
            raise InvalidRequestError(
                "This compaction item's encrypted_content was not made by this server for this "
                "project (or was altered, or sealed with a key this server no longer has).",
                param=param,
            )
        return Sealed(owner, str(plain["s"]), list(plain["k"]), bool(plain["w"]))


def _fernet_key(secret: str) -> bytes:
    """A Fernet key from any secret string (its SHA-256, as Fernet's url-safe base64)."""
    return base64.urlsafe_b64encode(hashlib.sha256(secret.encode()).digest())


def new_secret() -> str:
    """A fresh random key, for a deployment that configured none."""
    return Fernet.generate_key().decode()


def is_own(item: dict[str, Any]) -> bool:
    """A compaction item respool made (any other is a Responses upstream's own)."""
    return item.get("type") == COMPACTION and str(item.get("encrypted_content") or "").startswith(PREFIX)


def has_compaction(items: Sequence[dict[str, Any]]) -> bool:
    return any(item.get("type") in (COMPACTION, TRIGGER) for item in items)


def check_input(
    items: Sequence[dict[str, Any]], sealer: Sealer | None, owner: str, *, native: bool, param: str = "input"
) -> None:
    """Refuse what a request's own input cannot hold (a 400 naming where): a `compaction_trigger`
    that is not its last item; a compaction item respool cannot open (forged, altered, another
    owner's), or, for a chat upstream, one another server made."""
    for index, item in enumerate(items):
        where = f"{param}[{index}]"
        kind = item.get("type")
        if kind == TRIGGER and index != len(items) - 1:
            raise InvalidRequestError("A compaction_trigger must be the last input item.", param=where)
        if kind != COMPACTION:
            continue
        content = item.get("encrypted_content")
        if not isinstance(content, str) or not content:
            raise InvalidRequestError(
                "A compaction item needs its encrypted_content.", param=f"{where}.encrypted_content"
            )
        if is_own(item):
            if sealer is None:
                raise InvalidRequestError("This server has no compaction key.", param=where)
            sealer.open(content, owner, f"{where}.encrypted_content")
        elif not native:
            raise InvalidRequestError(
                "This compaction item was made by another server; this model's upstream cannot read it.",
                param=f"{where}.encrypted_content",
            )


def expand(items: Sequence[dict[str, Any]], sealer: Sealer | None, owner: str) -> list[dict[str, Any]]:
    """The conversation the model is sent for `items` (the rules in the module's docstring)."""
    if not has_compaction(items):
        return list(items)
    opened: dict[int, Sealed] = {}
    start = 0
    for index, item in enumerate(items):
        if is_own(item):
            if sealer is None:
                raise InvalidRequestError("This server has no compaction key.", param=f"input[{index}]")
            sealed = sealer.open(str(item["encrypted_content"]), owner, f"input[{index}].encrypted_content")
            opened[index] = sealed
            if sealed.window:
                start = index
    first: list[dict[str, Any]] = []
    rest: list[dict[str, Any]] = []
    for index in range(start, len(items)):
        item = items[index]
        if item.get("type") == TRIGGER:
            continue
        sealed_item = opened.get(index)
        if sealed_item is None:
            rest.append(item)
            continue
        first += [kept for kept in sealed_item.kept if kept.get("role") in _KEPT_ROLES]
        rest += [kept for kept in sealed_item.kept if kept.get("role") not in _KEPT_ROLES]
        rest.append(summary_message(sealed_item.summary))
    return first + rest


def summary_message(summary: str) -> dict[str, Any]:
    """The user message a summary is given to the model as."""
    text = SUMMARY_HEADING + summary
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def summary_request(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation that asks the model to summarize `items` (already expanded)."""
    ask = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": SUMMARY_PROMPT}]}
    return [*(item for item in items if item.get("type") != TRIGGER), ask]


def kept_messages(
    items: Sequence[dict[str, Any]], *, window: bool, user_budget: int | None = None
) -> list[dict[str, Any]]:
    """The messages a compaction of `items` keeps word for word: the system and developer messages
    and, for a window, the user messages (the most recent first, while their text fits in
    `user_budget` tokens, estimated at four characters each); each as `{type, role, content}`."""
    keep_user: set[int] = set()
    if window:
        spent = 0
        for index in reversed(range(len(items))):
            if _role(items[index]) != "user":
                continue
            cost = math.ceil(len(orjson.dumps(items[index].get("content"))) / 4)
            if user_budget is not None and keep_user and spent + cost > user_budget:
                break
            keep_user.add(index)
            spent += cost
    return [
        {"type": "message", "role": _role(item), "content": item.get("content")}
        for index, item in enumerate(items)
        if _role(item) in _KEPT_ROLES or index in keep_user
    ]


def user_messages(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The user messages of `items`, as `/responses/compact` answers them (output items)."""
    return [
        {"id": new_item_id("message"), "type": "message", "role": "user", "status": "completed",
         "content": item.get("content")}
        for item in items
        if _role(item) == "user"
    ]  # fmt: skip


def new_item(content: str) -> dict[str, Any]:
    """A compaction output item holding `content` (sealed)."""
    return {"id": new_item_id(COMPACTION), "type": COMPACTION, "encrypted_content": content}


def _role(item: dict[str, Any]) -> str | None:
    if (item.get("type") or "message") != "message":
        return None
    role = item.get("role")
    return role if isinstance(role, str) else None
