"""An event stream's live events written straight to its connection from the tailer's read
(api/sse.py, `EventStream._through`; worker/service/tailer.py, `Passthrough`), under uvicorn itself
on httptools' protocol as the API serves: a real server on loopback, a real tailer on a real
Redis, a real HTTP client reading the SSE (issue 20)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
import uvicorn
from redis.asyncio import Redis
from starlette.types import Receive, Scope, Send

from api.sse import SERVER_SEND, EventStream, sse_response
from tests.support.stack import Servers
from worker.connections import blocking_client
from worker.events.stream import Event, encode, entry_id
from worker.keys import events_key
from worker.service.tailer import Passthrough, Tailer

pytestmark = pytest.mark.integration


async def _append(redis: Redis, response_id: str, sequence_number: int, kind: str) -> None:
    event = encode({"type": kind, "delta": "x"}, sequence_number)
    await redis.xadd(
        events_key(response_id), {"t": event.type, "d": event.data}, id=entry_id(sequence_number)
    )


@contextlib.asynccontextmanager
async def _served(tailer: Tailer, response_id: str) -> AsyncIterator[int]:
    """A uvicorn server relaying the response's stream as the API does (the server's own `send`
    in the scope, a passthrough handed to the follow and the relay); its port."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        scope[SERVER_SEND] = send
        through = Passthrough()
        events = tailer.follow(response_id, passthrough=through)
        await sse_response(events, -1, write_timeout_seconds=5, passthrough=through)(scope, receive, send)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http="httptools", lifespan="off", log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(10):
            while not server.started:  # noqa: ASYNC110 (uvicorn tells it by this flag alone)
                await asyncio.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await serving


async def test_a_relayed_streams_live_events_are_written_through_whole_and_in_order(
    backing: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replayed first event goes by the relay's task; each live one is written through, as a
    chunk the client reads as its frame, in order; the terminal event by the task, ending the
    answer."""
    through: list[int] = []
    write = EventStream._through

    def spied(
        self: EventStream, cycle: uvicorn.protocols.http.httptools_impl.RequestResponseCycle, event: Event
    ) -> bool:
        written = write(self, cycle, event)
        if written:
            through.append(event.sequence_number)
        return written

    monkeypatch.setattr(EventStream, "_through", spied)
    redis = Redis.from_url(backing.redis_url)
    tailer = Tailer(redis, blocking_client(backing.redis_url, 10, 5), batch_seconds=0.0)
    await tailer.start()
    response_id = f"resp_{uuid.uuid4().hex}"
    await _append(redis, response_id, 0, "response.created")
    got: list[tuple[str, int]] = []
    try:
        async with (
            _served(tailer, response_id) as port,
            httpx.AsyncClient(timeout=10) as client,
            client.stream("GET", f"http://127.0.0.1:{port}/") as reply,
        ):
            assert reply.headers["content-type"].startswith("text/event-stream")
            lines = reply.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):
                    payload = orjson.loads(line[6:])
                    got.append((payload["type"], payload["sequence_number"]))
                    if payload["sequence_number"] == 0:
                        break
            for sequence_number in range(1, 6):
                await asyncio.sleep(0.05)  # the relay waits: the event passes through
                await _append(redis, response_id, sequence_number, "response.output_text.delta")
            await _append(redis, response_id, 6, "response.completed")
            async for line in lines:
                if line.startswith("data: "):
                    payload = orjson.loads(line[6:])
                    got.append((payload["type"], payload["sequence_number"]))
    finally:
        await tailer.stop()
        await redis.aclose()
    assert got == [
        ("response.created", 0),
        *(("response.output_text.delta", n) for n in range(1, 6)),
        ("response.completed", 6),
    ]
    assert through == [1, 2, 3, 4, 5]
