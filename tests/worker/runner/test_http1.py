"""Plain HTTP's own transport (worker/runner/http1.py) against a real HTTP/1.1 peer on loopback: an
asyncio server of this file, as strict about what it is sent as a model server (a request line, a
`host`, a JSON body that says so and its length), whose ways of answering each test sets: kept-alive
connections, connections closed while idle or under the next request, encoded bodies, refusals."""

from __future__ import annotations

import asyncio
import gzip
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx2
import orjson
import pytest

from worker.errors import TransientUpstreamError
from worker.routing import Route, UpstreamApi
from worker.runner import http1, upstream
from worker.runner.upstream import CHAT_STREAM, RetryPolicy, create_client, stream_into, stream_json

NO_RETRIES = RetryPolicy(retries=0)
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def _sse(*words: str) -> bytes:
    chunks = [
        {"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]} for word in words
    ]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return b"".join(b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks) + b"data: [DONE]\n\n"


@dataclass
class Peer:
    """A model server's HTTP/1.1, answering each request by `answer` (request number, from 1)."""

    # chunked | gzip | refuse | drop_second | close_after | end_later | end_never | until_close |
    # trickle | trickle_never
    answer: str = "chunked"
    connections: int = 0
    open_now: int = 0
    most_open: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request = _parsed(head, await reader.readexactly(_length(head)))
                self.requests.append(request)
                if self.answer == "drop_second" and len(self.requests) == 2:
                    return  # closes without answering, as a server closing an idle connection
                await asyncio.sleep(0.05)  # long enough for a second call to overlap this one
                if self.answer in ("trickle", "trickle_never"):  # a frame a chunk, 20 ms apart
                    for piece in _trickled(ended=self.answer == "trickle"):
                        writer.write(piece)
                        await writer.drain()
                        await asyncio.sleep(0.02)
                    if self.answer == "trickle_never":
                        await reader.read()  # until the client gives up and closes
                        return
                    continue
                answer = _answer(self.answer)
                if self.answer in ("end_later", "end_never"):  # its last chunk a moment later, or never
                    last = answer.rindex(b"0\r\n\r\n")
                    writer.write(answer[:last])
                    await writer.drain()
                    if self.answer == "end_never":
                        await reader.read()  # until the client gives up and closes
                        return
                    await asyncio.sleep(0.02)
                    answer = answer[last:]
                writer.write(answer)
                await writer.drain()
                if self.answer == "until_close":
                    return
                if self.answer == "close_after":
                    await asyncio.sleep(0.05)  # idle a moment, then closed (a keep-alive timeout)
                    return
        except asyncio.IncompleteReadError:
            return
        finally:
            self.open_now -= 1
            writer.close()


def _length(head: bytes) -> int:
    lengths = [line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    assert len(lengths) == 1, f"a request without one content-length: {head!r}"
    return int(lengths[0].split(b":", 1)[1])


def _parsed(head: bytes, body: bytes) -> dict[str, Any]:
    line, *lines = head.rstrip(b"\r\n").split(b"\r\n")
    method, target, version = line.split(b" ")
    assert (method, version) == (b"POST", b"HTTP/1.1"), line
    headers = {name.strip().lower(): value.strip() for name, value in (h.split(b":", 1) for h in lines)}
    assert b"host" in headers and headers[b"content-type"] == b"application/json", headers
    return {"target": target, "headers": headers, "body": orjson.loads(body)}


def _answer(how: str) -> bytes:
    body = _sse("one ", "two")
    if how == "refuse":
        error = orjson.dumps({"error": {"message": "overloaded"}})
        return b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: %d\r\nretry-after: 7\r\n\r\n%s" % (len(error), error)  # fmt: skip
    if how == "until_close":  # HTTP/1.0's way: no length, the body ends with the connection
        ended = body.removesuffix(b"data: [DONE]\n\n")  # read to the connection's close, then
        return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + ended
    if how == "gzip":
        packed = gzip.compress(body)
        return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n%s" % (len(packed), packed)  # fmt: skip
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    chunks = [body[:40], body[40:]]  # one frame split across two chunks
    return head + b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks) + b"0\r\n\r\n"


def _trickled(*, ended: bool) -> list[bytes]:
    """A chunked answer's head, then each SSE frame of it a chunk of its own; its last chunk if `ended`."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    frames = [frame + b"\n\n" for frame in _sse("one ", "two").split(b"\n\n") if frame]
    return [head, *(b"%x\r\n%s\r\n" % (len(frame), frame) for frame in frames)] + [b"0\r\n\r\n"] * ended


@pytest.fixture
async def peer() -> AsyncIterator[Peer]:
    peer = Peer()
    server = await asyncio.start_server(peer.handle, "127.0.0.1", 0)
    peer.port = server.sockets[0].getsockname()[1]
    async with server:
        yield peer
        server.close()


async def _words(client: Any, peer: Peer) -> list[str]:
    route = Route("m", UpstreamApi.CHAT, f"http://127.0.0.1:{peer.port}/v1")
    words = []
    async for chunk in stream_json(client, route, "/chat/completions", BODY, NO_RETRIES, CHAT_STREAM):
        words += [choice["delta"].get("content") for choice in chunk["choices"]]
    return [word for word in words if word]


async def _calls(peer: Peer, count: int, pause: float = 0.0) -> list[list[str]]:
    """`count` calls one after another on one client, `pause` seconds apart: each one's words."""
    client = create_client(60, 4)
    try:
        answers = []
        for index in range(count):
            if index:
                await asyncio.sleep(pause)
            answers.append(await _words(client, peer))
        return answers
    finally:
        await client.aclose()


ANSWER = ["one ", "two"]


async def test_calls_one_after_another_share_one_kept_alive_connection(peer: Peer) -> None:
    """Three calls, one connection; each request is a JSON POST to the route's path, as sent."""
    assert await _calls(peer, 3) == [ANSWER] * 3
    assert peer.connections == 1
    assert [request["target"] for request in peer.requests] == [b"/v1/chat/completions"] * 3
    assert all(request["body"] == BODY for request in peer.requests)
    assert all(request["headers"][b"accept"] == b"text/event-stream" for request in peer.requests)


async def test_an_answer_whose_last_chunk_comes_after_its_done_keeps_its_connection(peer: Peer) -> None:
    """`data: [DONE]` ends the call; the body's last chunk comes 20 ms later (as llama-cpp-python's
    server sends it): the connection is read to that end and used again, not closed under it."""
    peer.answer = "end_later"
    assert await _calls(peer, 3, pause=0.05) == [ANSWER] * 3
    assert peer.connections == 1 and len(peer.requests) == 3
    await asyncio.sleep(0.1)  # the client closed as its last answer drained: that connection too
    assert peer.open_now == 0


async def test_an_answer_whose_last_chunk_never_comes_loses_its_connection(
    peer: Peer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last chunk does not come within the drain's bound: that connection is closed, and the
    next call goes on a new one."""
    monkeypatch.setattr(http1, "DRAIN_SECONDS", 0.1)
    peer.answer = "end_never"
    assert await _calls(peer, 2, pause=0.3) == [ANSWER] * 2
    assert peer.connections == 2 and peer.open_now <= 1


async def test_a_connection_closed_while_idle_is_not_used_again(peer: Peer) -> None:
    """The server closes each connection a moment after its answer: the next call finds it closed
    and opens another, without a fault."""
    peer.answer = "close_after"
    assert await _calls(peer, 2, pause=0.2) == [ANSWER] * 2
    assert peer.connections == 2


async def test_a_request_that_meets_an_idle_connections_close_goes_again_on_a_new_one(peer: Peer) -> None:
    """The server closes a kept-alive connection under the next request, before any answer (its
    close and the request crossed): the request goes once more, on a new connection, and is answered."""
    peer.answer = "drop_second"
    assert await _calls(peer, 2) == [ANSWER] * 2
    assert peer.connections == 2 and len(peer.requests) == 3


async def test_a_body_of_no_stated_length_ends_with_its_connection(peer: Peer) -> None:
    """No content-length, not chunked, `connection: close`: the body is what came before the
    close, whole (not a body cut short), and the next call goes on a new connection."""
    peer.answer = "until_close"
    assert await _calls(peer, 2) == [ANSWER] * 2
    assert peer.connections == 2


async def test_a_gzip_body_is_read_decoded(peer: Peer) -> None:
    peer.answer = "gzip"
    assert await _calls(peer, 1) == [ANSWER]


async def test_calls_past_the_connection_bound_wait_for_a_free_one(peer: Peer) -> None:
    """Three calls at once on a client of one connection: one at a time, all answered."""
    client = create_client(60, 1)
    try:
        results = await asyncio.gather(*(_words(client, peer) for _ in range(3)))
    finally:
        await client.aclose()
    assert results == [["one ", "two"]] * 3
    assert peer.most_open == 1 and peer.connections == 1


async def test_a_refusal_says_its_status_message_and_wait(peer: Peer) -> None:
    peer.answer = "refuse"
    client = create_client(60, 4)
    try:
        with pytest.raises(TransientUpstreamError) as raised:
            await _words(client, peer)
    finally:
        await client.aclose()
    assert "the upstream answered 503: overloaded" in str(raised.value)
    assert raised.value.retry_after == 7


async def test_a_port_nobody_listens_on_is_a_transient_connect_fault(peer: Peer) -> None:
    client = create_client(60, 4)
    closed = Peer(port=1)  # nothing listens on port 1
    try:
        with pytest.raises(
            TransientUpstreamError, match=r"could not connect to the upstream at http://127\.0\.0\.1:1/"
        ):
            await _words(client, closed)
    finally:
        await client.aclose()


async def test_a_body_that_comes_a_frame_at_a_time_is_handed_on_a_payload_at_a_time(peer: Peer) -> None:
    """Each frame comes 20 ms after the last: each payload reaches the consumer as its frame comes
    (pushed from the connection's callback), before the next one is sent; the stream's end is told
    with the one that ends it (its `finish_reason`), not before."""
    peer.answer = "trickle"
    client = create_client(60, 4)
    route = Route("m", UpstreamApi.CHAT, f"http://127.0.0.1:{peer.port}/v1")
    came: list[tuple[float, dict[str, Any]]] = []
    ended: list[bool] = []
    loop = asyncio.get_running_loop()

    def consume(payloads: list[dict[str, Any]], ends: bool) -> None:
        came.extend((loop.time(), p) for p in payloads)
        ended.append(ends)

    try:
        await stream_into(client, route, "/chat/completions", BODY, NO_RETRIES, CHAT_STREAM, consume)
        await asyncio.sleep(0.1)  # its last chunk comes 20 ms after its [DONE]: drained, then kept
        assert await _words(client, peer) == ANSWER
    finally:
        await client.aclose()
    assert [payload["choices"][0]["delta"].get("content") for _, payload in came] == ["one ", "two", None]
    assert ended == [False, False, True]
    assert all(later - earlier >= 0.01 for (earlier, _), (later, _) in itertools.pairwise(came))
    assert peer.connections == 1


async def test_what_comes_in_one_read_is_handed_on_in_one_call(peer: Peer) -> None:
    """The whole answer in one write (its frames over two HTTP chunks, one read): its payloads reach
    the consumer together, in one call (the writer then appends their events in one round trip), told
    that the stream's end came with them (the writer keeps their events for the response's end)."""
    client = create_client(60, 4)
    route = Route("m", UpstreamApi.CHAT, f"http://127.0.0.1:{peer.port}/v1")
    calls: list[tuple[list[dict[str, Any]], bool]] = []

    def consume(payloads: list[dict[str, Any]], ends: bool) -> None:
        calls.append((payloads, ends))

    try:
        await stream_into(client, route, "/chat/completions", BODY, NO_RETRIES, CHAT_STREAM, consume)
    finally:
        await client.aclose()
    contents = [([p["choices"][0]["delta"].get("content") for p in call], ends) for call, ends in calls]
    assert contents == [(["one ", "two", None], True)]


class _Refused(Exception):
    pass


async def test_a_consumer_that_raises_ends_the_call_with_what_it_raised(peer: Peer) -> None:
    """The consumer raises at the first word (a writer fenced out, say) while the answer still comes:
    that exception, as raised, not an upstream fault and not retried; the connection is closed under
    the answer, and the next call goes on a new one."""
    peer.answer = "trickle_never"
    client = create_client(60, 4)
    route = Route("m", UpstreamApi.CHAT, f"http://127.0.0.1:{peer.port}/v1")
    refusal = _Refused()

    def refuse(payloads: list[dict[str, Any]], ends: bool) -> None:
        raise refusal

    try:
        with pytest.raises(_Refused) as raised:
            await stream_into(client, route, "/chat/completions", BODY, RetryPolicy(), CHAT_STREAM, refuse)
        assert raised.value is refusal
        assert len(peer.requests) == 1
        peer.answer = "chunked"
        assert await _words(client, peer) == ANSWER
    finally:
        await client.aclose()
    assert peer.connections == 2


async def test_a_cancel_while_a_body_is_pushed_closes_its_connection(peer: Peer) -> None:
    """A call cancelled between two frames (a client's cancel): the cancel propagates, nothing more
    reaches the consumer, and the connection is closed under the answer."""
    peer.answer = "trickle_never"
    client = create_client(60, 4)
    route = Route("m", UpstreamApi.CHAT, f"http://127.0.0.1:{peer.port}/v1")
    came: list[dict[str, Any]] = []
    first = asyncio.Event()

    def consume(payloads: list[dict[str, Any]], ends: bool) -> None:
        came.extend(payloads)
        first.set()

    call = asyncio.ensure_future(
        stream_into(client, route, "/chat/completions", BODY, NO_RETRIES, CHAT_STREAM, consume)
    )
    try:
        await first.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        seen = len(came)
        await asyncio.sleep(0.1)
        assert len(came) == seen < 3
        assert peer.open_now == 0
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    "route",
    [
        Route("m", UpstreamApi.CHAT, "http://127.0.0.1:8000/v1"),
        Route("m", UpstreamApi.CHAT, "http://models.internal/a/v1", api_key_env="RESPOOL_TEST_UPSTREAM_KEY"),
    ],
    ids=["port", "key"],
)
async def test_a_call_on_the_own_transport_is_sent_as_httpx_would_send_it(
    route: Route, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streamed call on this transport is serialized once, without httpx's request (`_Plain`):
    byte for byte what httpx's request would have put on the wire (its head, host, length, key)."""
    monkeypatch.setenv("RESPOOL_TEST_UPSTREAM_KEY", "sk-upstream")
    client = create_client(60, 4)
    try:
        body = {**BODY, "messages": [{"role": "user", "content": "h\u00e9llo \u2603"}]}
        plain = upstream._outgoing(client, route, "/chat/completions", body)
        assert isinstance(plain, upstream._Plain)
        request = upstream._build_request(client, route, "/chat/completions", body)
        assert plain.request_bytes == http1._serialized(request, await request.aread())
        assert plain.sent_key == upstream._sent_key(request) == (route.api_key() or "")
        assert plain.timeouts["read"] is None  # the stall is the call's own bound (`_Silence`)
    finally:
        await client.aclose()


async def test_a_call_another_transport_takes_is_httpx_s_request() -> None:
    """TLS (aiohttp's transport), or a transport a test mounts, take httpx's request as before."""
    client = create_client(60, 4)
    mocked = create_client(60, 4, transport=httpx2.MockTransport(lambda request: httpx2.Response(200)))
    try:
        tls = Route("m", UpstreamApi.CHAT, "https://api.example/v1")
        assert isinstance(upstream._outgoing(client, tls, "/responses", BODY), httpx2.Request)
        plain = Route("m", UpstreamApi.CHAT, "http://127.0.0.1:8000/v1")
        assert isinstance(upstream._outgoing(mocked, plain, "/responses", BODY), httpx2.Request)
    finally:
        await client.aclose()
        await mocked.aclose()
