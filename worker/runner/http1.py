"""The upstream calls' own HTTP/1.1 transport for plain `http://` URLs: an asyncio protocol over
httptools (llhttp, compiled: the parser aiohttp uses), on pooled keep-alive connections.

aiohttp's client, for each request, builds a URL, a header multidict, a request and a response object,
runs its tracing and cookie hooks and times every read: 440 µs of a worker's CPU a short streamed
call where this transport takes 50, and 28 µs a token of a stream where it takes 16 (measured on
loopback, 16 calls at a time, the scripted bodies of the bench). What a call needs of HTTP here is
small: a POST with a JSON body, an answer's status and headers, its body's chunks as they come.

Everything else stays aiohttp's (`fallback`): `https://` URLs (TLS) and, through httpx's own proxy
mounts, proxied ones. A request asks for no content encoding (it names none); a body that comes
encoded all the same is handed on as it came, for httpx to decode, as from any transport.

Faults are httpx's exceptions, as a transport's are (worker/runner/upstream.py maps them once):
`ConnectError` / `ConnectTimeout` for a connection that could not be made, `BodyCutError` (a
`RemoteProtocolError`) for one that closed before its answer ended, `RemoteProtocolError` for bytes
that are not HTTP, `ReadTimeout` for a read past the request's read timeout, `PoolTimeout` for a
connection not free in time. A kept-alive connection the server closed while it was idle (uvicorn
closes them after 5 s) is found out at once if its close has arrived, else by the request sent on
it meeting that close before any answer: then the request goes once more on a new connection.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import httptools
import httpx2

# A connection idle this long is closed rather than used again (aiohttp's default keep-alive).
KEEPALIVE_SECONDS = 15.0
# How long the rest of an answer read to its logical end may take to come (`Body.read_to_its_end`).
DRAIN_SECONDS = 1.0
# Reading from a connection pauses while this much of its body waits for its reader.
_HIGH_WATER = 1 << 20


class BodyCutError(httpx2.RemoteProtocolError):
    """The connection closed before the answer's end (its headers, or all of its body)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; the answer under way is parsed as its bytes arrive."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.is_closed = False
        self.idle_since = 0.0
        self._then: Callable[[], None] | None = None  # while drained (`drain`)
        self._drain_timer: asyncio.TimerHandle | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.is_complete = False
        self.got_bytes = False  # of the answer under way
        self.keeps_alive = False
        self.fault: Exception | None = None
        self.sink: Callable[[bytes], None] | None = None  # takes the body's chunks as they come (`Body.push`)
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._headers_done = False
        self._ends_at_close = False
        self._waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol -----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP one (uvloop's is no subclass)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx2.RemoteProtocolError(f"the upstream's answer is not HTTP/1.1: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # closes the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        self._stop_draining()
        if self._headers_done and self._ends_at_close and not self.is_complete and exc is None:
            self.is_complete = True  # a body of no stated length ends where its connection does
            self._wake()
        if not self.is_complete and self.fault is None:
            self._fail(BodyCutError("the connection closed before the answer ended"))

    # httptools' callbacks ---------------------------------------------------------------------------

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an interim answer: the real one follows
            self.headers, self.reason = [], b""
            return
        self.status = status
        self.keeps_alive = self._parser.should_keep_alive()
        framed = {name.lower() for name, _ in self.headers} & {b"content-length", b"transfer-encoding"}
        self._ends_at_close = not framed and status not in (204, 304)
        self._headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self._then is not None:  # drained: what is left of an answer read to its logical end
            return
        sink = self.sink
        if sink is not None:  # pushed (`Body.push`): no buffer, no wake-up
            sink(body)
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.status:  # not an interim answer's end
            self.is_complete = True
            self._wake()
            then = self._then
            if then is not None:
                self._stop_draining()
                then()

    def drain(self, then: Callable[[], None], seconds: float) -> None:
        """Read what is left of the answer under way, discarding it, then call `then`; closed if
        its end does not come within `seconds`."""
        if self.is_complete:
            then()
            return
        if self.is_closed:
            return
        self._chunks.clear()
        self._then = then
        self._drain_timer = asyncio.get_running_loop().call_later(seconds, self.close)
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def _stop_draining(self) -> None:
        self._then = None
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None

    # the transport's side ----------------------------------------------------------------------------

    def start(self, request_bytes: bytes) -> None:
        """Send a request; its answer is parsed from here on."""
        self._reset()
        assert self.transport is not None
        self.transport.write(request_bytes)

    async def headers_received(self) -> None:
        while not self._headers_done:
            if self.fault is not None:
                raise self.fault
            await self._wait()

    async def read(self) -> bytes | None:
        """The body's next bytes (all that has come since the last read); None at its end."""
        while not self._chunks:
            if self.is_complete:
                return None
            if self.fault is not None:
                raise self.fault
            await self._wait()
        return self.take()

    def take(self) -> bytes:
        """All of the body that has come and waits to be read (b"" if none); reading goes on if it
        had paused for it."""
        if len(self._chunks) == 1:
            chunk = self._chunks.popleft()
        else:
            chunk = b"".join(self._chunks)
            self._chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None and not self.is_closed:
            self._paused = False
            self.transport.resume_reading()
        return chunk

    async def until_woken(self) -> None:
        """Until the answer ends, or fails, or whoever pushes its body to a sink asks (`wake`)."""
        await self._wait()

    def close(self) -> None:
        self.is_closed = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, exc: Exception) -> None:
        self.fault = exc
        self._wake()

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def wake(self) -> None:
        """Wake the task waiting on this connection (`until_woken`)."""
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Stop:
    """Whether a pushed body's feed said stop, or raised."""

    __slots__ = ("done", "raised")

    def __init__(self) -> None:
        self.done = False
        self.raised: BaseException | None = None


class Body(httpx2.AsyncByteStream):
    """An answer's body, read from its connection; the connection goes back to its pool once the
    body has been read to its end (else it is closed)."""

    def __init__(
        self,
        pool: Http1Transport,
        key: tuple[str, int],
        connection: _Connection,
        read_seconds: float | None,
        encoding: str,
    ) -> None:
        self._pool, self._key, self._connection = pool, key, connection
        self._read_seconds = read_seconds
        self.is_identity = encoding.strip().lower() in ("", "identity")  # else httpx decodes it
        self._is_closed = False
        self._drains = False

    @property
    def status(self) -> int:
        """The answer's status code."""
        return self._connection.status

    def as_response(self, request: httpx2.Request | None = None) -> httpx2.Response:
        """The answer as httpx's response, this its body."""
        connection = self._connection
        return httpx2.Response(
            connection.status,
            headers=connection.headers,
            stream=self,
            request=request,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": connection.reason},
        )

    async def read(self) -> bytes | None:
        """The body's next bytes as they came (None at its end); faults as httpx's."""
        connection = self._connection
        if self._read_seconds is None:
            chunk = await connection.read()
        else:
            try:
                async with asyncio.timeout(self._read_seconds):
                    chunk = await connection.read()
            except TimeoutError:
                raise httpx2.ReadTimeout(f"nothing came for {self._read_seconds:g} s") from None
        if chunk is None:
            self._done()
        return chunk

    async def push(self, feed: Callable[[bytes], bool]) -> bool:
        """Hand the body's chunks to `feed` as they come, from the connection's own callback: no task
        wakes up, and no future is made, for a chunk (a token, streamed), where a read a chunk took both.
        Until the body ends (True), or `feed` answers True (False: stop here; the rest of
        the answer is the caller's to drain or close), or raises (raised here); faults as `read`'s.
        No read timeout: the caller bounds the silence (worker/runner/upstream.py's `_Silence`)."""
        connection = self._connection
        chunk = connection.take()
        if chunk and feed(chunk):  # what came with the headers, or before
            return False
        stop = _Stop()

        def deliver(chunk: bytes) -> None:
            try:
                stop.done = feed(chunk)
            except BaseException as exc:
                stop.raised, stop.done = exc, True
            if stop.done:
                connection.sink = None
                connection.wake()

        connection.sink = deliver
        try:
            while True:
                if stop.raised is not None:
                    raise stop.raised
                if stop.done:
                    return False
                if connection.is_complete:
                    self._done()
                    return True
                if connection.fault is not None:
                    raise connection.fault
                await connection.until_woken()
        finally:
            connection.sink = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self.read()) is not None:
            yield chunk

    def read_to_its_end(self) -> None:
        """The caller has what it needs of the body (its logical end, such as `data: [DONE]`, came)
        and closes it: the connection is used again once the rest of the answer (its last chunk,
        which a server may send a moment later) has come, where closing it now would lose it."""
        self._drains = True

    async def aclose(self) -> None:
        if not self._is_closed:
            self._is_closed = True
            connection = self._connection
            if self._drains and not connection.is_complete and not connection.is_closed:
                self._pool._give_slot()
                self._pool._drain(self._key, connection)
                return
            self._pool._release(self._key, connection, reusable=connection.is_complete)

    def _done(self) -> None:
        if not self._is_closed:
            self._is_closed = True
            self._pool._release(self._key, self._connection, reusable=True)


class Http1Transport(httpx2.AsyncBaseTransport):
    """Plain-HTTP requests on this module's connections, at most `max_connections` at a time; any
    other URL on `fallback`."""

    def __init__(self, fallback: httpx2.AsyncBaseTransport, max_connections: int) -> None:
        self._fallback = fallback
        self._max_connections = max_connections
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._draining: set[_Connection] = set()
        self._slots: asyncio.Semaphore | None = None
        self._is_closed = False

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        url = request.url
        if url.scheme != "http":
            return await self._fallback.handle_async_request(request)
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        key = (url.host, url.port or 80)
        body = await self.open(key, _serialized(request, await request.aread()), timeouts)
        return body.as_response(request)

    async def open(
        self, key: tuple[str, int], request_bytes: bytes, timeouts: dict[str, float | None]
    ) -> Body:
        """Send a request already serialized (head and body) to `key` (host, port) on one of this
        transport's connections: the body of its answer, once the answer's head has come (its status
        and headers are the connection's). What a streamed upstream call uses without httpx's request
        and response objects around it (worker/runner/upstream.py); httpx's faults, as ever."""
        await self._take_slot(timeouts.get("pool"))
        try:
            connection = await self._send(key, request_bytes, timeouts)
        except BaseException:
            self._give_slot()
            raise
        try:
            encoding = _header(connection.headers, b"content-encoding")
            return Body(self, key, connection, timeouts.get("read"), encoding)
        except BaseException:
            self._release(key, connection, reusable=False)
            raise

    async def _send(
        self, key: tuple[str, int], request_bytes: bytes, timeouts: dict[str, float | None]
    ) -> _Connection:
        """The request sent, on an idle connection or a new one, and its answer's headers come."""
        while True:
            connection = self._idle_connection(key)
            reused = connection is not None
            if connection is None:
                connection = await self._connect(key, timeouts.get("connect"))
            connection.start(request_bytes)
            try:
                read_seconds = timeouts.get("read")
                if read_seconds is None:
                    await connection.headers_received()
                else:
                    try:
                        async with asyncio.timeout(read_seconds):
                            await connection.headers_received()
                    except TimeoutError:
                        raise httpx2.ReadTimeout(f"no answer came for {read_seconds:g} s") from None
            except BodyCutError:
                connection.close()
                if reused and not connection.got_bytes:  # closed while idle: a new connection
                    continue
                raise httpx2.RemoteProtocolError("the connection closed before an answer came") from None
            except BaseException:
                connection.close()
                raise
            return connection

    async def _connect(self, key: tuple[str, int], seconds: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        host, port = key
        try:
            async with asyncio.timeout(seconds):
                _, connection = await loop.create_connection(_Connection, host, port)
        except TimeoutError:
            raise httpx2.ConnectTimeout(f"no connection to {host}:{port} within {seconds:g} s") from None
        except OSError as exc:
            raise httpx2.ConnectError(str(exc) or type(exc).__name__) from exc
        return connection

    def _idle_connection(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        oldest = time.monotonic() - KEEPALIVE_SECONDS
        while idle:
            connection = idle.pop()
            if not connection.is_closed and connection.idle_since >= oldest:
                return connection
            connection.close()
        return None

    def _release(self, key: tuple[str, int], connection: _Connection, *, reusable: bool) -> None:
        self._give_slot()
        if reusable:
            self._keep(key, connection)
        else:
            connection.close()

    def _drain(self, key: tuple[str, int], connection: _Connection) -> None:
        """Kept once the rest of its answer has come (`Body.read_to_its_end`)."""
        self._draining = {other for other in self._draining if not other.is_closed}  # timed out
        self._draining.add(connection)

        def drained() -> None:
            self._draining.discard(connection)
            self._keep(key, connection)

        connection.drain(drained, DRAIN_SECONDS)

    def _keep(self, key: tuple[str, int], connection: _Connection) -> None:
        """An answered connection, kept for the next request unless either side said it ends (or
        the transport is closed)."""
        if connection.keeps_alive and not connection.is_closed and not self._is_closed:
            connection.idle_since = time.monotonic()
            self._idle.setdefault(key, []).append(connection)
        else:
            connection.close()

    async def _take_slot(self, seconds: float | None) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max_connections)
        if not self._slots.locked():
            await self._slots.acquire()  # at once
            return
        try:
            async with asyncio.timeout(seconds):
                await self._slots.acquire()
        except TimeoutError:
            raise httpx2.PoolTimeout(f"no connection was free within {seconds:g} s") from None

    def _give_slot(self) -> None:
        assert self._slots is not None
        self._slots.release()

    async def aclose(self) -> None:
        self._is_closed = True
        for connection in [*self._draining, *(c for idle in self._idle.values() for c in idle)]:
            connection.close()
        self._draining.clear()
        self._idle.clear()
        await self._fallback.aclose()


def _serialized(request: httpx2.Request, content: bytes) -> bytes:
    """The request's head and body, as sent."""
    target = request.url.raw_path
    lines = [b"%s %s HTTP/1.1" % (request.method.encode(), target)]
    lines += [name + b": " + value for name, value in request.headers.raw]
    return b"\r\n".join(lines) + b"\r\n\r\n" + content


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return ""
