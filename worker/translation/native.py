"""Translation for upstreams that speak the Responses API natively (DESIGN.md §6, "Native").

respool owns all state: the upstream is sent `store: false` and the whole conversation, its
lifecycle events are dropped (respool emits its own), and its sequence numbers are replaced by the
caller's.

Rules:
- request fields respool handles itself (`background`, `store`, `previous_response_id`, `stream`,
  `metadata`) => not forwarded; `store: false`, `stream: true` are always sent
- conversation items => `input`, without respool's item ids and statuses (a `store: false` upstream
  cannot resolve them), except reasoning items, whose id the upstream needs
- `response.created` / `.queued` / `.in_progress` => dropped
- `response.completed` / `.incomplete` => the outcome (output, usage, incomplete_details)
- `response.failed` / `error` => `NativeFailure`
- every other event => passed through, `sequence_number` removed
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from worker.translation.chat_stream import Outcome

_NOT_FORWARDED = {
    "background",
    "store",
    "previous_response_id",
    "stream",
    "stream_options",
    "metadata",
    "input",
}
_LIFECYCLE = {"response.created", "response.queued", "response.in_progress"}
_DONE = {"response.completed", "response.incomplete"}


class NativeFailure(Exception):
    """The upstream ended the response as failed, or sent an `error` event."""


@dataclass
class NativeStream:
    outcome: Outcome | None = None
    output: list[dict[str, Any]] = field(default_factory=list)


def to_responses_request(
    request: dict[str, Any], conversation: list[dict[str, Any]], model: str
) -> dict[str, Any]:
    """The body for the upstream's `POST /responses`."""
    body = {key: value for key, value in request.items() if key not in _NOT_FORWARDED and value is not None}
    body.update(model=model, input=[_strip(item) for item in conversation], store=False, stream=True)
    return body


def _strip(item: dict[str, Any]) -> dict[str, Any]:
    if item.get("type") == "reasoning":
        return item
    return {key: value for key, value in item.items() if key not in {"id", "status"}}


def translate_event(state: NativeStream, event: dict[str, Any]) -> list[dict[str, Any]]:
    """respool's events for one upstream event (none for lifecycle and terminal ones)."""
    kind = event.get("type", "")
    if kind in _LIFECYCLE:
        return []
    if kind in _DONE:
        state.outcome = _outcome(event.get("response") or {})
        return []
    if kind in {"response.failed", "error"}:
        raise NativeFailure(_failure_message(event))
    passed = {key: value for key, value in event.items() if key != "sequence_number"}
    if kind == "response.output_item.done":
        state.output.append(passed["item"])
    return [passed]


def finish_stream(state: NativeStream) -> Outcome:
    """The outcome; an upstream stream that ended without a terminal event is a failure."""
    if state.outcome is None:
        raise NativeFailure("the upstream's stream ended before the response was complete")
    return state.outcome


def _outcome(response: dict[str, Any]) -> Outcome:
    incomplete = response.get("status") == "incomplete"
    return Outcome(
        status="incomplete" if incomplete else "completed",
        incomplete_details=response.get("incomplete_details") if incomplete else None,
        output=list(response.get("output") or []),
        usage=response.get("usage"),
    )


def _failure_message(event: dict[str, Any]) -> str:
    error = (event.get("response") or {}).get("error") or event
    return str(error.get("message") or "the upstream reported a failure")
