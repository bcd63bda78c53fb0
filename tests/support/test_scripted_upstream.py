"""Tests of the scripted upstream itself, through the real `openai` SDK against the real process."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import AsyncExitStack

import httpx
import openai
import pytest

from tests.support.upstream_process import ScriptedUpstream

CONCURRENT_STREAMS = 300


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream.start() as started:
        yield started


@pytest.fixture
def client(upstream: ScriptedUpstream) -> Iterator[openai.OpenAI]:
    upstream.reset()
    with openai.OpenAI(base_url=upstream.url, api_key="x", max_retries=0) as sdk:
        yield sdk


def test_default_chat_stream_echoes_the_last_user_message(client: openai.OpenAI) -> None:
    """An unscripted model streams the echo word by word, role first and usage last."""
    stream = client.chat.completions.create(
        model="any-model",
        messages=[{"role": "user", "content": "first"}, {"role": "user", "content": "hi there"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)

    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == "Hello from the scripted upstream. You said: hi there"
    assert chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.content == "Hello "
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None


@pytest.mark.parametrize("is_stream", [True, False])
def test_scripted_text_reports_the_scripted_usage(
    upstream: ScriptedUpstream, client: openai.OpenAI, is_stream: bool
) -> None:
    """A text script is answered with its text, finish_reason and usage, streamed or not."""
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    upstream.script("m", {"text": "one two three", "finish_reason": "length", "usage": usage})
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "go"}]

    if is_stream:
        chunks = list(
            client.chat.completions.create(
                model="m", messages=messages, stream=True, stream_options={"include_usage": True}
            )
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        finish_reason, reported = chunks[-2].choices[0].finish_reason, chunks[-1].usage
    else:
        completion = client.chat.completions.create(model="m", messages=messages)
        text = completion.choices[0].message.content or ""
        finish_reason, reported = completion.choices[0].finish_reason, completion.usage

    assert text == "one two three"
    assert finish_reason == "length"
    assert reported is not None
    assert reported.model_dump(exclude_none=True) == usage


def test_error_script_fails_only_the_first_times_requests(
    upstream: ScriptedUpstream, client: openai.OpenAI
) -> None:
    """A 429 script with times=1 fails one request with its headers, then follows `then`."""
    upstream.script(
        "m",
        {
            "status": 429,
            "error": {"message": "slow down", "type": "rate_limit_error"},
            "headers": {"retry-after": "1"},
            "times": 1,
            "then": {"text": "recovered"},
        },
    )
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "go"}]

    with pytest.raises(openai.RateLimitError) as failure:
        client.chat.completions.create(model="m", messages=messages)
    completion = client.chat.completions.create(model="m", messages=messages)

    assert failure.value.status_code == 429
    assert failure.value.body == {
        "message": "slow down",
        "type": "rate_limit_error",
        "param": None,
        "code": None,
    }
    assert failure.value.response.headers["retry-after"] == "1"
    assert completion.choices[0].message.content == "recovered"


def test_raw_chunks_stream_a_tool_call(upstream: ScriptedUpstream, client: openai.OpenAI) -> None:
    """Raw chunk shorthands reach the SDK as a tool call, and assemble into one when not streamed."""
    call = {"index": 0, "id": "call_1", "type": "function"}
    upstream.script(
        "m",
        {
            "chunks": [
                {
                    "delta": {
                        "role": "assistant",
                        "tool_calls": [{**call, "function": {"name": "get_weather"}}],
                    }
                },
                {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}},
                {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}},
                {"delta": {}, "finish_reason": "tool_calls"},
            ]
        },
    )
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "weather?"}]

    chunks = list(client.chat.completions.create(model="m", messages=messages, stream=True))
    completion = client.chat.completions.create(model="m", messages=messages)

    deltas = [tool for chunk in chunks for tool in chunk.choices[0].delta.tool_calls or []]
    assert deltas[0].function is not None
    assert deltas[0].function.name == "get_weather"
    assert "".join(delta.function.arguments or "" for delta in deltas if delta.function) == '{"city":"Paris"}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    tool_calls = completion.choices[0].message.tool_calls or []
    assert [(c.id, c.function.name, c.function.arguments) for c in tool_calls if c.type == "function"] == [
        ("call_1", "get_weather", '{"city":"Paris"}')
    ]


def test_native_responses_stream_is_parsed_by_the_sdk(client: openai.OpenAI) -> None:
    """/v1/responses streams the OpenAI event sequence with upstream ids and numbers from 0."""
    events = list(client.responses.create(model="m", input="hello you", stream=True))

    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.id.startswith("resp_up")
    assert (completed.response.output[0].id or "").startswith("msg_up")
    assert completed.response.output_text == "Hello from the scripted upstream. You said: hello you"
    assert completed.response.usage is not None


def test_requests_are_recorded_with_path_and_authorization(
    upstream: ScriptedUpstream, client: openai.OpenAI
) -> None:
    """Every model request is recorded in order with its path and bearer token, filterable by model."""
    client.chat.completions.create(model="a", messages=[{"role": "user", "content": "one"}])
    client.responses.create(model="b", input="two")

    recorded = upstream.requests()
    assert [(r["path"], r["model"]) for r in recorded] == [
        ("/v1/chat/completions", "a"),
        ("/v1/responses", "b"),
    ]
    assert recorded[0]["headers"] == {"authorization": "Bearer x"}
    assert recorded[0]["messages"] == [{"role": "user", "content": "one"}]
    assert [r["input"] for r in upstream.requests("b")] == ["two"]


def test_a_dropped_stream_fails_the_client_mid_stream(
    upstream: ScriptedUpstream, client: openai.OpenAI
) -> None:
    """drop_after cuts the connection after K frames: the SDK reads K chunks, then fails."""
    upstream.script("m", {"text": "a b c d e", "drop_after": 3})
    chunks = iter(client.chat.completions.create(model="m", messages=[], stream=True))

    received = [next(chunks).choices[0].delta.content for _ in range(3)]

    assert received == ["", "a ", "b "]
    with pytest.raises(openai.APIConnectionError):
        next(chunks)


def test_a_reset_script_answers_nothing_then_follows_then(
    upstream: ScriptedUpstream, client: openai.OpenAI
) -> None:
    """reset cuts the connection without any HTTP answer; with times=1 the next request is answered."""
    upstream.script("m", {"reset": True, "times": 1, "then": {"text": "back again"}})
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "go"}]

    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="m", messages=messages)
    completion = client.chat.completions.create(model="m", messages=messages)

    assert completion.choices[0].message.content == "back again"
    assert len(upstream.requests("m")) == 2


async def test_hundreds_of_hung_streams_are_held_open_at_once(upstream: ScriptedUpstream) -> None:
    """Hung streams all count as active while open and stop counting when their clients leave."""
    upstream.reset()
    upstream.script("slow", {"hang": True})
    body = {"model": "slow", "messages": [], "stream": True}
    limits = httpx.Limits(max_connections=CONCURRENT_STREAMS + 1)

    async with httpx.AsyncClient(base_url=upstream.base_url, limits=limits, timeout=30) as http:
        async with AsyncExitStack() as streams:
            # The server counts a stream active before it sends the headers that end each open.
            opening = (
                streams.enter_async_context(http.stream("POST", "/v1/chat/completions", json=body))
                for _ in range(CONCURRENT_STREAMS)
            )
            await asyncio.gather(*opening)
            held = (await http.get("/_stats")).json()
        released = (await http.get("/_stats", params={"until_active": 0, "timeout": 10})).json()

    assert held == {
        "active": CONCURRENT_STREAMS,
        "max_active": CONCURRENT_STREAMS,
        "total": CONCURRENT_STREAMS,
    }
    assert released["active"] == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_refused_415(
    upstream: ScriptedUpstream, path: str, content_type: str | None
) -> None:
    """Like FastAPI-based servers, a body without `content-type: application/json` is not read: 415, nothing recorded."""
    upstream.reset()
    body = b'{"model": "m", "messages": [], "input": "hi", "stream": true}'
    headers = {} if content_type is None else {"content-type": content_type}
    answer = httpx.post(upstream.base_url + path, content=body, headers=headers)
    assert answer.status_code == 415
    assert "application/json" in answer.json()["error"]["message"]
    assert upstream.requests() == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", b"[1, 2]"),
        ("/v1/chat/completions", b"not json"),
        ("/v1/chat/completions", b'{"model": "m"}'),
        ("/v1/chat/completions", b'{"model": "m", "messages": "hi"}'),
        ("/v1/responses", b'{"model": "m"}'),
        ("/v1/responses", b'{"input": "hi"}'),
    ],
)
def test_a_body_the_api_cannot_take_is_refused_422(
    upstream: ScriptedUpstream, path: str, body: bytes
) -> None:
    """A JSON body that is not an object with the API's required fields is a 422 with FastAPI's `detail`."""
    upstream.reset()
    answer = httpx.post(upstream.base_url + path, content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 422
    assert answer.json()["detail"]
    assert upstream.requests() == []
