"""`truncation: "auto"` (issue 18): an input longer than the model's context loses its oldest turns
until the upstream takes it, instead of failing; without it, the upstream's refusal is the failure."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.support.upstream_process import ScriptedUpstream

pytestmark = pytest.mark.integration


def turns(count: int) -> list[dict[str, Any]]:
    """`count` exchanges of five-word messages, then a last question."""
    items: list[dict[str, Any]] = []
    for n in range(count):
        items.append({"role": "user", "content": f"question {n} has five words"})
        items.append({"role": "assistant", "content": f"answer {n} has five words"})
    return [*items, {"role": "user", "content": "and the last one?"}]


def test_the_oldest_turns_go_until_the_input_fits(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    upstream.script(model, {"context_words": 30, "text": "fits now"})
    response = client.responses.create(
        model=model,
        instructions="Be brief.",
        input=turns(5),  # type: ignore[arg-type]
        truncation="auto",
    )
    assert (response.status, response.output_text, response.truncation) == ("completed", "fits now", "auto")
    asked = [len(request["messages"]) for request in upstream.requests(model)]
    assert asked == [12, 10, 8, 6]  # 54, 44, 34, then 24 words: each try one exchange shorter
    last = upstream.requests(model)[-1]["messages"]
    assert last[0] == {"role": "system", "content": "Be brief."}  # instructions stay
    assert last[1]["content"] == "question 3 has five words" and last[-1]["content"] == "and the last one?"


def test_without_auto_the_refusal_is_the_failure(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    upstream.script(model, {"context_words": 30})
    response = client.responses.create(model=model, input=turns(5))  # type: ignore[arg-type]
    assert response.status == "failed" and response.error is not None
    assert "maximum context length is 30" in response.error.message
    assert len(upstream.requests(model)) == 1


def test_a_single_turn_too_long_still_fails(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    upstream.script(model, {"context_words": 3})
    response = client.responses.create(model=model, input="far more than three words here", truncation="auto")
    assert response.status == "failed" and "maximum context length" in (
        response.error.message if response.error else ""
    )
