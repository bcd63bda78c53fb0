"""Checks of every answer respool gives the integration tests' clients, made at the transport seam.

Owns `ValidatingTransport` and `AsyncValidatingTransport`: httpx transports around the real ones
that hand every answer on unchanged, chunk by chunk as it arrives, while checking it on the way:
- a JSON Response object (create without stream, retrieve, cancel) against the Open Responses
  schema (tests/support/schema.py) and the `openai` SDK's `Response` model;
- an SSE answer's framing (PROTOCOL.md §5.3), each event against the schema and the SDK's
  `ResponseStreamEvent` union, and its sequence numbers (each one more than the one before);
- an input_items page: every item has an `id` (PROTOCOL.md §5.1).

A problem never raises into the client, which must see what respool sent: it is recorded in
`FAILURES` (or the list the transport was given) and tests/conftest.py fails the test that saw it.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, get_args

import httpx
import jsonschema
import pydantic
from jsonschema.exceptions import best_match
from openai.types.responses import Response, ResponseError, ResponseStreamEvent

from tests.support.schema import validate_event, validate_response

FAILURES: list[str] = []

_EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
# Event `type` => the name of the SDK class that has it, to pick that class's errors out of the
# union's (which lists every one of the 59 classes).
_EVENT_CLASSES = {
    get_args(cls.model_fields["type"].annotation)[0]: cls.__name__
    for cls in get_args(get_args(ResponseStreamEvent)[0])
}
_LINE_END = re.compile(r"\r\n|\r|\n")  # PROTOCOL.md §5.3: lines end at CR, LF or CRLF
_MESSAGE_LIMIT = 600


class _Answer(Protocol):
    def feed(self, chunk: bytes) -> None: ...

    def finish(self) -> None: ...


class ValidatingTransport(httpx.BaseTransport):
    """`httpx.HTTPTransport` (or `inner`) whose answers are checked as they pass through."""

    def __init__(self, inner: httpx.BaseTransport | None = None, failures: list[str] | None = None) -> None:
        self.inner = inner if inner is not None else httpx.HTTPTransport()
        self.failures = FAILURES if failures is None else failures

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        answer = _answer_for(request, response, self.failures)
        if answer is None:
            return response
        assert isinstance(response.stream, httpx.SyncByteStream)
        return _rewrap(response, _CheckedStream(response.stream, answer))

    def close(self) -> None:
        self.inner.close()


class AsyncValidatingTransport(httpx.AsyncBaseTransport):
    """`httpx.AsyncHTTPTransport` (or `inner`) whose answers are checked as they pass through."""

    def __init__(
        self, inner: httpx.AsyncBaseTransport | None = None, failures: list[str] | None = None
    ) -> None:
        self.inner = inner if inner is not None else httpx.AsyncHTTPTransport()
        self.failures = FAILURES if failures is None else failures

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        answer = _answer_for(request, response, self.failures)
        if answer is None:
            return response
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return _rewrap(response, _AsyncCheckedStream(response.stream, answer))

    async def aclose(self) -> None:
        await self.inner.aclose()


def _rewrap(response: httpx.Response, stream: httpx.SyncByteStream | httpx.AsyncByteStream) -> httpx.Response:
    return httpx.Response(
        response.status_code, headers=response.headers, stream=stream, extensions=response.extensions
    )


class _CheckedStream(httpx.SyncByteStream):
    """Each chunk is checked, then handed on at once; the end is checked only if the client reads to it."""

    def __init__(self, inner: httpx.SyncByteStream, answer: _Answer) -> None:
        self.inner, self.answer = inner, answer

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.inner:
            self.answer.feed(chunk)
            yield chunk
        self.answer.finish()

    def close(self) -> None:
        self.inner.close()


class _AsyncCheckedStream(httpx.AsyncByteStream):
    """The async `_CheckedStream`."""

    def __init__(self, inner: httpx.AsyncByteStream, answer: _Answer) -> None:
        self.inner, self.answer = inner, answer

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.inner:
            self.answer.feed(chunk)
            yield chunk
        self.answer.finish()

    async def aclose(self) -> None:
        await self.inner.aclose()


def _answer_for(request: httpx.Request, response: httpx.Response, failures: list[str]) -> _Answer | None:
    """The checker for this answer, or None when it is not one of the kinds checked."""
    where = f"{request.method} {request.url.raw_path.decode()} -> {response.status_code}"
    content_type = response.headers.get("content-type", "")
    if response.headers.get("content-encoding", "identity") != "identity":
        # The transport sees the body before httpx decodes it; say so rather than skip it silently.
        failures.append(f"{where}: compressed body, which the validating transport cannot check")
        return None
    if content_type.startswith("text/event-stream"):
        return _SseAnswer(where, failures)
    if response.is_success and content_type.split(";")[0].endswith("json"):
        return _JsonAnswer(where, failures, is_item_page=request.url.path.endswith("/input_items"))
    return None


@dataclass
class _JsonAnswer:
    """A JSON body, checked once whole: a Response object, or an input_items page."""

    where: str
    failures: list[str]
    is_item_page: bool
    body: bytearray = field(default_factory=bytearray)

    def feed(self, chunk: bytes) -> None:
        self.body += chunk

    def finish(self) -> None:
        try:
            document = json.loads(self.body)
        except ValueError as error:
            self.failures.append(f"{self.where}: the JSON body does not parse: {error}")
            return
        if not isinstance(document, dict):
            return
        if document.get("object") == "response" and "deleted" not in document:
            self.failures.extend(f"{self.where}: {problem}" for problem in _response_problems(document))
        elif self.is_item_page and document.get("object") == "list":
            self.failures.extend(f"{self.where}: {problem}" for problem in _item_page_problems(document))


def _response_problems(response: dict[str, Any]) -> list[str]:
    problems = []
    try:
        validate_response(response)
    except jsonschema.ValidationError as error:
        problems.append(f"Response {response.get('id')}: schema: {_schema_message(error)}")
    try:
        Response.model_validate(_as_the_sdk_reads(response), strict=True)
    except pydantic.ValidationError as error:
        problems.append(f"Response {response.get('id')}: SDK: {_clip(str(error))}")
    return problems


# `ResponseError.code` is a Literal of OpenAI's own failure codes, none of which says "the upstream
# has no such model" or "the upstream refused our key". The SDK builds Responses without validating
# them (PROTOCOL.md §1.1), so any string code reaches its users as sent; strict validation is told so.
_SDK_ERROR_CODES = frozenset(get_args(ResponseError.model_fields["code"].annotation))
_OWN_ERROR_CODES = frozenset({"model_not_found", "upstream_unauthorized", "upstream_forbidden"})


def _as_the_sdk_reads(response: Any) -> Any:
    """`response` with respool's own failure codes (any string, to the SDK) in one the strict check knows."""
    error = response.get("error") if isinstance(response, dict) else None
    if isinstance(error, dict) and error.get("code") in _OWN_ERROR_CODES - _SDK_ERROR_CODES:
        return {**response, "error": {**error, "code": "server_error"}}
    return response


def _item_page_problems(page: dict[str, Any]) -> list[str]:
    # PROTOCOL.md §5.1: the SDK pages with `after=<data[-1].id>`, so every item needs an id.
    items = page.get("data") or []
    return [
        f"input item {n} has no id: {_clip(repr(item))}"
        for n, item in enumerate(items)
        if not (isinstance(item, dict) and item.get("id"))
    ]


@dataclass
class _SseAnswer:
    """An SSE body, decoded line by line as it arrives (PROTOCOL.md §5.3), each frame checked once it ends."""

    where: str
    failures: list[str]
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")()
    )
    pending: str = ""  # the text of a line not yet ended
    event_name: str | None = None
    data: list[str] | None = None
    frame_number: int = 0
    last_sequence_number: int | None = None

    def feed(self, chunk: bytes) -> None:
        try:
            text = self.pending + self.decoder.decode(chunk)
        except UnicodeDecodeError as error:
            self._fail(f"not UTF-8: {error}")
            return
        # A CR at the end may be the first half of a CRLF: keep it for the next chunk.
        held = "\r" if text.endswith("\r") else ""
        *lines, self.pending = _LINE_END.split(text.removesuffix("\r") if held else text)
        self.pending += held
        for line in lines:
            self._on_line(line)

    def finish(self) -> None:
        if self.pending.endswith("\r"):  # no LF came after it: it was a CR line end
            self._on_line(self.pending.removesuffix("\r"))
            self.pending = ""
        if self.pending or self.event_name is not None or self.data is not None:
            self._fail(f"the stream ends inside a frame, which the client drops: {self.pending!r}")

    def _on_line(self, line: str) -> None:
        if not line:
            self._dispatch()
            return
        if line.startswith(":"):
            return  # a comment, e.g. the `: keepalive` heartbeat
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "id":
            # PROTOCOL.md §5.3: an id is sticky in the SDK's decoder, and makes every later blank
            # line an empty event that fails to parse.
            self._fail(f"an `id:` line: {line!r}")
        elif name == "event":
            self.event_name = value
        elif name == "data":
            self.data = [*(self.data or []), value]

    def _dispatch(self) -> None:
        event_name, data = self.event_name, self.data
        self.event_name, self.data = None, None
        if data is None:
            if event_name is not None:
                # PROTOCOL.md §5.3: the SDK runs json.loads("") on such a frame and raises.
                self._fail(f"a frame with `event: {event_name}` and no `data:`")
            return
        self.frame_number += 1
        text = "\n".join(data)
        if text.startswith("[DONE]"):
            return
        try:
            event = json.loads(text)
        except ValueError as error:
            self._fail(f"frame {self.frame_number}: data is not JSON ({error}): {_clip(text)}")
            return
        if not isinstance(event, dict):
            self._fail(f"frame {self.frame_number}: data is not a JSON object: {_clip(text)}")
            return
        self._check_event(event, event_name)

    def _check_event(self, event: dict[str, Any], event_name: str | None) -> None:
        label = f"event {event.get('sequence_number')} ({event.get('type')})"
        if event_name is not None and event_name != event.get("type"):
            self._fail(f"{label}: its `event:` line names {event_name!r}")
        for problem in _event_problems(event):
            self._fail(f"{label}: {problem}")
        number = event.get("sequence_number")
        # api/sse.py: an `error` that ends an interrupted stream repeats the last number (the cursor).
        is_repeat = event.get("type") == "error" and number == self.last_sequence_number
        if (
            self.last_sequence_number is not None
            and number != self.last_sequence_number + 1
            and not is_repeat
        ):
            self._fail(f"{label}: sequence_number {number} follows {self.last_sequence_number}")
        if isinstance(number, int):
            self.last_sequence_number = number

    def _fail(self, problem: str) -> None:
        self.failures.append(f"{self.where}: {problem}")


def _event_problems(event: dict[str, Any]) -> list[str]:
    problems = []
    try:
        validate_event(event)
    except jsonschema.ValidationError as error:
        problems.append(f"schema: {_schema_message(error)}")
    except ValueError as error:
        problems.append(f"schema: {error}")
    try:
        checked = (
            {**event, "response": _as_the_sdk_reads(event["response"])} if "response" in event else event
        )
        parsed = _EVENTS.validate_python(checked, strict=True)
    except pydantic.ValidationError as error:
        problems.append(f"SDK: {_sdk_event_message(event, error)}")
    else:
        # The SDK picks the class by `type` without validating; a type no class has would be
        # parsed as some other class, so the class found must have the event's own type.
        if parsed.type != event.get("type"):
            problems.append(f"SDK: parsed as {type(parsed).__name__} of type {parsed.type!r}")
    return problems


def _sdk_event_message(event: dict[str, Any], error: pydantic.ValidationError) -> str:
    """The errors of the SDK class for the event's `type` only (the union reports all 59 classes)."""
    name = _EVENT_CLASSES.get(event.get("type"))
    if name is None:
        return f"no event class of the SDK has type {event.get('type')!r}"
    lines = [
        f"{'.'.join(str(part) for part in item['loc'][1:])}: {item['msg']} (got {item.get('input')!r})"
        for item in error.errors()
        if item["loc"] and item["loc"][0] == name
    ]
    return _clip(f"{name}: " + "; ".join(lines))


def _schema_message(error: jsonschema.ValidationError) -> str:
    """Where and why; for a value no branch of a oneOf/anyOf accepts, the likeliest branch's reason."""
    deepest = error
    while deepest.context:
        deepest = best_match(deepest.context)
    if deepest is error:
        return _clip(f"at {error.json_path}: {error.message}")
    return _clip(f"at {deepest.json_path}: {deepest.message} (in the likeliest of its schema's branches)")


def _clip(text: str) -> str:
    return text if len(text) <= _MESSAGE_LIMIT else text[:_MESSAGE_LIMIT] + " …"
