"""Slow clients (issue 7): a body that does not arrive within RESPOOL_BODY_TIMEOUT_SECONDS is a 408
and its connection is closed; a stream whose client stops reading is given up after
RESPOOL_SSE_WRITE_TIMEOUT_SECONDS, as if the client had left. Raw sockets play the clients: no
HTTP library stalls on purpose."""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import openai
import orjson
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from tests.conftest import make_sdk, own_stack
from tests.support.quotas import live_stream_slots
from tests.support.stack import Servers, Stack, wait_for
from tests.support.upstream_process import ScriptedUpstream

pytestmark = [pytest.mark.integration, pytest.mark.once]

KEY = "sk-slow-clients"
OWNER = f"slow-{uuid.uuid4().hex[:8]}"  # this session's own, so its stream slots are its own
SOCKET_TIMEOUT = 60.0  # a connection the API failed to close shows up as socket.timeout
# Bigger than what the kernel buffers for a client that never reads (about 3 MB on loopback), and
# slow enough that a foreground response is still generating when its stream is given up.
LONG_STREAM = {"text": " ".join(["x" * 10_000] * 1500), "delay": 0.02}


@pytest.fixture(scope="module")
def slow(backing: Servers, upstream: ScriptedUpstream, session_dir: Path, stack: Stack) -> Iterator[Stack]:
    """An API with short body and write timeouts and a stream limit, and a worker."""
    running = own_stack(
        backing,
        session_dir,
        "slow-clients",
        RESPOOL_API_KEYS=f"{KEY}:{OWNER}",
        RESPOOL_BODY_TIMEOUT_SECONDS="1",
        RESPOOL_SSE_WRITE_TIMEOUT_SECONDS="2",
        RESPOOL_MAX_STREAMS_PER_KEY="4",
        RESPOOL_UPSTREAM_URL=upstream.url,
    )
    running.start_api()
    running.start_worker()
    yield running
    running.stop_all()


@pytest.fixture
def sdk(slow: Stack) -> Iterator[openai.OpenAI]:
    with make_sdk(slow.url, KEY) as client:
        yield client


def _connect(url: str, receive_buffer: int | None = None) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.socket()
    if receive_buffer is not None:  # before connecting, so the window it offers stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(SOCKET_TIMEOUT)
    sock.connect((parts.hostname, parts.port))
    return sock


def _head(length: int) -> bytes:
    return (
        "POST /v1/responses HTTP/1.1\r\nHost: respool\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def _read_to_end(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (a reset counts as closing it)."""
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def _trickle(sock: socket.socket, rest: bytes, stop: threading.Event) -> None:
    """Send `rest` a byte every 0.2 s, until stopped or the server has closed."""
    for index in range(len(rest)):
        if stop.wait(0.2):
            return
        try:
            sock.send(rest[index : index + 1])
        except OSError:
            return


def _responses_of(backing: Servers, model: str) -> dict[str, str]:
    engine = create_engine(backing.database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT id, status FROM response WHERE model = :m"), {"m": model})
            return {row.id: row.status for row in rows}
    finally:
        engine.dispose()


@pytest.mark.parametrize("pace", ["stalls", "trickles"])
def test_a_body_that_is_not_in_on_time_is_408_and_its_connection_closed(
    slow: Stack, backing: Servers, model: str, pace: str
) -> None:
    """A client that sends its headers and then stalls, or trickles its body a byte at a time, gets
    a 408 request_timeout in OpenAI's envelope, then the connection closes; nothing is recorded."""
    body = orjson.dumps({"model": model, "input": "x" * 1000, "background": True})
    stop = threading.Event()
    with _connect(slow.url) as sock:
        sock.sendall(_head(len(body)) + body[:100])
        if pace == "trickles":
            threading.Thread(target=_trickle, args=(sock, body[100:], stop), daemon=True).start()
        try:
            answer = _read_to_end(sock)  # returns only once the API has closed the connection
        finally:
            stop.set()
    head, _, payload = answer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in header_lines)
    assert status_line.split()[1] == "408", answer[:500]
    assert headers["connection"] == "close"
    error = orjson.loads(payload)["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", None)
    assert error["code"] == "request_timeout"
    assert "RESPOOL_BODY_TIMEOUT_SECONDS" in error["message"]
    assert _responses_of(backing, model) == {}


@pytest.mark.parametrize("mode", ["foreground", "background"])
def test_a_stream_whose_client_stops_reading_is_given_up(
    slow: Stack, backing: Servers, upstream: ScriptedUpstream, sdk: openai.OpenAI, model: str, mode: str
) -> None:
    """A client that never reads its stream (the API's writes block) is given up on: its stream
    slot comes back and the connection is closed before the stream's end; a foreground response is
    abandoned (cancelled) as on a disconnect, a background one runs on and can be resumed."""
    upstream.script(model, LONG_STREAM)
    body = orjson.dumps({"model": model, "input": "x", "stream": True, "background": mode == "background"})
    with _connect(slow.url, receive_buffer=4096) as sock:
        sock.sendall(_head(len(body)) + body)  # and never reads, for now
        (response_id,) = wait_for(lambda: _responses_of(backing, model), what="the response to be recorded")
        wait_for(
            lambda: live_stream_slots(backing.redis_url, OWNER) == 0,
            timeout=120,
            what="the stream to be given up and its slot given back",
        )
        if mode == "foreground":
            wait_for(
                lambda: _responses_of(backing, model)[response_id] == "cancelled",
                timeout=60,
                what="the abandoned response to be cancelled",
            )
        else:  # running on: its row is live, and a poll says a worker holds it
            assert _responses_of(backing, model)[response_id] in {"queued", "in_progress"}
            assert sdk.responses.retrieve(response_id).status == "in_progress"
        relayed = _read_to_end(sock)  # now it reads: what was relayed before the API gave up, then the close
    assert relayed.startswith(b"HTTP/1.1 200")
    assert b"response.created" in relayed
    assert b"response.completed" not in relayed and b"response.failed" not in relayed
    if mode == "background":  # nothing was lost: its events can be read again from any point
        with sdk.responses.retrieve(response_id, stream=True, starting_after=1) as resumed:
            assert next(iter(resumed)).sequence_number == 2
        assert sdk.responses.cancel(response_id).status == "cancelled"  # no need to let it run its course
