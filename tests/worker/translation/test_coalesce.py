"""Deltas waiting together for one append are merged per part, and nothing else changes."""

from __future__ import annotations

from typing import Any

from worker.translation.coalesce import merge_deltas


def _delta(text: str, item: str = "msg_1", content_index: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "type": "response.output_text.delta",
        "item_id": item,
        "output_index": 0,
        "content_index": content_index,
        "delta": text,
        **extra,
    }


def test_a_run_of_deltas_of_one_part_becomes_one() -> None:
    assert merge_deltas([_delta("a"), _delta("b"), _delta("c")]) == [_delta("abc")]


def test_logprobs_are_joined_in_order() -> None:
    merged = merge_deltas([_delta("a", logprobs=[{"token": "a"}]), _delta("b", logprobs=[{"token": "b"}])])
    assert merged == [_delta("ab", logprobs=[{"token": "a"}, {"token": "b"}])]


def test_deltas_of_other_parts_or_kinds_and_other_events_stay_apart() -> None:
    added = {"type": "response.content_part.added", "item_id": "msg_1", "content_index": 1}
    arguments = {"type": "response.function_call_arguments.delta", "item_id": "fc_1", "output_index": 1}
    events = [
        _delta("a"),
        _delta("b", content_index=1),
        added,
        _delta("c", content_index=1),
        {**arguments, "delta": "{"},
        {**arguments, "delta": "}"},
        _delta("d", item="msg_2"),
    ]
    assert merge_deltas(events) == [
        _delta("a"),
        _delta("b", content_index=1),
        added,
        _delta("c", content_index=1),
        {**arguments, "delta": "{}"},
        _delta("d", item="msg_2"),
    ]


def test_nothing_is_lost_or_reordered() -> None:
    texts = [f"t{i} " for i in range(50)]
    merged = merge_deltas([_delta(text) for text in texts])
    assert "".join(event["delta"] for event in merged) == "".join(texts)


def test_deltas_whose_keys_differ_are_compared_by_value_a_missing_one_as_none() -> None:
    """One delta with logprobs and one without, or a key one has as None that the other lacks: one
    part still. A key whose values differ keeps them apart, whichever delta has it."""
    assert merge_deltas([_delta("a", logprobs=[{"token": "a"}]), _delta("b")]) == [
        _delta("ab", logprobs=[{"token": "a"}])
    ]
    assert merge_deltas([_delta("a", obfuscation=None), _delta("b")]) == [_delta("ab", obfuscation=None)]
    assert merge_deltas([_delta("a"), _delta("b", obfuscation="x")]) == [
        _delta("a"),
        _delta("b", obfuscation="x"),
    ]
