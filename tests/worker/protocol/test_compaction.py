"""respool's compaction items (worker/protocol/compaction.py): sealed so that a client can neither
read nor forge one, opened only for their owner, and expanded into what the model is sent."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from worker.errors import InvalidRequestError
from worker.protocol import compaction
from worker.protocol.compaction import Sealed, Sealer


def message(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


def texts(items: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(item.get("role") or item["type"], item["content"][0]["text"]) for item in items]


SEALER = Sealer(["a key of the operator's"])


def made(
    summary: str, kept: list[dict[str, Any]], *, window: bool, owner: str = "tenant-a"
) -> dict[str, Any]:
    return compaction.new_item(SEALER.seal(Sealed(owner, summary, kept, window)))


def test_the_content_is_unreadable_and_opens_for_its_owner_only() -> None:
    item = made("the user likes tea", [message("developer", "be terse")], window=False)
    content = item["encrypted_content"]
    assert content.startswith(compaction.PREFIX)
    sealed = base64.urlsafe_b64decode(content.removeprefix(compaction.PREFIX))
    for said in ("likes tea", "be terse"):  # neither as text nor as bytes
        assert said not in content and said.encode() not in sealed
    opened = SEALER.open(content, "tenant-a", "p")
    assert (opened.summary, opened.kept, opened.window) == (
        "the user likes tea",
        [message("developer", "be terse")],
        False,
    )
    with pytest.raises(InvalidRequestError) as other:
        SEALER.open(content, "tenant-b", "input[3].encrypted_content")
    assert other.value.param == "input[3].encrypted_content"


@pytest.mark.parametrize("change", ["flip", "other key", "garbage"])
def test_an_altered_or_foreign_seal_is_refused(change: str) -> None:
    content = made("s", [], window=False)["encrypted_content"]
    if change == "flip":
        middle = len(content) // 2
        content = content[:middle] + ("A" if content[middle] != "A" else "B") + content[middle + 1 :]
    elif change == "other key":
        content = Sealer(["another deployment's key"]).seal(Sealed("tenant-a", "s", [], False))
    else:
        content = compaction.PREFIX + "not a token"
    with pytest.raises(InvalidRequestError):
        SEALER.open(content, "tenant-a", "p")


def test_a_rotated_key_still_opens_what_the_old_one_sealed() -> None:
    old = made("before rotation", [], window=False)["encrypted_content"]
    rotated = Sealer(["the new key", "a key of the operator's"])
    assert rotated.open(old, "tenant-a", "p").summary == "before rotation"
    new = rotated.seal(Sealed("tenant-a", "after", [], False))  # sealed with the new key, the first
    assert rotated.open(new, "tenant-a", "p").summary == "after"
    with pytest.raises(InvalidRequestError):
        SEALER.open(new, "tenant-a", "p")


def test_a_summary_item_expands_in_place_and_its_instructions_lead() -> None:
    """`/responses/compact`'s item: the user messages are the client's (before it); the item gives
    its summary where it stands and its developer message at the front."""
    item = made("S", [message("developer", "be terse")], window=False)
    items = [message("user", "one"), message("user", "two"), item, message("user", "three")]
    assert texts(compaction.expand(items, SEALER, "tenant-a")) == [
        ("developer", "be terse"),
        ("user", "one"),
        ("user", "two"),
        ("user", compaction.SUMMARY_HEADING + "S"),
        ("user", "three"),
    ]


def test_a_window_drops_everything_before_it() -> None:
    window = made("W", [message("system", "sys"), message("user", "kept question")], window=True)
    items = [
        message("system", "sys"),
        message("user", "kept question"),
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "long answer"}]},
        {"type": "compaction_trigger"},
        window,
        message("user", "next"),
    ]
    assert texts(compaction.expand(items, SEALER, "tenant-a")) == [
        ("system", "sys"),
        ("user", "kept question"),
        ("user", compaction.SUMMARY_HEADING + "W"),
        ("user", "next"),
    ]


def test_another_servers_item_stays_as_given() -> None:
    theirs = {"type": "compaction", "id": "cmp_1", "encrypted_content": "gAAAA-upstream"}
    items = [message("user", "a"), theirs]
    assert compaction.expand(items, None, "tenant-a") == items
    compaction.check_input(items, None, "tenant-a", native=True)
    with pytest.raises(InvalidRequestError) as refused:
        compaction.check_input(items, None, "tenant-a", native=False)
    assert refused.value.param == "input[1].encrypted_content"


def test_a_trigger_must_be_last() -> None:
    compaction.check_input([message("user", "a"), {"type": "compaction_trigger"}], None, "o", native=False)
    with pytest.raises(InvalidRequestError) as refused:
        compaction.check_input(
            [{"type": "compaction_trigger"}, message("user", "a")], None, "o", native=False
        )
    assert refused.value.param == "input[0]"


def test_a_window_keeps_the_latest_user_messages_within_its_budget() -> None:
    items = [message("developer", "rules"), *(message("user", f"question {n} " + "x" * 40) for n in range(5))]
    kept = compaction.kept_messages(items, window=True, user_budget=45)  # two of them: ~21 tokens each
    assert [entry["content"][0]["text"][:10] for entry in kept] == ["rules", "question 3", "question 4"]
    assert compaction.kept_messages(items, window=False) == [
        {"type": "message", "role": "developer", "content": items[0]["content"]}
    ]
