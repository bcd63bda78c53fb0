"""Merging deltas that wait together for one append (DESIGN.md §7, natural batching).

While an append is in flight, the next events wait; consecutive deltas of the same part among them
become one delta (a client sees the same text in fewer, larger pieces, as OpenAI's own streams
vary in size). At a steady pace each delta goes alone, with no delay; under load, the events
(and every store, relay and SSE write after them) shrink with the backlog. Pure: no I/O.
"""

from __future__ import annotations

from worker.translation.output import EventBody

MERGEABLE = frozenset(
    {
        "response.output_text.delta",
        "response.refusal.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.function_call_arguments.delta",
    }
)
# What may differ between two deltas of one part (the rest: type, item, indexes, must match).
_JOINED = frozenset({"delta", "logprobs"})


def merge_deltas(events: list[EventBody]) -> list[EventBody]:
    """`events`, each run of deltas of one part joined into one."""
    merged: list[EventBody] = []
    for event in events:
        if merged and _same_part(merged[-1], event):
            merged[-1] = _joined(merged[-1], event)
        else:
            merged.append(event)
    return merged


def _same_part(first: EventBody, second: EventBody) -> bool:
    kind = first["type"]
    if kind != second["type"] or kind not in MERGEABLE:
        return False
    # As every translation writes them, the same keys: compared in place, in a loop (the sets and
    # the generator below were 4% of a worker's CPU a token; a generator here, half again).
    if first.keys() == second.keys():
        for key, value in first.items():  # noqa: SIM110 (see above)
            if value != second[key] and key not in _JOINED:
                return False
        return True
    keys = (first.keys() | second.keys()) - _JOINED  # a key one lacks reads as None
    return all(first.get(key) == second.get(key) for key in keys)


def _joined(first: EventBody, second: EventBody) -> EventBody:
    joined = {**first, "delta": first["delta"] + second["delta"]}
    if "logprobs" in first or "logprobs" in second:
        joined["logprobs"] = [*(first.get("logprobs") or []), *(second.get("logprobs") or [])]
    return joined
