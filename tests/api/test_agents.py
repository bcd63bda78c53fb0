"""An agent built with `openai-agents`, its Responses model pointed at respool, using a function tool."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

from tests.conftest import KEY_A
from tests.support.stack import Stack
from tests.support.upstream_process import ScriptedUpstream
from tests.support.validating import AsyncValidatingTransport

pytestmark = pytest.mark.integration

set_tracing_disabled(True)  # the SDK's trace exporter would call OpenAI's servers

TOOL_CALL = [
    {
        "delta": {
            "role": "assistant",
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_w1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ],
        }
    },
    {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}},
    {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}},
    {"delta": {}, "finish_reason": "tool_calls"},
]


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny in {city}."


@pytest.fixture
async def async_client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    """The async SDK as tenant A, every answer validated."""
    http = httpx.AsyncClient(transport=AsyncValidatingTransport())
    async with openai.AsyncOpenAI(
        base_url=stack.url + "/v1", api_key=KEY_A, max_retries=0, http_client=http
    ) as sdk:
        yield sdk


def _agent(model: str, client: openai.AsyncOpenAI) -> Agent:
    return Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=model, openai_client=client),
    )


@pytest.mark.parametrize("streamed", [False, True])
async def test_agent_function_tool_round_trip(
    async_client: openai.AsyncOpenAI, upstream: ScriptedUpstream, model: str, streamed: bool
) -> None:
    """The agent calls the tool through respool, sends its result back, and finishes with the model's answer."""
    upstream.script(model, {"chunks": TOOL_CALL, "times": 1, "then": {"text": "Sunny in Paris today."}})
    agent = _agent(model, async_client)
    if streamed:
        result = Runner.run_streamed(agent, "What is the weather in Paris?")
        kinds = {event.type async for event in result.stream_events()}
        assert "raw_response_event" in kinds
    else:
        result = await Runner.run(agent, "What is the weather in Paris?")
    assert result.final_output == "Sunny in Paris today."
    first, second = upstream.requests(model)[-2:]
    assert first["tools"][0]["function"]["name"] == "get_weather"
    tool_message = next(m for m in second["messages"] if m["role"] == "tool")
    assert (tool_message["tool_call_id"], tool_message["content"]) == ("call_w1", "It is sunny in Paris.")


async def test_an_agent_keeps_its_state_in_a_conversation(
    async_client: openai.AsyncOpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """Two runs of an agent with `conversation_id`: the SDK sends only each turn's new items, and
    respool's conversation holds the rest: the tool call and its output of the first run, and the
    whole first run when the second starts."""
    conversation = await async_client.conversations.create()
    upstream.script(
        model,
        {"chunks": TOOL_CALL, "times": 1, "then": {"text": "Sunny in Paris today."}},
    )
    agent = _agent(model, async_client)
    first = await Runner.run(agent, "What is the weather in Paris?", conversation_id=conversation.id)
    assert first.final_output == "Sunny in Paris today."
    upstream.script(model, {"text": "Tomorrow too."})
    second = await Runner.run(agent, "And tomorrow?", conversation_id=conversation.id)
    assert second.final_output == "Tomorrow too."
    last = upstream.requests(model)[-1]["messages"]
    assert [message["role"] for message in last] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
    ]
    assert last[3]["content"] == "It is sunny in Paris." and last[-1]["content"] == "And tomorrow?"
    kinds = [item.type async for item in async_client.conversations.items.list(conversation.id, order="asc")]
    assert kinds == ["message", "function_call", "function_call_output", "message", "message", "message"]
