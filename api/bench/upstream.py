"""The bench upstream: a fake LLM server that paces tokens precisely, for as little CPU as it can.

Owns the upstream `respool bench` puts behind respool (and LiteLLM). It shares a 2-core machine with
the system under test and the load generator, so it is a raw ASGI callable on uvicorn (uvloop,
httptools, no access log, no middleware), JSON via orjson, and a token costs one sleep and one send
of bytes encoded before the stream began. The model name carries the pace:

    bench-<tokens>x<ms>        e.g. bench-64x20: 64 tokens, 20 ms apart; bench-8x0: 8, no pause

Every token's text is exactly "tok ", so a client counts tokens by counting b"tok ", even where a
proxy coalesces deltas. Token i (from 0) is due at start + i * ms on the loop's clock, start being
when the answer began (an absolute schedule: no drift); the first goes right after the opening
frames, and one whose time has passed goes at once.

    POST /v1/chat/completions  stream: true => `data:` chunks: role, one per token, finish_reason
                               "stop", usage if stream_options.include_usage, then [DONE];
                               otherwise one chat.completion, after tokens * ms
    POST /v1/responses         stream: true => the events of one text message, numbered from 0,
                               to response.completed; otherwise the Response, after tokens * ms
    GET  /v1/models            one entry, bench-64x20 (every name of the grammar is served)
    GET  /health               {"status": "ok"}

Another model is a 404 `model_not_found`; a body that is no JSON object with a string `model`, a
400; another route, a 404; all with OpenAI-shaped error bodies. Input tokens are the words of the
request's string contents and text parts, at least 1. A client that goes away ends its answer at
once, quietly; so does a stop (Ctrl-C) after uvicorn's graceful second: the body ends cut short.

Run: `python -m api.bench.upstream --port 0` prints `LISTENING http://127.0.0.1:<port>`. In process:
`await serve(host, port, on_listening)`, or hand `app` to a server of your own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import re
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
import uvicorn
import uvloop

type Json = dict[str, Any]
type Message = dict[str, Any]
type Receive = Callable[[], Awaitable[Message]]
type Send = Callable[[Message], Awaitable[None]]
type Handler = Callable[[Receive, Send], Awaitable[None]]
type Listener = Callable[[str], None]

MODEL_NAME = re.compile(r"bench-([0-9]+)x([0-9]+)")
TOKEN_TEXT = "tok "
LISTED_MODEL = {"id": "bench-64x20", "object": "model", "created": 0, "owned_by": "respool-bench"}
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
DONE_FRAME = b"data: [DONE]\n\n"
STOPPING = {"message": "The bench upstream is stopping.", "type": "server_error", "param": None, "code": None}
MORE_BODY: Message = {"type": "http.response.body", "more_body": True}
END_OF_BODY: Message = {"type": "http.response.body", "body": b"", "more_body": False}


class RequestError(Exception):
    """A request the upstream refuses, answered with `status` and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, param: str | None, code: str | None) -> None:
        super().__init__(message)
        error = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
        self.status, self.body = status, {"error": error}


@dataclass(frozen=True)
class Pace:
    """How many tokens an answer has and how far apart they go."""

    tokens: int
    seconds: float

    @classmethod
    def of(cls, model: str) -> Pace:
        found = MODEL_NAME.fullmatch(model)
        if found is None:
            message = f"The model `{model}` does not exist; the bench upstream serves bench-<tokens>x<ms>."
            raise RequestError(404, message, "model", "model_not_found")
        return cls(int(found[1]), int(found[2]) / 1000)


def count_words(value: object) -> int:
    """Words in a string, or in the `content` and `text` of the messages and parts of a list."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(count_words(item) for item in value)
    if isinstance(value, dict):
        return count_words(value.get("content")) + count_words(value.get("text"))
    return 0


class Answer(Protocol):
    """The frames of one streamed answer, and the JSON body of the same answer unstreamed."""

    def opening(self) -> list[bytes]: ...
    def token(self, index: int) -> bytes: ...
    def closing(self) -> list[bytes]: ...
    def whole(self) -> bytes: ...


@dataclass
class ChatAnswer:
    """Chat Completions chunks; every token chunk is the same bytes, encoded once."""

    body: Json
    pace: Pace
    prompt_tokens: int = field(init=False)
    envelope: Json = field(init=False)
    token_frame: bytes = field(init=False)

    def __post_init__(self) -> None:
        self.envelope = {
            "id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": self.body["model"],
        }  # fmt: skip
        self.prompt_tokens = max(1, count_words(self.body.get("messages")))
        self.token_frame = self.frame({"content": TOKEN_TEXT})

    def frame(self, delta: Json, finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return b"data: " + orjson.dumps({**self.envelope, "choices": [choice]}) + b"\n\n"

    def usage(self) -> Json:
        counts = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.pace.tokens}
        return {**counts, "total_tokens": self.prompt_tokens + self.pace.tokens}

    def opening(self) -> list[bytes]:
        return [self.frame({"role": "assistant", "content": ""})]

    def token(self, index: int) -> bytes:
        return self.token_frame

    def closing(self) -> list[bytes]:
        frames = [self.frame({}, "stop")]
        options = self.body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            usage = {**self.envelope, "choices": [], "usage": self.usage()}
            frames.append(b"data: " + orjson.dumps(usage) + b"\n\n")
        return [*frames, DONE_FRAME]

    def whole(self) -> bytes:
        message = {"role": "assistant", "content": TOKEN_TEXT * self.pace.tokens, "refusal": None}
        choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
        completion = {**self.envelope, "object": "chat.completion", "choices": [choice]}
        return orjson.dumps({**completion, "usage": self.usage()})


@dataclass
class ResponsesAnswer:
    """Responses events of one text message; a token's event is a prefix, its number and a suffix."""

    body: Json
    pace: Pace
    response_id: str = field(default_factory=lambda: f"resp_bench{secrets.token_hex(12)}")
    message_id: str = field(default_factory=lambda: f"msg_bench{secrets.token_hex(12)}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: int = field(init=False)
    delta_prefix: bytes = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_tokens = max(1, count_words(self.body.get("input")))
        delta = {"type": "response.output_text.delta", **self.where(), "delta": TOKEN_TEXT, "logprobs": []}
        # The event's JSON less its closing brace, so sequence_number can be spliced in last.
        self.delta_prefix = b"event: response.output_text.delta\ndata: " + orjson.dumps(delta)[:-1]
        self.delta_prefix += b',"sequence_number":'

    def where(self) -> Json:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def message(self, is_done: bool) -> Json:
        status, content = ("completed", [self.part(True)]) if is_done else ("in_progress", [])
        item = {"type": "message", "id": self.message_id, "role": "assistant"}
        return {**item, "status": status, "content": content}

    def part(self, is_done: bool) -> Json:
        text = TOKEN_TEXT * self.pace.tokens if is_done else ""
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def response(self, is_done: bool) -> Json:
        now = int(time.time())
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": "completed" if is_done else "in_progress", "model": self.body["model"],
            "output": [self.message(True)] if is_done else [], "usage": self.usage() if is_done else None,
            "completed_at": now if is_done else None, "error": None, "incomplete_details": None,
            "instructions": self.body.get("instructions"), "metadata": self.body.get("metadata") or {},
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "temperature": self.body.get("temperature"), "top_p": self.body.get("top_p"),
            "text": {"format": {"type": "text"}}, "background": False,
        }  # fmt: skip

    def usage(self) -> Json:
        return {
            "input_tokens": self.prompt_tokens, "output_tokens": self.pace.tokens,
            "total_tokens": self.prompt_tokens + self.pace.tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }  # fmt: skip

    def opening(self) -> list[bytes]:
        started = self.response(False)
        return [
            event_frame(0, {"type": "response.created", "response": started}),
            event_frame(1, {"type": "response.in_progress", "response": started}),
            event_frame(2, {"type": "response.output_item.added", "output_index": 0, "item": self.message(False)}),
            event_frame(3, {"type": "response.content_part.added", **self.where(), "part": self.part(False)}),
        ]  # fmt: skip

    def token(self, index: int) -> bytes:
        return self.delta_prefix + b"%d}\n\n" % (4 + index)

    def closing(self) -> list[bytes]:
        first, text = 4 + self.pace.tokens, TOKEN_TEXT * self.pace.tokens
        done_text = {"type": "response.output_text.done", **self.where(), "text": text, "logprobs": []}
        done_part = {"type": "response.content_part.done", **self.where(), "part": self.part(True)}
        done_item = {"type": "response.output_item.done", "output_index": 0, "item": self.message(True)}
        completed = {"type": "response.completed", "response": self.response(True)}
        events = (done_text, done_part, done_item, completed)
        return [event_frame(first + n, event) for n, event in enumerate(events)]

    def whole(self) -> bytes:
        return orjson.dumps(self.response(True))


def event_frame(sequence_number: int, event: Json) -> bytes:
    event_type: str = event["type"]
    data = orjson.dumps({**event, "sequence_number": sequence_number})
    return b"event: " + event_type.encode() + b"\ndata: " + data + b"\n\n"


async def send_stream(send: Send, answer: Answer, pace: Pace) -> None:
    """The answer's frames, one body message each, token i at start + i * pace on the loop's clock.
    Cancelled (see `answer_until_cancelled`), it ends the body there, without the closing frames."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    with contextlib.suppress(asyncio.CancelledError):
        for frame in answer.opening():
            await send({**MORE_BODY, "body": frame})
        for index in range(pace.tokens):
            delay = start + index * pace.seconds - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await send({**MORE_BODY, "body": answer.token(index)})
        for frame in answer.closing():
            await send({**MORE_BODY, "body": frame})
    await send(END_OF_BODY)


async def send_whole(send: Send, answer: Answer, pace: Pace) -> None:
    """The unstreamed answer, once all its tokens would have been streamed; cancelled, a 503."""
    try:
        await asyncio.sleep(pace.tokens * pace.seconds)
    except asyncio.CancelledError:
        await send_json(send, 503, orjson.dumps({"error": STOPPING}))
        return
    await send_json(send, 200, answer.whole())


async def send_json(send: Send, status: int, body: bytes) -> None:
    headers = [*JSON_HEADERS, (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def cancel_when_client_goes(receive: Receive, request: asyncio.Task[Any]) -> None:
    # uvicorn drops sends after a disconnect silently, so only receive() tells that the client left.
    while (await receive())["type"] != "http.disconnect":
        pass
    request.cancel()


async def answer_until_cancelled(receive: Receive, answering: Awaitable[None]) -> None:
    """Awaits `answering`, which a client that goes away cancels at once (as uvicorn cancels what is
    still open when a graceful stop times out). `answering` then ends its request itself, without
    raising: uvicorn logs a traceback for each request that ends with an exception or unfinished."""
    request = asyncio.current_task()
    assert request is not None
    watcher = asyncio.create_task(cancel_when_client_goes(receive, request))
    try:
        await answering
    finally:
        watcher.cancel()


async def read_request(receive: Receive) -> Json:
    """The request body as a JSON object with a string `model`, or RequestError."""
    chunks, has_more = [], True
    while has_more:
        message = await receive()
        if message["type"] == "http.disconnect":
            # nginx's "client closed request": uvicorn sends nothing to a client that has gone.
            raise RequestError(499, "The client closed the request.", None, None)
        chunks.append(message.get("body", b""))
        has_more = message.get("more_body", False)
    try:
        body = orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError as error:
        raise RequestError(400, f"The body is not valid JSON: {error}", None, None) from None
    if not isinstance(body, dict):
        raise RequestError(400, "The body must be a JSON object.", None, None)
    if not isinstance(body.get("model"), str):
        raise RequestError(400, "Missing required parameter: 'model'.", "model", "missing_required_parameter")
    return body


def answering(build: Callable[[Json, Pace], Answer]) -> Handler:
    """A handler that streams the answer `build` makes of the request, or sends it whole."""

    async def handler(receive: Receive, send: Send) -> None:
        body = await read_request(receive)
        pace = Pace.of(body["model"])
        respond = send_stream if body.get("stream") is True else send_whole
        await answer_until_cancelled(receive, respond(send, build(body, pace), pace))

    return handler


ROUTES: dict[tuple[str, str], Handler] = {
    ("POST", "/v1/chat/completions"): answering(ChatAnswer),
    ("POST", "/v1/responses"): answering(ResponsesAnswer),
}
# Answers that never change, encoded once.
STATIC: dict[tuple[str, str], bytes] = {
    ("GET", "/v1/models"): orjson.dumps({"object": "list", "data": [LISTED_MODEL]}),
    ("GET", "/health"): orjson.dumps({"status": "ok"}),
}


async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """The ASGI application: one dict lookup routes a request, errors answer as OpenAI's do."""
    if scope["type"] != "http":
        return
    route = (scope["method"], scope["path"])
    handler = ROUTES.get(route)
    try:
        if handler is not None:
            await handler(receive, send)
        elif route in STATIC:
            await send_json(send, 200, STATIC[route])
        else:
            raise RequestError(404, f"Unknown request URL: {route[0]} {route[1]}.", None, "unknown_url")
    except RequestError as error:
        await send_json(send, error.status, orjson.dumps(error.body))


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket (port 0 picks a free one): connections queue from now on."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def make_server() -> uvicorn.Server:
    """A uvicorn server for `app`, set up to spend as little CPU per request as uvicorn allows."""
    config = uvicorn.Config(
        app, loop="uvloop", http="httptools", ws="none", lifespan="off", access_log=False,
        log_level="warning", proxy_headers=False, server_header=False, date_header=False,
        # Streams end by themselves within tokens * ms; past a second, stopping cuts them.
        timeout_graceful_shutdown=1,
    )  # fmt: skip
    return uvicorn.Server(config)


async def serve(host: str = "127.0.0.1", port: int = 0, on_listening: Listener | None = None) -> None:
    """Serves `app` on host:port (IPv4) until the server is told to stop; `on_listening` gets the
    base URL once the socket is bound, before the first request is read."""
    sock = listening_socket(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    if on_listening is not None:
        on_listening(f"http://{bound_host}:{bound_port}")
    await make_server().serve(sockets=[sock])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The bench upstream: a paced fake LLM server.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(args.host, args.port, functools.partial(print, "LISTENING", flush=True)))


if __name__ == "__main__":
    main()
