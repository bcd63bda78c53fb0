"""The scripted upstream: a real HTTP LLM server that integration tests drive.

Owns the fake "upstream" that respool workers call. It speaks Chat Completions
(`POST /v1/chat/completions`, like vLLM, Ollama or llama.cpp) and the Responses API
(`POST /v1/responses`, for native upstreams), answers from per-model scripts, records every
request and counts open streams. Control routes, which no OpenAI API has:

    POST /tokenize   vLLM's tokenizer route: {model, messages} => {count, ...}, a token per word
                     and one per message (a model scripted `tokenize: false` answers 404, here and
                     at /apply-template; one
                     scripted `tokenize: "llama.cpp"` answers as llama-server does, 500); and
                     llama-server's: {content} => {tokens}, a token per word
    POST /apply-template   llama-server's: {messages} => {prompt}, ChatML
    POST /v1/responses/compact   OpenAI's: the input's user messages and a `compaction` item of its
                     own (`upstream-compaction:<n>`); a model scripted `compact: false` answers 404
    POST /_script    {"model": m, "script": {...}}   model m follows the script from now on
    GET  /_requests  ?model=m                         bodies received, in order, plus "path", "headers"
    POST /_reset                                      forgets scripts, records and counters
    GET  /_stats     ?until_active=n&timeout=s        {"active", "max_active", "total"}, once n are open

A script is a JSON object; every key is optional:

    text, words_per_chunk=1    the answer, one chunk per word (a word keeps its trailing space)
    delay, first_delay         seconds before every SSE frame; extra seconds before the first one
    together=false             true: every frame in one write, after first_delay (an answer its
                               client reads at once, as from a server that buffers)
    finish_reason="stop"       chat only
    usage                      usage to report instead of word counts; null reports none
    chunks: [...]              chat only: raw chunks sent as given, or {"delta", "finish_reason"}
                               and {"usage"} shorthands; then `data: [DONE]`
    done=true                  chat only: false ends the stream without `data: [DONE]`
    events: [...]              responses only: raw Responses events sent as given
    tool_loop: {...}           a model that calls the function tools it is offered, then answers
                               with their result (`upstream_frames.tool_loop_step`)
    status, error, headers     answer this HTTP error with an OpenAI-shaped error body, e.g.
                               {"status": 429, "headers": {"retry-after": "1"}}
    reset: true                answer nothing: cut the TCP connection with a reset (RST)
    times, then                only the first `times` requests follow this script, later ones `then`
    hang: true                 send the response headers, then nothing until the client goes away
    context_words: N           answer vLLM's 400 "maximum context length" when the messages (or the
                               input) hold more than N words
    drop_after: K              cut the connection after K SSE frames, without a final chunk

Unscripted models echo: "Hello from the scripted upstream. You said: <last user text>".

As strict as the servers it stands for (FastAPI-based ones such as vLLM's, SGLang's and
llama-cpp-python's): a body not sent as `content-type: application/json` is refused with 415, and
a body that is not a JSON object, or lacks what the API requires (`model`, and `messages` for Chat
Completions or `input` for Responses, in their types), with 422 and FastAPI's `detail` list.
Run: `python -m tests.support.scripted_upstream --port 0` prints `LISTENING http://127.0.0.1:<port>`.
From a test: `ScriptedUpstream.start()` in `tests.support.upstream_process`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import struct
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from api.bench.upstream import listening_socket
from tests.support.upstream_frames import (
    DEFAULT_MODEL,
    Json,
    assemble_completion,
    chat_chunks,
    conversation,
    count_words,
    encode,
    response_events,
)

RECORDED_HEADERS = ("authorization",)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
DONE_FRAME = b"data: [DONE]\n\n"
# Cutting a stream on purpose (drop_after) makes uvicorn log this; it is the point, not a fault.
DROP_LOG_MESSAGE = "ASGI callable returned without completing response."


@dataclass
class UpstreamState:
    """Scripts, recorded requests and stream counters of one server process."""

    scripts: dict[str, Json] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    records: list[Json] = field(default_factory=list)
    active: int = 0
    max_active: int = 0
    total: int = 0
    active_changed: asyncio.Event = field(default_factory=asyncio.Event)
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    # uvicorn's open connections (its ServerState's set), so a script can cut one: no ASGI message can.
    connections: set[Any] = field(default_factory=set)

    def reset(self) -> None:
        """Forget scripts, records and counts; streams still open stay counted until they close."""
        self.scripts.clear()
        self.attempts.clear()
        self.records.clear()
        self.max_active = self.active
        self.total = 0

    def next_script(self, model: str, *, counted: bool = True) -> Json:
        """The script this request follows: a `times`-limited script gives way to its `then` (only
        the model's generations count toward `times`: not its tokenizer's requests)."""
        script = self.scripts.get(model, {})
        attempt = self.attempts.get(model, 0)
        if counted:
            self.attempts[model] = attempt + 1
        if "times" in script and attempt >= script["times"]:
            return cast(Json, script.get("then", {}))
        return script

    def record(self, request: Request, body: Json) -> None:
        headers = {name: request.headers.get(name) for name in RECORDED_HEADERS}
        self.records.append({**body, "path": request.url.path, "headers": headers})
        self.total += 1

    @contextlib.contextmanager
    def open_stream(self) -> Iterator[None]:
        self.count_active(+1)
        try:
            yield
        finally:
            self.count_active(-1)

    def count_active(self, change: int) -> None:
        self.active += change
        self.max_active = max(self.max_active, self.active)
        self.active_changed.set()
        self.active_changed = asyncio.Event()

    async def wait_for_active(self, count: int) -> None:
        """Return once exactly `count` streams are open."""
        while self.active != count:
            await self.active_changed.wait()

    def transport_of(self, client: object) -> asyncio.Transport:
        """The TCP transport of the connection whose peer is `client` (the ASGI scope's (host, port))."""
        for connection in self.connections:
            if connection.client == client:
                return cast(asyncio.Transport, connection.transport)
        raise LookupError(f"no open connection from {client}")


@dataclass(frozen=True)
class Pacing:
    """When frames go out, and whether the stream hangs or is cut short."""

    delay: float = 0.0
    first_delay: float = 0.0
    drop_after: int | None = None
    is_hang: bool = False
    is_together: bool = False

    @classmethod
    def of(cls, script: Json) -> Pacing:
        return cls(
            delay=float(script.get("delay", 0.0)),
            first_delay=float(script.get("first_delay", 0.0)),
            drop_after=script.get("drop_after"),
            is_hang=bool(script.get("hang", False)),
            is_together=bool(script.get("together", False)),
        )

    def pause_before(self, index: int) -> float:
        return self.delay + (self.first_delay if index == 0 else 0.0)


class StreamEndedError(Exception):
    """The client went away, or the server began to stop, while a stream was open."""


async def end_when_client_goes(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    raise StreamEndedError


async def end_when_closing(closing: asyncio.Event) -> None:
    await closing.wait()
    raise StreamEndedError


class PacedStream(Response):
    """Sends frames with the script's pacing; a client that goes away ends it at once."""

    def __init__(self, frames: list[bytes], pacing: Pacing, state: UpstreamState, media_type: str) -> None:
        # Not Response.__init__: that would add `content-length: 0` for an empty body.
        self.frames, self.pacing, self.state = frames, pacing, state
        self.status_code, self.media_type, self.background = 200, media_type, None
        self.init_headers({"cache-control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # uvicorn drops sends after a disconnect silently, so only watching receive() notices it.
        with self.state.open_stream(), contextlib.suppress(StreamEndedError):
            async with asyncio.TaskGroup() as tasks:
                watchers = [
                    tasks.create_task(end_when_client_goes(receive)),
                    tasks.create_task(end_when_closing(self.state.closing)),
                ]
                await self.send_frames(send)
                for watcher in watchers:
                    watcher.cancel()

    async def send_frames(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        if self.pacing.is_hang:
            await asyncio.Event().wait()  # never set: the disconnect watcher ends this stream
        if self.pacing.is_together:
            await asyncio.sleep(self.pacing.pause_before(0))
            await send({"type": "http.response.body", "body": b"".join(self.frames), "more_body": False})
            return
        for index, frame in enumerate(self.frames):
            if index == self.pacing.drop_after:
                return  # without the final body message uvicorn closes the connection mid-body
            await asyncio.sleep(self.pacing.pause_before(index))
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class ResetConnection(Response):
    """Answers nothing: cuts the request's TCP connection with a reset, as a crashed server would."""

    def __init__(self, state: UpstreamState) -> None:
        self.state, self.background = state, None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        transport = self.state.transport_of(scope.get("client"))
        # Linger 0: closing sends RST rather than FIN, so the client sees a reset, not a clean close.
        transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
        )
        transport.abort()
        # Returning before uvicorn notices the disconnect would make it answer 500 instead.
        while (await receive())["type"] != "http.disconnect":
            pass


def error_response(script: Json) -> JSONResponse:
    status = int(script["status"])
    default = {"message": f"scripted upstream error {status}", "param": None, "code": None}
    error = {**default, "type": ERROR_TYPES.get(status, "server_error"), **script.get("error", {})}
    return JSONResponse({"error": error}, status_code=status, headers=script.get("headers"))


async def answer(request: Request, script: Json, body: Json, frames: list[bytes], final: Json) -> Response:
    """The HTTP answer a script calls for: an error, a paced stream, or one JSON body."""
    state = upstream_state(request)
    pacing = Pacing.of(script)
    is_stream = bool(body.get("stream"))
    if script.get("reset"):
        return ResetConnection(state)
    if "status" in script:
        return error_response(script)
    if (
        "context_words" in script
        and count_words(conversation(body.get("messages") or body.get("input"))) > script["context_words"]
    ):
        return context_overflow(script, body)
    if is_stream or pacing.is_hang:
        media_type = "text/event-stream" if is_stream else "application/json"
        return PacedStream(frames, pacing, state, media_type)
    with state.open_stream():
        await asyncio.sleep(pacing.first_delay + pacing.delay * len(frames))
    return JSONResponse(final)


def context_overflow(script: Json, body: Json) -> JSONResponse:
    """vLLM's 400 for an input longer than the model's context (here: `context_words` words)."""
    asked = count_words(conversation(body.get("messages") or body.get("input")))
    message = (
        f"This model's maximum context length is {script['context_words']} tokens. However, you requested "
        f"{asked} tokens in the messages. Please reduce the length of the messages."
    )
    error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
    return JSONResponse({"object": "error", **error}, status_code=400)


def upstream_state(request: Request) -> UpstreamState:
    return cast(UpstreamState, request.app.state.upstream)


class RefusedBodyError(Exception):
    """A request body a strict server would not read: `answer` is what it says instead."""

    def __init__(self, answer: Response) -> None:
        self.answer = answer


async def read_script_and_body(
    request: Request, required: dict[str, type | tuple[type, ...]], *, counted: bool = True
) -> tuple[Json, Json]:
    """Record the request and pick the script its model follows; `RefusedBodyError` if the body is not
    JSON as the real servers require it (the content type, and the `required` keys in their types)."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        error = {"message": f"Unsupported content type {media_type or '(none)'!r}: send application/json."}
        raise RefusedBodyError(JSONResponse({"error": {**error, "type": "invalid_request_error"}}, 415))
    try:
        body = json.loads(await request.body())
    except ValueError:
        body = None
    problems = body_problems(body, required)
    if problems:
        raise RefusedBodyError(JSONResponse({"detail": problems}, 422))
    assert isinstance(body, dict)
    state = upstream_state(request)
    state.record(request, body)
    return state.next_script(str(body.get("model", DEFAULT_MODEL)), counted=counted), body


def body_problems(body: object, required: dict[str, type | tuple[type, ...]]) -> list[Json]:
    """FastAPI-style validation errors of a body that must be an object with `required` keys."""
    if not isinstance(body, dict):
        return [{"type": "model_attributes_type", "loc": ["body"], "msg": "Input should be a valid object"}]
    problems = []
    for key, kinds in required.items():
        if key not in body:
            problems.append({"type": "missing", "loc": ["body", key], "msg": "Field required"})
        elif not isinstance(body[key], kinds):
            problems.append({"type": "type_error", "loc": ["body", key], "msg": "Input has the wrong type"})
    return problems


def refusing_bad_bodies(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    async def handle(request: Request) -> Response:
        try:
            return await handler(request)
        except RefusedBodyError as refused:
            return refused.answer

    return handle


@refusing_bad_bodies
async def chat_completions(request: Request) -> Response:
    script, body = await read_script_and_body(request, {"model": str, "messages": list})
    envelope = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion.chunk",
        "created": int(time.time()), "model": body.get("model", DEFAULT_MODEL),
    }  # fmt: skip
    is_usage_wanted = bool((body.get("stream_options") or {}).get("include_usage"))
    streamed = chat_chunks(script, body, envelope, is_usage_wanted=is_usage_wanted)
    frames = [b"data: " + encode(chunk) + b"\n\n" for chunk in streamed]
    final = assemble_completion(chat_chunks(script, body, envelope, is_usage_wanted=True), envelope)
    ending = [DONE_FRAME] if script.get("done", True) else []
    return await answer(request, script, body, [*frames, *ending], final)


@refusing_bad_bodies
async def responses(request: Request) -> Response:
    script, body = await read_script_and_body(request, {"model": str, "input": (str, list)})
    events = response_events(script, body)
    frames = [f"event: {event.get('type')}\ndata: ".encode() + encode(event) + b"\n\n" for event in events]
    return await answer(request, script, body, frames, events[-1].get("response", {}) if events else {})


@refusing_bad_bodies
async def compact(request: Request) -> Response:
    """OpenAI's `/responses/compact`: the input's user messages, then one `compaction` item whose
    content is this server's own (`upstream-compaction:<n>`, n the items it stands for); a model
    scripted `compact: false` answers 404, as a server without the route (vLLM's) does."""
    script, body = await read_script_and_body(request, {"model": str, "input": (str, list)})
    if script.get("compact") is False:
        return JSONResponse({"detail": "Not Found"}, 404)
    given = body["input"] if isinstance(body["input"], list) else [{"role": "user", "content": body["input"]}]
    users = [item for item in given if item.get("role") == "user"]
    content = f"upstream-compaction:{len(given) - len(users)}"
    item = {"id": f"cmp_{uuid.uuid4().hex}", "type": "compaction", "encrypted_content": content}
    read = count_words(conversation(given))
    usage = {"input_tokens": read, "output_tokens": 7, "total_tokens": read + 7}
    compacted = {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response.compaction",
        "created_at": int(time.time()),
    }
    return JSONResponse({**compacted, "output": [*users, item], "usage": usage})


@refusing_bad_bodies
async def tokenize(request: Request) -> Response:
    """vLLM's `/tokenize` (beside `/v1`): `{model, messages}` or `{model, prompt}` => `{count,
    max_model_len, tokens}`, a token per word of the messages' text and one per message (its role);
    a model scripted `tokenize: false` answers 404, as a server without the route does."""
    if "content" in (await _peek(request)):  # llama-server's form
        return await llama_tokenize(request)
    script, body = await read_script_and_body(request, {"model": str}, counted=False)
    if script.get("tokenize") is False:
        return JSONResponse({"detail": "Not Found"}, 404)
    if script.get("tokenize") == "llama.cpp":  # llama-server's /tokenize reads `content` only
        return JSONResponse(
            {"error": {"code": 500, "message": '"content" must be provided', "type": "server_error"}}, 500
        )
    messages = body.get("messages")
    if isinstance(messages, list):
        count = count_words(conversation(messages)) + len(messages)
    else:
        count = len(str(body.get("prompt") or "").split())
    return JSONResponse(
        {"count": count, "max_model_len": 4096, "tokens": list(range(count)), "token_strs": None}
    )


async def _peek(request: Request) -> Json:
    try:
        body = json.loads(await request.body())
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


async def llama_tokenize(request: Request) -> Response:
    """llama-server's `/tokenize`: `{content}` => `{tokens}`, a token per word of the text."""
    body = await _peek(request)
    upstream_state(request).record(request, body)
    return JSONResponse({"tokens": list(range(len(str(body.get("content") or "").split())))})


@refusing_bad_bodies
async def apply_template(request: Request) -> Response:
    """llama-server's `/apply-template`: `{messages}` => `{prompt}`, here ChatML."""
    script, body = await read_script_and_body(request, {"messages": list}, counted=False)
    if script.get("tokenize") is False:
        return JSONResponse({"detail": "Not Found"}, 404)
    prompt = "".join(f"<|im_start|>{m.get('role')}\n{m.get('content')}<|im_end|>\n" for m in body["messages"])
    return JSONResponse({"prompt": prompt + "<|im_start|>assistant\n"})


async def list_models(request: Request) -> Response:
    names = sorted({*upstream_state(request).scripts, DEFAULT_MODEL})
    models = [{"id": name, "object": "model", "created": 0, "owned_by": "scripted"} for name in names]
    return JSONResponse({"object": "list", "data": models})


async def register_script(request: Request) -> Response:
    given = await request.json()
    if not isinstance(given.get("model"), str) or not isinstance(given.get("script"), dict):
        return JSONResponse({"error": {"message": "expected {model: str, script: object}"}}, 400)
    state = upstream_state(request)
    state.scripts[given["model"]] = given["script"]
    state.attempts.pop(given["model"], None)
    return JSONResponse({"ok": True})


async def recorded_requests(request: Request) -> Response:
    model = request.query_params.get("model")
    records = upstream_state(request).records
    return JSONResponse([record for record in records if model is None or record.get("model") == model])


async def reset(request: Request) -> Response:
    upstream_state(request).reset()
    return JSONResponse({"ok": True})


async def stats(request: Request) -> Response:
    state = upstream_state(request)
    if "until_active" in request.query_params:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(float(request.query_params.get("timeout", 10))):
                await state.wait_for_active(int(request.query_params["until_active"]))
    return JSONResponse({"active": state.active, "max_active": state.max_active, "total": state.total})


def create_app(state: UpstreamState) -> Starlette:
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/responses/compact", compact, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/apply-template", apply_template, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/_script", register_script, methods=["POST"]),
            Route("/_requests", recorded_requests, methods=["GET"]),
            Route("/_reset", reset, methods=["POST"]),
            Route("/_stats", stats, methods=["GET"]),
        ]
    )
    app.state.upstream = state
    return app


class UpstreamServer(uvicorn.Server):
    """A uvicorn server that cuts open streams when told to stop, since hung ones never finish."""

    def __init__(self, config: uvicorn.Config, state: UpstreamState) -> None:
        super().__init__(config)
        self.state = state
        state.connections = self.server_state.connections

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.closing.set()
        await super().shutdown(sockets)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Scripted upstream LLM server for tests.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    # Served over TLS with this certificate and key (PEM files) when given: an https:// upstream.
    parser.add_argument("--certfile")
    parser.add_argument("--keyfile")
    args = parser.parse_args(argv)
    sock = listening_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    logging.getLogger("uvicorn.error").addFilter(lambda record: record.getMessage() != DROP_LOG_MESSAGE)
    print(f"LISTENING {'https' if args.certfile else 'http'}://{host}:{port}", flush=True)
    state = UpstreamState()
    # The graceful timeout only bounds non-streamed answers still sleeping through their delays.
    config = uvicorn.Config(
        create_app(state),
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=1,
        ssl_certfile=args.certfile,
        ssl_keyfile=args.keyfile,
    )
    with contextlib.suppress(KeyboardInterrupt):
        UpstreamServer(config, state).run(sockets=[sock])


if __name__ == "__main__":
    main()
