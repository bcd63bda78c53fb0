"""The bench upstream (`python -m api.bench.upstream`) as a real process, driven by the `openai` SDK and httpx."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pydantic
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from api.bench import upstream
from tests.support.upstream_process import REPO_ROOT, read_listening_url, stop_child

EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one two three"}]
integration = pytest.mark.integration
# Neither Redis nor Postgres is involved: CI runs these once (marker `once`).
pytestmark = pytest.mark.once


@dataclass(frozen=True)
class RunningUpstream:
    url: str
    stderr_path: Path

    def stderr(self) -> str:
        return self.stderr_path.read_text()


@contextlib.contextmanager
def running_upstream(stderr_path: Path) -> Iterator[tuple[RunningUpstream, subprocess.Popen[str]]]:
    """`python -m api.bench.upstream --port 0` from the repo root, its stderr to `stderr_path`."""
    command = [sys.executable, "-m", "api.bench.upstream", "--port", "0"]
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        yield RunningUpstream(read_listening_url(process, 20.0), stderr_path), process
    finally:
        stop_child(process)


@pytest.fixture(scope="module")
def bench_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningUpstream]:
    with running_upstream(tmp_path_factory.mktemp("bench-upstream") / "stderr.log") as (running, _):
        yield running


@pytest.fixture
def sdk(bench_upstream: RunningUpstream) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=bench_upstream.url + "/v1", api_key="x", max_retries=0) as client:
        yield client


@pytest.fixture
def http(bench_upstream: RunningUpstream) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=bench_upstream.url, timeout=10.0) as client:
        yield client


def sse_frames(raw: bytes) -> list[dict[str, str]]:
    """Each SSE frame's fields (`event`, `data`) by name."""
    frames = []
    for block in raw.decode().split("\n\n"):
        if block:
            frames.append(dict(line.split(": ", 1) for line in block.split("\n")))
    return frames


@integration
@pytest.mark.parametrize("is_usage_wanted", [True, False])
def test_chat_stream_sends_paced_tokens(sdk: openai.OpenAI, is_usage_wanted: bool) -> None:
    """bench-5x10 streams a role chunk, 5 "tok " chunks at least 10 ms apart, stop, then usage if asked."""
    started = time.monotonic()
    stream = sdk.chat.completions.create(
        model="bench-5x10",
        messages=MESSAGES,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True} if is_usage_wanted else openai.omit,
    )
    chunks = list(stream)
    elapsed = time.monotonic() - started
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [chunk.choices[0].delta.content for chunk in chunks[1:6]] == ["tok "] * 5
    assert chunks[6].choices[0].finish_reason == "stop"
    assert elapsed >= 4 * 0.010
    if is_usage_wanted:
        assert chunks[7].choices == []
        assert chunks[7].usage is not None
        assert chunks[7].usage.model_dump() == {
            "prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
            "completion_tokens_details": None, "prompt_tokens_details": None,
        }  # fmt: skip
    assert len(chunks) == (8 if is_usage_wanted else 7)


@integration
def test_chat_stream_frames_are_valid_chunks(http: httpx.Client) -> None:
    """Every `data:` frame but the closing [DONE] validates as a ChatCompletionChunk of one id."""
    body = {"model": "bench-3x0", "stream": True, "stream_options": {"include_usage": True}, "messages": []}
    answer = http.post("/v1/chat/completions", json=body)
    assert answer.headers["content-type"] == "text/event-stream"
    frames = sse_frames(answer.content)
    assert frames[-1] == {"data": "[DONE]"}
    chunks = [ChatCompletionChunk.model_validate_json(frame["data"]) for frame in frames[:-1]]
    assert {chunk.id for chunk in chunks} == {chunks[0].id}
    assert chunks[0].id.startswith("chatcmpl-")
    assert answer.content.count(b"tok ") == 3
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == 1


@integration
def test_chat_without_stream_answers_one_completion(http: httpx.Client) -> None:
    """Without `stream`, bench-5x10 answers one valid chat.completion with the whole text, after 50 ms."""
    started = time.monotonic()
    answer = http.post("/v1/chat/completions", json={"model": "bench-5x10", "messages": MESSAGES})
    assert time.monotonic() - started >= 5 * 0.010
    completion = ChatCompletion.model_validate_json(answer.content)
    assert completion.choices[0].message.content == "tok " * 5
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (5, 5)


@integration
def test_responses_stream_events_validate(http: httpx.Client) -> None:
    """Every Responses event validates as its SDK class, numbered 0..n, and the final Response holds the text."""
    answer = http.post("/v1/responses", json={"model": "bench-5x10", "stream": True, "input": "hello there"})
    frames = sse_frames(answer.content)
    events = [EVENTS.validate_json(frame["data"]) for frame in frames]
    assert [frame["event"] for frame in frames] == [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 5, "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert {event.delta for event in events[4:9]} == {"tok "}
    final = Response.model_validate(events[-1].response.model_dump())
    assert (final.status, final.output_text) == ("completed", "tok " * 5)
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (2, 5, 7)


@integration
def test_responses_stream_through_the_sdk(sdk: openai.OpenAI) -> None:
    """The SDK's responses stream parses every event and ends in a completed Response of "tok " * 5."""
    started = time.monotonic()
    events = list(sdk.responses.create(model="bench-5x10", input="hello", stream=True))
    assert time.monotonic() - started >= 4 * 0.010
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert deltas == ["tok "] * 5
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "tok " * 5


@integration
def test_responses_without_stream_answers_the_response(sdk: openai.OpenAI, http: httpx.Client) -> None:
    """Without `stream`, /v1/responses answers the completed Response, valid as the SDK's model."""
    assert sdk.responses.create(model="bench-3x10", input="hi").output_text == "tok " * 3
    answer = http.post(
        "/v1/responses", json={"model": "bench-3x0", "input": [{"role": "user", "content": "a b"}]}
    )
    response = Response.model_validate_json(answer.content)
    assert (response.status, response.output_text, response.model) == ("completed", "tok " * 3, "bench-3x0")


@integration
@pytest.mark.parametrize("model", ["gpt-4o", "bench-5", "bench-x10", "bench-5x10x1"])
def test_unknown_model_is_not_found(sdk: openai.OpenAI, model: str) -> None:
    """A model name outside the bench-<tokens>x<ms> grammar is a 404 model_not_found on both routes."""
    with pytest.raises(openai.NotFoundError) as chat_error:
        sdk.chat.completions.create(model=model, messages=[])
    with pytest.raises(openai.NotFoundError) as responses_error:
        sdk.responses.create(model=model, input="hi", stream=True)
    for error in (chat_error.value, responses_error.value):
        assert (error.code, error.param, error.type) == ("model_not_found", "model", "invalid_request_error")


@integration
@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b"", None),
        (b'{"input": "hi"}', "model"),
        (b'{"model": 1}', "model"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_bad_request_is_400(http: httpx.Client, path: str, body: bytes, param: str | None) -> None:
    """A body that is not a JSON object with a string `model` is a 400 with an OpenAI-shaped error."""
    answer = http.post(path, content=body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert error["message"]


@integration
def test_health_models_and_unknown_routes(http: httpx.Client) -> None:
    """/health is ok, /v1/models lists bench-64x20, and any other route is an OpenAI-shaped 404."""
    assert http.get("/health").json() == {"status": "ok"}
    assert [model["id"] for model in http.get("/v1/models").json()["data"]] == ["bench-64x20"]
    for method, path in [("GET", "/v1/chat/completions"), ("POST", "/v1/embeddings"), ("GET", "/")]:
        answer = http.request(method, path)
        assert answer.status_code == 404
        assert answer.json()["error"]["type"] == "invalid_request_error"


@integration
async def test_many_concurrent_streams_complete(bench_upstream: RunningUpstream) -> None:
    """200 concurrent bench-20x20 chat streams each get their 20 tokens and [DONE]."""
    body = {"model": "bench-20x20", "stream": True, "messages": MESSAGES}
    limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
    async with httpx.AsyncClient(base_url=bench_upstream.url, limits=limits, timeout=30.0) as client:

        async def stream() -> bytes:
            return (await client.post("/v1/chat/completions", json=body)).content

        answers = await asyncio.gather(*(stream() for _ in range(200)))
    assert [answer.count(b"tok ") for answer in answers] == [20] * 200
    assert all(answer.endswith(b"data: [DONE]\n\n") for answer in answers)


@integration
def test_client_leaving_mid_stream_leaves_server_healthy(
    http: httpx.Client, bench_upstream: RunningUpstream
) -> None:
    """A client that closes a stream after its first token leaves a server that serves the next stream
    and has logged no traceback."""
    body = {"model": "bench-200x20", "stream": True, "messages": MESSAGES}
    with http.stream("POST", "/v1/chat/completions", json=body) as answer:
        for chunk in answer.iter_bytes():
            if b"tok " in chunk:
                break
    again = http.post("/v1/chat/completions", json={**body, "model": "bench-3x0"})
    assert again.content.count(b"tok ") == 3
    assert http.get("/health").status_code == 200
    assert "Traceback" not in bench_upstream.stderr()
    assert bench_upstream.stderr() == ""


async def test_leaving_client_ends_its_answer_at_once() -> None:
    """In process: once the client disconnects, the app sends no further token and returns."""
    request = orjson.dumps({"model": "bench-1000x10", "stream": True, "messages": MESSAGES})
    requests = [{"type": "http.request", "body": request, "more_body": False}]
    gone = asyncio.Event()
    bodies: list[bytes] = []

    async def receive() -> dict[str, Any]:
        if requests:
            return requests.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        bodies.append(message.get("body", b""))
        if b"".join(bodies).count(b"tok ") == 2:
            gone.set()

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions"}
    await upstream.app(scope, receive, send)
    assert b"".join(bodies).count(b"tok ") == 2
    assert bodies[-1] == b""  # the body ended, so uvicorn has nothing to complain about


@integration
def test_stopping_with_open_answers_ends_them_quietly(tmp_path: Path) -> None:
    """Ctrl-C while a stream and an unstreamed answer are open ends both within uvicorn's graceful
    second (the stream cut short, the other a 503), logs no traceback and prints nothing more."""
    with running_upstream(tmp_path / "stderr.log") as (running, process):
        url = httpx.URL(running.url)
        body = orjson.dumps({"model": "bench-1000x20", "messages": MESSAGES})
        head = f"POST /v1/responses HTTP/1.1\r\nhost: {url.host}\r\ncontent-length: {len(body)}\r\n\r\n"
        with socket.create_connection((url.host, url.port or 80)) as unstreamed:
            unstreamed.sendall(head.encode() + body)
            with httpx.Client(base_url=running.url, timeout=10.0) as client:
                stream_body = {"model": "bench-1000x20", "stream": True, "messages": MESSAGES}
                with client.stream("POST", "/v1/chat/completions", json=stream_body) as stream:
                    chunks, received = stream.iter_bytes(), b""
                    while received.count(b"tok ") < 2:  # by then the unstreamed request is being answered
                        received += next(chunks)
                    process.send_signal(signal.SIGINT)
                    received += b"".join(chunks)
            reply = b"".join(iter(lambda: unstreamed.recv(65536), b""))
        assert process.wait(timeout=10) == 0
        assert process.stdout is not None
        assert process.stdout.read() == ""  # the LISTENING line was all it printed
    assert 2 <= received.count(b"tok ") < 1000
    assert b"[DONE]" not in received
    assert reply.startswith(b"HTTP/1.1 503 ")
    assert b'"type":"server_error"' in reply
    assert "Traceback" not in running.stderr()
