"""Input items (worker/protocol/items.py): what `truncation: "auto"` drops."""

from __future__ import annotations

from worker.protocol.items import drop_oldest_turn


def test_truncation_drops_whole_turns_and_keeps_system_messages() -> None:
    """The oldest turn goes whole (a call with its output), system and developer messages stay."""
    system = {"type": "message", "role": "developer", "content": "rules"}
    first = [
        {"type": "message", "role": "user", "content": "q1"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "r"},
        {"type": "message", "role": "assistant", "content": "a1"},
    ]
    second = [{"type": "message", "role": "user", "content": "q2"}]
    assert drop_oldest_turn([system, *first, *second]) == [system, *second]
    assert drop_oldest_turn([system, *second]) is None
