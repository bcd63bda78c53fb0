"""The synthetic model: its pace between words, and chunks that translate into a valid event stream."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from tests.support.schema import validate_event
from worker.runner import synthetic
from worker.runner.synthetic import reply_text, synthetic_chunks
from worker.translation.chat_stream import finish_stream, start_stream, translate_chunk

EVENT = TypeAdapter(ResponseStreamEvent)
REQUEST = {"model": "synthetic", "messages": [{"role": "user", "content": "Hello there!"}]}
WORDS = reply_text(REQUEST).split(" ")


async def _chunks_and_pauses(monkeypatch: pytest.MonkeyPatch, delay_seconds: float) -> list[Any]:
    """Every chunk's content (or finish_reason, or "usage") and every pause, in the order they happened."""
    timeline: list[Any] = []

    async def sleep(seconds: float) -> None:
        timeline.append(("pause", seconds))

    # Time is faked for this module only; the event loop keeps the real asyncio.
    monkeypatch.setattr(synthetic, "asyncio", SimpleNamespace(sleep=sleep))
    async for chunk in synthetic_chunks(REQUEST, delay_seconds):
        timeline.append(_label(chunk))
    return timeline


def _label(chunk: dict[str, Any]) -> str:
    if not chunk["choices"]:
        return "usage"
    choice = chunk["choices"][0]
    return choice["finish_reason"] or choice["delta"]["content"]


def _spaced(words: list[str]) -> list[str]:
    return [word + " " for word in words[:-1]] + words[-1:]


async def test_it_pauses_the_delay_before_each_word(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a delay, each word comes after one pause of exactly that many seconds, and nothing else waits."""
    timeline = await _chunks_and_pauses(monkeypatch, 0.25)
    paced = [step for word in _spaced(WORDS) for step in (("pause", 0.25), word)]
    assert timeline == ["", *paced, "stop", "usage"]


async def test_no_delay_means_no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    """With delay 0 the words come without a single pause."""
    timeline = await _chunks_and_pauses(monkeypatch, 0)
    assert timeline == ["", *_spaced(WORDS), "stop", "usage"]


async def test_its_chunks_translate_into_a_valid_stream() -> None:
    """Its chunks become schema- and SDK-valid events that spell the reply, completed, with its usage."""
    state = start_stream()
    events = [
        event async for chunk in synthetic_chunks(REQUEST, 0) for event in translate_chunk(state, chunk)
    ]
    closing, outcome = finish_stream(state)
    events += closing
    for sequence_number, event in enumerate(events):
        wire = {**event, "sequence_number": sequence_number}
        validate_event(wire)
        assert EVENT.validate_python(wire).type == event["type"]
    text = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    assert text == reply_text(REQUEST)
    assert outcome.status == "completed"
    assert outcome.output[0]["content"][0]["text"] == reply_text(REQUEST)
    assert outcome.usage is not None
    assert (outcome.usage["input_tokens"], outcome.usage["output_tokens"]) == (2, len(WORDS))
