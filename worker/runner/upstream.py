"""Talking to upstream model servers over HTTP: Chat Completions and Responses, always streamed.

Owns the upstream call: the pooled client and its timeouts, the retry policy, and the one mapping of
httpx's exceptions and of HTTP error answers into `UpstreamError` (the httpx habit of mapping
foreign exceptions once, at the boundary). The client is `httpx2`, the one the openai SDK itself
uses: httpx 0.28's pool searched its connections at a cost that grew with their number (measured:
150 short requests/s over 64 keep-alive connections on loopback, against 1,100 with httpx2). A
plain-HTTP URL (a model server beside the worker) goes on worker/runner/http1.py's transport, an
asyncio protocol over llhttp (httptools) with a keep-alive pool: a short call's CPU 440 → 150 µs
against aiohttp's. Any other (TLS, a proxy's) goes on aiohttp's (`httpx-aiohttp`, as the SDK's own
`DefaultAioHttpClient`): its connections, TLS, proxies and parsing (llhttp too). httpx2's own
transport parses HTTP in Python, h11: reading 30 streams of tokens 20 ms apart cost 59 µs of CPU a
token through it, 22 through aiohttp's.
Its errors (`UpstreamError`, `TransientUpstreamError`) are drawn in worker/errors.py.

Rules:
- every request is JSON with `content-type: application/json` (FastAPI-based servers, such as
  llama-cpp-python's, read no body as JSON without it) and asks for `text/event-stream`
- a connection error, a timeout (a stall included), HTTP 408, 429 or 5xx => `TransientUpstreamError`
- a TLS certificate the worker cannot verify => `UpstreamError`, naming SSL_CERT_FILE / SSL_CERT_DIR
- a stream that ends (at EOF, or at `data: [DONE]`) without the payload that properly ends its kind
  of stream (`StreamKind`: a chat `finish_reason`, a Responses terminal event) => `TransientUpstreamError`:
  llama-cpp-python answers 200 with an empty stream when it fails inside
- any other HTTP 4xx, a line that is not a JSON object, an in-band `error` payload => `UpstreamError`;
  its `code` says what a client can tell from it: `model_not_found` (404), `upstream_unauthorized`
  (401), `upstream_forbidden` (403), else `server_error`
- transient before the first payload that carries output (a chat chunk with text, a tool call or a
  `finish_reason`; a Responses event past the lifecycle ones) => retried under the `RetryPolicy`: the
  upstream's `retry-after-ms` / `retry-after` if it sent one, else exponential backoff with equal
  jitter; both bounded by the cap. Payloads before it (a chat role chunk) are held back meanwhile:
  nothing reached a client yet. A stall before any output is retried too.
- anything after that payload => raised at once: that output already reached clients
- retries run out => the last cause, saying how many attempts were made
- the upstream key, quoted back in an error (by the upstream, or a proxy before it) => `[redacted]`
  in the message, so it reaches no row, event, log or client
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import re
from asyncio import sleep
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from functools import lru_cache, partial
from typing import Any

import aiohttp
import httpx2
import orjson
from httpx_aiohttp.httpx2 import Httpx2AiohttpClient
from httpx_aiohttp.httpx2.transport import AiohttpResponseStream, map_aiohttp_exceptions

from worker.errors import TransientUpstreamError, UpstreamError
from worker.routing import Route
from worker.runner import http1
from worker.settings import Settings

log = logging.getLogger("respool.upstream")

type Payload = dict[str, Any]

CONNECT_SECONDS = 10.0
# httpx faults that say nothing about the request itself: another attempt may well succeed.
# (LocalProtocolError, UnsupportedProtocol, ProxyError, DecodingError, TooManyRedirects, SSEError:
# it won't.)
_TRANSIENT_FAULTS = (httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError)


@dataclass(frozen=True)
class RetryPolicy:
    """How often, and how far apart, a request that failed before any output is tried again."""

    retries: int = 3
    backoff_seconds: float = 0.5
    backoff_max_seconds: float = 8.0

    @classmethod
    def from_settings(cls, settings: Settings) -> RetryPolicy:
        return cls(
            retries=settings.upstream_retries,
            backoff_seconds=settings.upstream_backoff_seconds,
            backoff_max_seconds=settings.upstream_backoff_max_seconds,
        )

    @property
    def attempts(self) -> int:
        return self.retries + 1

    def delay(self, retry: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number `retry` (from 1), never over `backoff_max_seconds`.

        The upstream's own hint wins; otherwise the exponential step with equal jitter (half fixed,
        half random), so retries that failed together do not all come back together.
        """
        if retry_after is not None:
            return min(retry_after, self.backoff_max_seconds)
        step = min(self.backoff_max_seconds, self.backoff_seconds * 2.0 ** min(retry - 1, 64))
        return step / 2 + random.uniform(0, step / 2)


DEFAULT_RETRY = RetryPolicy()


@dataclass(frozen=True)
class StreamKind:
    """What the payloads of one kind of upstream stream say: which ones carry output (after one of
    them, a fault can no longer be retried), and which one ends the stream properly."""

    carries_output: Callable[[Payload], bool]
    ends: Callable[[Payload], bool]
    end_name: str  # the ending payload, as a message names it when it never came


def _chat_carries_output(chunk: Payload) -> bool:
    return any(_chat_choice_says(choice) for choice in chunk.get("choices") or [])


def _chat_choice_says(choice: Payload) -> bool:
    delta = choice.get("delta") or {}
    return bool(
        choice.get("finish_reason")
        or delta.get("content")
        or delta.get("refusal")
        or delta.get("reasoning_content")
        or delta.get("reasoning")
        or delta.get("tool_calls")
    )


def _chat_ends(chunk: Payload) -> bool:
    # A loop: `any` of a generator cost twice as much a token.
    for choice in chunk.get("choices") or ():  # noqa: SIM110
        if choice.get("finish_reason"):
            return True
    return False


_RESPONSES_LIFECYCLE = frozenset({"response.created", "response.queued", "response.in_progress", "keepalive"})
_RESPONSES_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})

# Chat Completions: a choice's `finish_reason` ends the stream; usage may follow it.
CHAT_STREAM = StreamKind(_chat_carries_output, _chat_ends, "a finish_reason")
# Responses: a terminal event ends it.
RESPONSES_STREAM = StreamKind(
    lambda event: event.get("type") not in _RESPONSES_LIFECYCLE,
    lambda event: event.get("type") in _RESPONSES_ENDS,
    "a terminal event (response.completed, .incomplete or .failed)",
)
# Any JSON stream: every payload is output, and any payload at all ends it properly.
ANY_STREAM = StreamKind(lambda _payload: True, lambda _payload: True, "any payload")


def create_client(
    stall_seconds: float,
    max_connections: int,
    *,
    connect_seconds: float = CONNECT_SECONDS,
    transport: httpx2.AsyncBaseTransport | None = None,
    plain_http: bool = True,
) -> httpx2.AsyncClient:
    """One pooled client per worker process: plain-HTTP URLs on worker/runner/http1.py's transport,
    the rest on aiohttp's (the module docstring); without `plain_http`, every URL on aiohttp's.

    `stall_seconds` is httpx's read timeout: the longest silence allowed between bytes, so a stalled
    upstream frees its slot instead of holding it forever. `transport` is the seam tests fake.
    """
    limits = httpx2.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    timeout = httpx2.Timeout(stall_seconds, connect=connect_seconds)
    if transport is not None:
        return httpx2.AsyncClient(timeout=timeout, limits=limits, transport=transport)
    if not plain_http:
        return Httpx2AiohttpClient(timeout=timeout, limits=limits)
    return _UpstreamClient(timeout=timeout, limits=limits)


class _UpstreamClient(Httpx2AiohttpClient):
    """aiohttp's transports, with plain-HTTP URLs that no proxy takes on this module's own
    (worker/runner/http1.py): the calls to a model server beside the worker."""

    def _init_transport(self, *args: Any, **kwargs: Any) -> httpx2.AsyncBaseTransport:
        limits: httpx2.Limits = kwargs.get("limits") or httpx2.Limits()
        fallback = super()._init_transport(*args, **kwargs)
        return http1.Http1Transport(fallback, limits.max_connections or 100)


# What an upstream call hands on at once: the payloads of one read of its body (most often one), and
# whether the stream's end came with them (its ending payload, or `data: [DONE]`).
type Consume = Callable[[list[Payload], bool], object]
# An upstream call that hands the payloads it brings to the consumer it is given (`stream_into`).
type Call = Callable[[Consume], Awaitable[None]]


async def stream_into(
    client: httpx2.AsyncClient,
    route: Route,
    path: str,
    body: dict[str, Any],
    policy: RetryPolicy,
    kind: StreamKind,
    consume: Consume,
) -> None:
    """POST `body` to `route.base_url + path` and hand each SSE `data:` payload, as JSON, to `consume`,
    as it comes: on this module's own transport (worker/runner/http1.py), from the connection's own
    callback, so no task wakes up for a payload (a token): reading 30 streams of tokens 20 ms apart
    cost 81 µs of CPU a token through a generator of payloads, 52 so. The payloads of one
    read go together, in one call of `consume`: an answer that comes at once is one append.

    Transient faults before the first payload that carries output are retried under `policy` (the
    payloads before it are held back meanwhile); after it, every fault is final. A stream that ends
    without its `kind`'s ending is a transient fault. Raises `UpstreamError` for the upstream's
    faults, and what `consume` raised as it raised it (the call is closed first, and not retried);
    cancellation always propagates at once.
    """
    request = _outgoing(client, route, path, body)
    attempt = 1
    while True:
        reading = _Reading(kind, consume)
        try:
            await _attempt(client, request, reading)
        except TransientUpstreamError as exc:
            if reading.has_output or policy.retries == 0:
                raise  # after output, or with no retries: the cause as it came
            if attempt >= policy.attempts:
                raise exc.gave_up(attempt) from exc
            delay = policy.delay(attempt, exc.retry_after)
            log.info("%s: attempt %d failed (%s); retrying in %.2f s", request.url, attempt, exc, delay)
            await sleep(delay)
            attempt += 1
            continue
        if reading.consumer_error is not None:
            raise reading.consumer_error
        reading.release()
        return


async def stream_json(
    client: httpx2.AsyncClient,
    route: Route,
    path: str,
    body: dict[str, Any],
    policy: RetryPolicy = DEFAULT_RETRY,
    kind: StreamKind = ANY_STREAM,
) -> AsyncGenerator[Payload]:
    """`stream_into`'s payloads as a generator, for a caller that reads a stream as a loop (a
    compaction's summary): the call runs in a task of its own meanwhile, and is cancelled if the
    generator is closed before its end. Raises what `stream_into` raises, after the payloads before it."""
    came: deque[Payload] = deque()
    more = asyncio.Event()

    def consume(payloads: list[Payload], ends: bool) -> None:
        came.extend(payloads)
        more.set()

    call = asyncio.ensure_future(stream_into(client, route, path, body, policy, kind, consume))
    call.add_done_callback(lambda _: more.set())
    try:
        while True:
            while came:
                yield came.popleft()
            if call.done():
                call.result()  # what it raised
                return
            more.clear()
            await more.wait()
    finally:
        if not call.done():
            call.cancel()
            await asyncio.wait({call})
        if not call.cancelled():
            call.exception()  # told (or the caller's own exit stands): never "not retrieved"


async def consume_all(payloads: AsyncGenerator[Payload], consume: Consume) -> None:
    """Hand each of `payloads` to `consume` (a `Call` over a generator: the synthetic model's)."""
    async with aclosing(payloads):
        async for payload in payloads:
            consume([payload], False)


async def post_json(
    client: httpx2.AsyncClient,
    route: Route,
    path: str,
    body: dict[str, Any],
    policy: RetryPolicy = DEFAULT_RETRY,
) -> Payload:
    """POST `body` to `route.base_url + path` and answer its JSON object (not streamed), transient
    faults retried under `policy`. Raises `UpstreamError` only."""
    request = _build_request(client, route, path, body, accept="application/json")
    attempt = 1
    while True:
        try:
            try:
                reply = await client.send(request)
                if reply.status_code >= 400:
                    raise await _status_error(reply)
                return _object(reply.text)
            except httpx2.HTTPError as exc:
                raise _map_httpx_error(exc, request.url, client.timeout) from exc
        except TransientUpstreamError as exc:
            exc.redact(_sent_key(request))
            if attempt >= policy.attempts:
                raise exc.gave_up(attempt) from exc
            await sleep(policy.delay(attempt, exc.retry_after))
            attempt += 1
        except UpstreamError as exc:
            raise exc.redact(_sent_key(request)) from exc


def _build_request(
    client: httpx2.AsyncClient,
    route: Route,
    path: str,
    body: dict[str, Any],
    accept: str = "text/event-stream",
) -> httpx2.Request:
    headers = {"accept": accept, "content-type": "application/json"}
    key = route.api_key()
    if key:
        headers["authorization"] = f"Bearer {key}"
    # Bytes content, so the same request can be sent again on a retry. Built as a request of its own,
    # not by the client (which merges in its headers, cookies and parameters: none an upstream call
    # has); the client's timeouts go with it.
    timeout = {"timeout": client.timeout.as_dict()}
    url = _url(route.base_url + path)
    return httpx2.Request("POST", url, content=orjson.dumps(body), headers=headers, extensions=timeout)


@dataclass(frozen=True, slots=True)
class _Plain:
    """A streamed upstream call on this module's own transport (a plain-HTTP URL no proxy takes),
    serialized once, as httpx would send it: no httpx request or response is made around it (their
    making cost ~40 µs of CPU a call, measured alone: a fiftieth of a short response's worker)."""

    transport: http1.Http1Transport
    key: tuple[str, int]  # host, port
    url: httpx2.URL
    request_bytes: bytes
    timeouts: dict[str, float | None]
    sent_key: str  # the key it carries ("": none), what an upstream could quote back


def _outgoing(
    client: httpx2.AsyncClient, route: Route, path: str, body: dict[str, Any]
) -> httpx2.Request | _Plain:
    """A streamed call to `route.base_url + path`: as bytes for the client's own transport where it
    takes the URL, else as httpx's request (another transport's: TLS, a proxy, a test's)."""
    url = _url(route.base_url + path)
    transport = client._transport_for_url(url)
    if url.scheme != "http" or not isinstance(transport, http1.Http1Transport):
        return _build_request(client, route, path, body)
    content = orjson.dumps(body)
    key = route.api_key() or ""
    head = [b"POST %s HTTP/1.1" % url.raw_path, b"Host: " + url.netloc]
    head += (b"accept: text/event-stream", b"content-type: application/json")
    if key:
        head.append(b"authorization: Bearer " + key.encode("ascii"))
    head.append(b"Content-Length: %d" % len(content))
    # The stall is bounded by `_attempt` itself, not by the transport's read timeout (`_Silence`).
    timeouts = {**client.timeout.as_dict(), "read": None}
    request_bytes = b"\r\n".join(head) + b"\r\n\r\n" + content
    return _Plain(transport, (url.host, url.port or 80), url, request_bytes, timeouts, key)


@lru_cache(maxsize=256)
def _url(text: str) -> httpx2.URL:
    """An upstream URL, parsed once: a request built from the text parsed it each time, half of the
    request's 24 µs."""
    return httpx2.URL(text)


async def _send(client: httpx2.AsyncClient, request: httpx2.Request) -> httpx2.Response:
    """A streamed upstream call sent on the client's transport itself (the one it mounted for the
    URL: a proxy's, where the environment names one). The client's own send wraps it in what no
    upstream call uses (auth flows, redirects, cookies, event hooks, a log line), which cost a third
    of a short stream's CPU in the worker and 0.35 ms of its first token."""
    transport = client._transport_for_url(request.url)
    reply = await transport.handle_async_request(request)
    reply.request = request
    return reply


async def _attempt(client: httpx2.AsyncClient, request: httpx2.Request | _Plain, reading: _Reading) -> None:
    """One POST, its payloads handed to `reading`, with every fault mapped to `UpstreamError`; it
    returns early, its call closed, once `reading`'s consumer raised (`consumer_error`).

    The stall bound (the client's read timeout) is kept here, not by the transport: aiohttp's
    per-read timer is cancelled and set again at every chunk, a tenth of the upstream read's CPU
    a token; one timer a stream, set again only when it fires, bounds the silence alike.
    """
    stall = client.timeout.read
    if stall is not None and isinstance(request, httpx2.Request):
        request.extensions["timeout"] = {**request.extensions.get("timeout", {}), "read": None}
    silence = reading.silence = _Silence(stall)
    reply: httpx2.Response | None = None
    try:
        async with asyncio.timeout(stall):  # its headers
            if isinstance(request, _Plain):
                stream: Any = await request.transport.open(
                    request.key, request.request_bytes, request.timeouts
                )
                status = stream.status
            else:
                reply = await _send(client, request)
                stream, status = reply.stream, reply.status_code
        try:
            if status >= 400:
                if reply is None:
                    reply = stream.as_response()
                raise await _status_error(reply)
            if isinstance(stream, http1.Body) and stream.is_identity:
                silence.arm()
                ended = await silence.within(stream.push(reading.feed))
            else:
                if reply is None:  # a compressed body: httpx's response decodes it
                    reply = stream.as_response()
                ended, next_chunk = False, silence.reader(reply)
                while (chunk := await next_chunk()) is not None:
                    if reading.feed(chunk):
                        break
                else:
                    ended = True
            if ended:
                reading.feed(b"\n")  # a last line unended
            if reading.consumer_error is not None:
                return
            if not reading.is_ended:
                raise _unfinished(reading.kind, reading.is_done)
            if reading.is_done and isinstance(stream, http1.Body):  # its last chunk may come after
                stream.read_to_its_end()
        finally:
            silence.stop()
            await (stream.aclose() if reply is None else reply.aclose())
    except httpx2.HTTPError as exc:
        raise _map_httpx_error(exc, request.url, client.timeout).redact(_sent_key(request)) from exc
    except UpstreamError as exc:
        exc.redact(_sent_key(request))
        raise
    except TimeoutError as exc:  # no headers in time, or a body silent that long
        raise TransientUpstreamError(f"the upstream sent nothing for {_seconds(stall)}") from exc


class _Reading:
    """One attempt's body, parsed as its chunks come (`feed`): the SSE `data:` payloads of each chunk
    are handed to `consume` together, those before the first that carries output held back until it
    comes (an attempt that fails before it is tried again, and they are dropped: nothing reached a
    client)."""

    def __init__(self, kind: StreamKind, consume: Consume) -> None:
        self.kind = kind
        self.silence: _Silence | None = None  # the attempt's, once it reads a body
        self.has_output = False
        self.is_ended = False  # the payload that properly ends the stream came
        self.is_done = False  # `data: [DONE]` came
        self.consumer_error: BaseException | None = None
        self._consume = consume
        self._held: list[Payload] = []
        self._rest = b""

    def feed(self, chunk: bytes) -> bool:
        """Parse the body's next bytes; True once the reading should stop there: `data: [DONE]` came,
        or `consume` raised (`consumer_error`). Raises `UpstreamError` for a line that is not a JSON
        object, or an in-band error. The lines are split here, not by a layer of their own (a call a
        chunk): LF, CRLF or CR ends one, the SSE spec's three."""
        silence = self.silence
        if silence is not None:
            silence.heard()
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = (self._rest + chunk if self._rest else chunk).split(b"\n")
        self._rest = lines.pop()
        came: list[Payload] = []
        fault: Exception | None = None  # a line that is no payload: raised once what came before is on
        try:
            for line in lines:
                if not line:  # the blank line after each event's: no call for it
                    continue
                payload = _data(line)
                if payload is None:
                    continue
                if payload is _DONE:
                    self.is_done = True
                    break
                if not self.is_ended and self.kind.ends(payload):
                    self.is_ended = True
                if self.has_output:
                    came.append(payload)
                    continue
                self._held.append(payload)
                if self.kind.carries_output(payload):
                    self.has_output = True
                    came, self._held = self._held, []
        except Exception as exc:
            fault = exc
        if came:
            try:
                self._consume(came, self.is_done or self.is_ended)
            except BaseException as exc:  # the consumer's word comes first, as it came first
                self.consumer_error = exc
                return True
        if fault is not None:
            raise fault
        return self.is_done

    def release(self) -> None:
        """Hand on what is held (all of it, at a stream's proper end that carried no output)."""
        held, self._held = self._held, []
        if held:
            self._consume(held, True)


class _Silence:
    """Bounds the silence of one upstream call's body between chunks to `seconds` (None: unbounded),
    counted only while its reader waits for the next one, with one timer that is set again only when
    it fires: aiohttp's own per-read timer is cancelled and set again at every chunk, a tenth of the
    upstream read's CPU a token."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.is_stalled = False
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[Any] | None = None  # the one waiting for a chunk
        self._last = self._loop.time()
        self._waiting = False
        self._timer: asyncio.TimerHandle | None = None

    def reader(self, reply: httpx2.Response) -> Callable[[], Awaitable[bytes | None]]:
        """What reads the body's next chunk (None at its end), within the bound, where it is not
        pushed (`http1.Body.push`): straight from aiohttp's reader where it brought the body as
        sent, else through httpx's body (a compressed one, another transport's)."""
        content = _aiohttp_content(reply)
        if content is None:
            chunks = self.chunks(_body(reply))
            return partial(anext, chunks, None)
        self.arm()
        return partial(self._read_from, content.readany)

    def arm(self) -> None:
        """The bound starts now: its one timer."""
        if self.seconds is not None:
            self._last = self._loop.time()
            self._timer = self._loop.call_at(self._last + self.seconds, self._check)

    def heard(self) -> None:
        """A chunk came: the silence starts again."""
        self._last = self._loop.time()

    async def within[T](self, wait: Awaitable[T]) -> T:
        """`wait`, cancelled (`TimeoutError` raised) once the body has been silent for `seconds`
        meanwhile (`heard`): a body pushed (`http1.Body.push`), or its next chunk."""
        self._task, self._waiting = asyncio.current_task(), True
        try:
            return await wait
        except asyncio.CancelledError:
            if self.is_stalled and self._task is not None and self._task.uncancel() == 0:
                self.stop()
                raise TimeoutError from None  # ours alone: the stall
            raise
        finally:
            self._waiting = False

    async def _read_from(self, read: Callable[[], Awaitable[bytes | None]]) -> bytes | None:
        """The next chunk of a body read straight from its transport (aiohttp's `readany`), None at
        its end: one call a chunk, where httpx's byte stream, aiohttp's chunk iterator and a generator
        of chunks were three layers a token. Its faults come as httpx's, as through the
        transport (`_map_httpx_error` reads both)."""
        try:
            chunk = await self.within(read())
        except aiohttp.ClientError:
            self.stop()
            with map_aiohttp_exceptions():
                raise
        if not chunk:
            self.stop()
            return None
        self._last = self._loop.time()
        return chunk

    def stop(self) -> None:
        """No more bound: the body is read, or its reading is over."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def chunks(self, stream: AsyncIterator[bytes]) -> AsyncGenerator[bytes]:
        """`stream`'s chunks; `TimeoutError` (`is_stalled` then true) once it was silent for `seconds`."""
        iterator = aiter(stream)
        self.arm()
        try:
            while True:
                self._task, self._waiting = asyncio.current_task(), True
                try:
                    chunk = await anext(iterator)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if self.is_stalled and self._task is not None and self._task.uncancel() == 0:
                        raise TimeoutError from None  # ours alone: the stall
                    raise
                finally:
                    self._waiting = False
                self._last = self._loop.time()
                yield chunk
        finally:
            if self._timer is not None:
                self._timer.cancel()

    def _check(self) -> None:
        assert self.seconds is not None
        due = self._last + self.seconds
        now = self._loop.time()
        if self._waiting and now >= due and self._task is not None:
            self.is_stalled = True
            self._task.cancel()
            return
        self._timer = self._loop.call_at(max(due, now + self.seconds / 8), self._check)


def _aiohttp_content(reply: httpx2.Response) -> aiohttp.StreamReader | None:
    """The aiohttp reader of a body aiohttp's transport brought uncompressed (else None)."""
    stream = reply.stream
    if not isinstance(stream, AiohttpResponseStream) or not _is_identity(reply):
        return None
    response: aiohttp.ClientResponse = stream._aiohttp_response
    return response.content


def _is_identity(reply: httpx2.Response) -> bool:
    """Whether the body comes as sent (no content encoding)."""
    return reply.headers.get("content-encoding", "identity").strip().lower() in ("", "identity")


def _body(reply: httpx2.Response) -> AsyncIterator[bytes]:
    """The body's chunks, from the response's byte stream itself: httpx's line iterator stacks four
    generators per chunk (raw, decoded, text, lines), each a hop a token. A body sent
    compressed is read through httpx's decoding."""
    if _is_identity(reply):
        return aiter(reply.stream)  # type: ignore[arg-type]  # an AsyncByteStream: the client is async
    return reply.aiter_bytes()


def _unfinished(kind: StreamKind, is_done: bool) -> TransientUpstreamError:
    how = "sent [DONE]" if is_done else "ended its stream"
    return TransientUpstreamError(f"the upstream {how} without {kind.end_name}")


def _sent_key(request: httpx2.Request | _Plain) -> str:
    """The key the request carried, if any (what an upstream could quote back)."""
    if isinstance(request, _Plain):
        return request.sent_key
    return request.headers.get("authorization", "").removeprefix("Bearer ")


def _map_httpx_error(exc: httpx2.HTTPError, url: httpx2.URL, timeout: httpx2.Timeout) -> UpstreamError:
    """The one mapping of httpx's exceptions: transport faults are transient, the rest final."""
    where = f"the upstream at {url}"
    if isinstance(exc, http1.BodyCutError):
        return TransientUpstreamError(f"{where} cut its answer short (its connection closed mid-body)")
    cause = exc.__cause__
    if isinstance(cause, aiohttp.ClientError) and not isinstance(cause, aiohttp.ServerTimeoutError):
        # httpx-aiohttp maps every aiohttp connection fault to httpx's ConnectTimeout (an upstream
        # that hung up, a refused connection): said as aiohttp says it. All of them are transient,
        # but for a certificate this worker cannot verify: no later attempt trusts it either.
        if isinstance(cause, aiohttp.ClientConnectorCertificateError):
            return _untrusted(where, cause.certificate_error)
        if isinstance(cause, aiohttp.ClientConnectorError):
            return TransientUpstreamError(f"could not connect to {where}: {_describe(cause)}")
        if isinstance(cause, aiohttp.ClientPayloadError):
            return TransientUpstreamError(f"{where} cut its answer short (its connection closed mid-body)")
        if isinstance(cause, aiohttp.ClientConnectionError):
            return TransientUpstreamError(f"{where} failed: {_describe(cause)}")
    if isinstance(exc, httpx2.ReadTimeout):
        return TransientUpstreamError(f"the upstream sent nothing for {_seconds(timeout.read)}")
    if isinstance(exc, httpx2.ConnectTimeout):
        return TransientUpstreamError(f"could not connect to {where} within {_seconds(timeout.connect)}")
    if isinstance(exc, httpx2.ConnectError):
        return TransientUpstreamError(f"could not connect to {where}: {_describe(exc)}")
    if isinstance(exc, _TRANSIENT_FAULTS):
        return TransientUpstreamError(f"{where} failed: {_describe(exc)}")
    return UpstreamError(f"{where} failed: {_describe(exc)}")


def _untrusted(where: str, error: Exception) -> UpstreamError:
    """The final error of a TLS certificate the worker could not verify, naming the variables that
    say which CAs it trusts (httpcore2's `default_ssl_context`: SSL_CERT_FILE, else SSL_CERT_DIR,
    else the system's store)."""
    reason = getattr(error, "verify_message", "") or _describe(error)
    return UpstreamError(
        f"could not verify the TLS certificate of {where} ({reason}): the worker trusts the CAs of "
        "SSL_CERT_FILE (a PEM bundle, which replaces the system's store), else of SSL_CERT_DIR, else "
        "the system's; give the worker a bundle that holds the upstream's CA"
    )


def _seconds(value: float | None) -> str:
    return "ever" if value is None else f"{value:g} s"


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _is_transient_status(status: int) -> bool:
    """Whether an HTTP error status says "try again" (408 timeout, 429 rate limit, 5xx) rather than "no"."""
    return status in (408, 429) or status >= 500


async def _status_error(reply: httpx2.Response) -> UpstreamError:
    message = await _error_message(reply)
    if _is_transient_status(reply.status_code):
        return TransientUpstreamError(message, reply.status_code, retry_after(reply.headers))
    return UpstreamError(message, reply.status_code)


def retry_after(headers: httpx2.Headers) -> float | None:
    """The upstream's wait hint in seconds: `retry-after-ms`, else `retry-after` (seconds or an HTTP date)."""
    milliseconds = _number(headers.get("retry-after-ms"))
    if milliseconds is not None:
        return max(0.0, milliseconds / 1000)
    value = headers.get("retry-after")
    if value is None:
        return None
    seconds = _number(value)
    if seconds is None:
        seconds = _seconds_until(value)
    return None if seconds is None else max(0.0, seconds)


def _number(text: str | None) -> float | None:
    try:
        number = float(text) if text is not None else math.nan
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _seconds_until(http_date: str) -> float | None:
    try:
        when = parsedate_to_datetime(http_date)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)  # RFC 9110 dates are GMT
    return (when - datetime.now(UTC)).total_seconds()


# A NUL (`\\u0000`, not an escaped backslash before "u0000") in what a model sends: no Postgres text
# or jsonb value can hold it, so the response could not be recorded. It becomes U+FFFD, the
# replacement character, before anything sees it: the events and the stored response agree.
_NUL_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")


# What `_data` returns for `data: [DONE]`, the end of an OpenAI-style stream.
_DONE: Payload = {}


def _data(line: bytes) -> Payload | None:
    """The JSON object of a `data:` line (`_DONE` for `[DONE]`); None for any other line."""
    if not line.startswith(b"data:"):
        return None
    text = line[5:].strip()
    if not text:
        return None
    if text == b"[DONE]":
        return _DONE
    return _object(text)


def _object(text: str | bytes) -> Payload:
    """The JSON object `text` holds; `UpstreamError` if it holds none, or an in-band error. Bytes
    that are not UTF-8 are read as their text with U+FFFD in place of what is not (as a decoder would)."""
    if isinstance(text, bytes) and b"\\u0000" in text:
        text = text.decode(errors="replace")
    if isinstance(text, str) and "\\u0000" in text:
        text = _NUL_ESCAPE.sub("\\1\\\\ufffd", text)
    try:
        payload = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        if isinstance(text, bytes):  # perhaps not UTF-8: as text, then
            return _object(text.decode(errors="replace"))
        raise UpstreamError(f"the upstream sent a line that is not JSON: {text[:200]!r}") from exc
    if not isinstance(payload, dict):
        shown = text.decode(errors="replace") if isinstance(text, bytes) else text
        raise UpstreamError(f"the upstream sent a JSON value that is not an object: {shown[:200]!r}")
    if payload.get("error"):
        raise UpstreamError(f"the upstream reported an error: {_message_of(payload)}")
    return payload


async def _error_message(reply: httpx2.Response) -> str:
    body = (await reply.aread())[:2000]
    try:
        message = _message_of(orjson.loads(body))
    except orjson.JSONDecodeError:
        message = body.decode(errors="replace")
    return f"the upstream answered {reply.status_code}: {message}"


def _message_of(payload: Any) -> str:
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
    return str(payload)[:500]
