"""Streams captured from a real llama-cpp-python 0.3.36 server, replayed by the scripted upstream
through real respool processes: what a client gets of that server's quirks (issue 14)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.upstream_process import ScriptedUpstream

pytestmark = [pytest.mark.integration, pytest.mark.once]  # the upstream's quirks, whatever the servers

FIXTURES = Path(__file__).resolve().parents[1] / "worker" / "translation" / "fixtures"
TOOLS: Any = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def replay(upstream: ScriptedUpstream, model: str, fixture: str) -> None:
    """The model answers with the captured chunks, as the server sent them, then `[DONE]`."""
    chunks = json.loads((FIXTURES / f"{fixture}.json").read_text())["chunks"]
    upstream.script(model, {"chunks": chunks})


def test_extra_logprob_candidates_are_cut_to_the_number_asked(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """Asked for 2, llama-cpp-python sends a third candidate for some tokens: the client gets 2 each."""
    replay(upstream, model, "llamacpp_python_top_logprobs")
    response = client.responses.create(
        model=model, input="hi", top_logprobs=2, max_output_tokens=5, include=["message.output_text.logprobs"]
    )
    (sent,) = upstream.requests(model)
    assert (sent["logprobs"], sent["top_logprobs"]) == (True, 2)
    logprobs = response.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert logprobs and [len(token.top_logprobs) for token in logprobs] == [2] * len(logprobs)
    assert response.status == "incomplete"
    assert response.usage is None  # llama-cpp-python reports none in streams


def test_a_call_cut_by_max_tokens_ends_incomplete_not_completed(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """llama-cpp-python says `tool_calls` for arguments cut at '{"c' by max_tokens: the response ends
    incomplete (max_output_tokens) with the call incomplete, on the stream and in storage alike."""
    replay(upstream, model, "llamacpp_python_cut_tool_call")
    events = list(
        client.responses.create(
            model=model,
            input="weather in Paris?",
            tools=TOOLS,
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=3,
            stream=True,
        )
    )
    final = events[-1].response  # type: ignore[union-attr]
    assert (events[-1].type, final.incomplete_details.reason) == ("response.incomplete", "max_output_tokens")
    (call,) = final.output
    assert (call.type, call.arguments, call.status) == ("function_call", '{"c', "incomplete")  # type: ignore[union-attr]
    assert client.responses.retrieve(final.id).output == final.output
