"""The load generator: streams and short requests against one target, timed at the client.

A target is one way to reach the same paced upstream: the upstream called directly (Chat
Completions), respool (`/v1/responses` over a Chat Completions upstream) or LiteLLM (its
`/v1/responses` bridge). Every token the upstream sends is the text `tok `, so a client counts
tokens by counting `b"tok "` in the delta frames, whether or not a proxy merged deltas.

What is measured, per stream: the time from sending the request to the first token (TTFT), and
the gap between consecutive token arrivals (tokens that arrive in one frame arrive together).
A stream is lost if it fails or ends with fewer tokens than the upstream sent, and stalled if a
gap exceeds `STALL_SECONDS`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

import httptools
import httpx2
import orjson

from api.bench.told import KEY as TOLD_KEY
from api.bench.told import Receiver

TOKEN = b"tok "
STALL_SECONDS = 1.0
TOLD_TIMEOUT_SECONDS = 60.0  # a webhook that does not come in this long counts as an error
_DELTA = b'"response.output_text.delta"'
_RESPONSE_FAILS = (b"event: error", b'"type":"error"', b'"response.failed"', b'"response.incomplete"')


class Api(StrEnum):
    CHAT = "chat"  # POST /chat/completions (the upstream itself)
    RESPONSES = "responses"  # POST /responses (respool, LiteLLM)


@dataclass(frozen=True)
class Target:
    """Where to send load: a name for the report, a base URL ending in `/v1`, and its API."""

    name: str
    url: str
    api: Api


def model_name(tokens: int, pace_ms: int) -> str:
    """The bench upstream's model for `tokens` tokens `pace_ms` apart (api/bench/upstream.py)."""
    return f"bench-{tokens}x{pace_ms}"


@dataclass
class StreamSample:
    """One stream as the client saw it."""

    tokens: int = 0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    error: str | None = None
    max_gap: float = 0.0

    def is_clean(self, expected_tokens: int) -> bool:
        return self.error is None and self.tokens == expected_tokens and self.max_gap <= STALL_SECONDS


def client(connections: int) -> httpx2.AsyncClient:
    """One pooled HTTP/1.1 client for a whole run (keep-alive, no limit below `connections`)."""
    limits = httpx2.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx2.AsyncClient(limits=limits, timeout=httpx2.Timeout(120.0, connect=30.0))


def _stream_body(target: Target, model: str) -> bytes:
    if target.api is Api.CHAT:
        messages = [{"role": "user", "content": "Count."}]
        return orjson.dumps({"model": model, "messages": messages, "stream": True})
    return orjson.dumps({"model": model, "input": "Count.", "stream": True})


def _path(target: Target) -> str:
    return "/chat/completions" if target.api is Api.CHAT else "/responses"


async def stream_once(target: Target, model: str, expected: int) -> StreamSample:
    """One streamed request: its TTFT and token gaps, or what went wrong.

    Lean, so that the cores go to the system measured (issue 20): a connection of its own, the
    request written as bytes, the reply parsed by httptools (llhttp, compiled: chunked bodies
    included) and its SSE frames scanned as bytes."""
    sample = StreamSample()
    body = _stream_body(target, model)
    where = urlsplit(target.url + _path(target))
    head = (
        f"POST {where.path} HTTP/1.1\r\nhost: {where.netloc}\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer bench\r\naccept: text/event-stream\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    reply = _Reply(sample, target.api is Api.CHAT, time.perf_counter())
    parser = reply.parser = httptools.HttpResponseParser(reply)
    try:
        reader, writer = await asyncio.open_connection(where.hostname, where.port)
    except OSError as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
        return sample
    try:
        writer.write(head.encode() + body)
        while not reply.complete:
            data = await reader.read(65536)
            if not data:
                break
            parser.feed_data(data)
    except (OSError, httptools.HttpParserError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
        return sample
    finally:
        writer.close()
    if reply.status != 200:
        sample.error = f"HTTP {reply.status}: {reply.buffer[:200].decode(errors='replace')}"
    elif sample.error is None and not reply.ended:
        sample.error = "the stream ended without its last event"
    if sample.error is None and sample.tokens != expected:
        sample.error = f"{sample.tokens} tokens of {expected}"
    return sample


class _Reply:
    """httptools' callbacks for one streamed reply: frames counted as their bytes arrive."""

    def __init__(self, sample: StreamSample, is_chat: bool, started: float) -> None:
        self.sample, self.is_chat, self.started = sample, is_chat, started
        self.parser: httptools.HttpResponseParser | None = None
        self.status = 0
        self.buffer = b""
        self.last: float | None = None
        self.ended = self.complete = False

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        self.status = self.parser.get_status_code()

    def on_body(self, data: bytes) -> None:
        now = time.perf_counter()
        self.buffer += data
        if self.status != 200:
            return  # kept whole, for the error
        *frames, self.buffer = self.buffer.split(b"\n\n")
        sample = self.sample
        for frame in frames:
            count = tokens_in(frame, self.is_chat)
            if count:
                if self.last is None:
                    sample.ttft = now - self.started
                else:
                    gap = now - self.last
                    sample.gaps.append(gap)
                    sample.max_gap = max(sample.max_gap, gap)
                sample.gaps.extend([0.0] * (count - 1))
                sample.tokens += count
                self.last = now
            elif is_end(frame, self.is_chat):
                self.ended = True
            elif not self.is_chat and any(kind in frame for kind in _RESPONSE_FAILS):
                sample.error = frame.decode(errors="replace")[:300]

    def on_message_complete(self) -> None:
        self.complete = True


def tokens_in(frame: bytes, is_chat: bool) -> int:
    if is_chat:
        return frame.count(TOKEN)
    return frame.count(TOKEN) if _DELTA in frame else 0


def is_end(frame: bytes, is_chat: bool) -> bool:
    if is_chat:
        return b"[DONE]" in frame
    return b'"response.completed"' in frame


async def closed_loop(
    concurrency: int, count: int, one: Callable[[int], Awaitable[None]], on_done: Callable[[], None]
) -> None:
    """Run `one(i)` for i in 0..count-1, `concurrency` at a time, each client starting the next at once."""
    next_index = 0

    async def user() -> None:
        nonlocal next_index
        while next_index < count:
            index = next_index
            next_index += 1
            await one(index)
            on_done()

    await asyncio.gather(*(user() for _ in range(min(concurrency, count))))


async def streams(
    target: Target,
    *,
    concurrency: int,
    count: int,
    tokens: int,
    pace_ms: int,
    ramp_seconds: float = 0.0,
    on_done: Callable[[], None] = lambda: None,
) -> list[StreamSample]:
    """`count` streams, `concurrency` at a time; the first wave starts spread over `ramp_seconds`.

    Each stream has a connection of its own: no run inherits the connections of another."""
    model = model_name(tokens, pace_ms)
    samples: list[StreamSample] = []

    async def one(index: int) -> None:
        if index < concurrency and ramp_seconds > 0:
            await asyncio.sleep(ramp_seconds * index / concurrency)
        samples.append(await stream_once(target, model, tokens))

    await closed_loop(concurrency, count, one, on_done)
    return samples


@dataclass
class Throughput:
    """Short non-streaming requests completed in a fixed time."""

    completed: int = 0
    errors: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    first_error: str | None = None
    requests: int = 0  # HTTP requests the clients sent (creates and polls)

    @property
    def per_second(self) -> float:
        return self.completed / self.seconds if self.seconds else 0.0


async def short_requests(
    target: Target,
    *,
    background: bool,
    concurrency: int,
    seconds: float,
    model: str,
    poll_seconds: float = 0.05,
    told: Receiver | None = None,
    on_done: Callable[[], None] = lambda: None,
) -> Throughput:
    """As many short requests as complete in `seconds` with `concurrency` clients: foreground (one
    request each), or background (create, then poll every `poll_seconds` until `completed`; or,
    `told` given, wait for the webhook that tells the response ended: api/bench/told.py)."""
    result = Throughput()
    key = TOLD_KEY if told is not None else "bench"
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
    body = _short_body(target, model, background)
    url = target.url + _path(target)
    deadline = time.perf_counter() + seconds

    async def one() -> None:
        started = time.perf_counter()
        reply = await http.post(url, content=body, headers=headers)
        result.requests += 1
        status = _status(reply)
        if background:
            response_id = orjson.loads(reply.content).get("id") if reply.status_code == 200 else None
            if told is not None and response_id and status in ("queued", "in_progress"):
                try:
                    async with asyncio.timeout(TOLD_TIMEOUT_SECONDS):
                        status = (await told.wait(response_id)).removeprefix("response.")
                except TimeoutError:
                    status = f"no webhook within {TOLD_TIMEOUT_SECONDS:g} s"
            while status in ("queued", "in_progress") and response_id:
                await asyncio.sleep(poll_seconds)
                reply = await http.get(f"{target.url}/responses/{response_id}", headers=headers)
                result.requests += 1
                status = _status(reply)
        if status == "completed":
            result.completed += 1
            result.latencies.append(time.perf_counter() - started)
        else:
            result.errors += 1
            said = f"HTTP {reply.status_code}: {reply.text[:200]}" if reply.status_code != 200 else status
            result.first_error = result.first_error or said
        on_done()

    async def user() -> None:
        while time.perf_counter() < deadline:
            try:
                await one()
            except (httpx2.HTTPError, OSError) as exc:
                result.errors += 1
                result.first_error = result.first_error or f"{type(exc).__name__}: {exc}"

    async with client(concurrency) as http:
        started = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        result.seconds = time.perf_counter() - started
    return result


def _short_body(target: Target, model: str, background: bool) -> bytes:
    if target.api is Api.CHAT:
        return orjson.dumps({"model": model, "messages": [{"role": "user", "content": "Hi."}]})
    return orjson.dumps({"model": model, "input": "Hi.", "background": background})


def _status(reply: httpx2.Response) -> str:
    if reply.status_code != 200:
        return "error"
    payload: dict[str, Any] = orjson.loads(reply.content)
    if "choices" in payload:  # a chat completion
        return "completed"
    return str(payload.get("status"))


@dataclass
class Counted:
    """A fixed number of short requests (the CPU-cost scenarios): how many completed, the polls sent."""

    completed: int = 0
    errors: int = 0
    polls: int = 0
    first_error: str | None = None
    response_ids: list[str] = field(default_factory=list)


async def short_count(
    target: Target,
    *,
    background: bool,
    count: int,
    concurrency: int,
    model: str,
    poll_seconds: float,
    pause_seconds: float = 0.0,
) -> Counted:
    """`count` short requests, `concurrency` at a time: foreground, or background created then
    polled every `poll_seconds` until it ended. With `pause_seconds`, each client waits that long
    after each foreground request (at a background response's rate: its client waits for its poll)."""
    result = Counted()
    headers = {"content-type": "application/json", "authorization": "Bearer bench"}
    body = _short_body(target, model, background)
    async with client(concurrency) as http:

        async def one(index: int) -> None:
            response_id = None
            try:
                reply = await http.post(target.url + _path(target), content=body, headers=headers)
                status = _status(reply)
                response_id = orjson.loads(reply.content).get("id") if reply.status_code == 200 else None
                while background and status in ("queued", "in_progress") and response_id:
                    await asyncio.sleep(poll_seconds)
                    reply = await http.get(f"{target.url}/responses/{response_id}", headers=headers)
                    result.polls += 1
                    status = _status(reply)
            except (httpx2.HTTPError, OSError) as exc:
                status = f"{type(exc).__name__}: {exc}"
            if status == "completed":
                result.completed += 1
                if response_id:
                    result.response_ids.append(response_id)
            else:
                result.errors += 1
                result.first_error = result.first_error or status
            if pause_seconds and not background:
                await asyncio.sleep(pause_seconds)

        await closed_loop(concurrency, count, one, lambda: None)
    return result


async def polls(target: Target, response_id: str, *, count: int, concurrency: int) -> Counted:
    """`count` polls of one ended response, `concurrency` at a time (what one poll costs)."""
    result = Counted()
    headers = {"authorization": "Bearer bench"}
    async with client(concurrency) as http:

        async def one(index: int) -> None:
            reply = await http.get(f"{target.url}/responses/{response_id}", headers=headers)
            result.polls += 1
            if reply.status_code == 200:
                result.completed += 1
            else:
                result.errors += 1
                result.first_error = result.first_error or f"HTTP {reply.status_code}: {reply.text[:200]}"

        await closed_loop(concurrency, count, one, lambda: None)
    return result
