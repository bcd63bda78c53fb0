"""The upstream call over the worker's own client, on each of its two transports (plain HTTP's own,
worker/runner/http1.py, and aiohttp's, which takes TLS and proxies), against the real scripted
upstream over loopback: a body is read straight from the transport, bounded in its silences, cut
short or cancelled alike on both (issue 20; the unit tests in test_upstream.py read bodies through
httpx's mock transport, the other path)."""

from __future__ import annotations

import asyncio
import contextvars
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.upstream_process import ScriptedUpstream
from worker.errors import TransientUpstreamError, UpstreamError
from worker.routing import Route, UpstreamApi
from worker.runner import http1
from worker.runner import upstream as upstream_module
from worker.runner.upstream import CHAT_STREAM, RetryPolicy, create_client, stream_json

pytestmark = pytest.mark.integration

NO_RETRIES = RetryPolicy(retries=0)


def _scripted(upstream: ScriptedUpstream, script: dict[str, Any]) -> tuple[Route, dict[str, Any]]:
    model = f"aio-{uuid.uuid4().hex[:8]}"
    upstream.script(model, script)
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    return Route(model, UpstreamApi.CHAT, upstream.url), body


# Each test on plain HTTP's own transport, then on aiohttp's (`_read`'s client takes it).
_ON_HTTP1: contextvars.ContextVar[bool] = contextvars.ContextVar("on_http1", default=True)


@pytest.fixture(params=["http1", "aiohttp"], autouse=True)
def transport(request: pytest.FixtureRequest) -> Iterator[str]:
    token = _ON_HTTP1.set(request.param == "http1")
    yield str(request.param)
    _ON_HTTP1.reset(token)


async def _read(
    route: Route, body: dict[str, Any], got: list[dict[str, Any]], stall_seconds: float = 300.0
) -> None:
    """Every payload of the call into `got`, on the worker's own client (the `transport` fixture's)."""
    client = create_client(stall_seconds, 4, plain_http=_ON_HTTP1.get())
    try:
        async for chunk in stream_json(client, route, "/chat/completions", body, NO_RETRIES, CHAT_STREAM):
            got.append(chunk)
    finally:
        await client.aclose()


async def _words(route: Route, body: dict[str, Any], stall_seconds: float = 300.0) -> list[str]:
    got: list[dict[str, Any]] = []
    await _read(route, body, got, stall_seconds)
    words = [
        (choice.get("delta") or {}).get("content") for chunk in got for choice in chunk.get("choices") or []
    ]
    return [word for word in words if word]


async def test_a_body_is_read_from_the_transports_reader_whole(
    upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    """Every word arrives, in order, and the body was read from the transport's own reader (pushed
    by `http1.Body.push`, a chunk at a time, never read; aiohttp's `StreamReader`), not through
    httpx's byte stream, the other path."""
    taken: list[object] = []
    content_of = upstream_module._aiohttp_content

    def spied(reply: Any) -> Any:
        content = content_of(reply)
        taken.append(content)
        return content

    monkeypatch.setattr(upstream_module, "_aiohttp_content", spied)
    reads: list[int] = []
    read = http1.Body.read

    async def counted(self: http1.Body) -> bytes | None:
        reads.append(1)
        return await read(self)

    monkeypatch.setattr(http1.Body, "read", counted)
    pushed: list[bytes] = []
    push = http1.Body.push

    async def spied_push(self: http1.Body, feed: Callable[[bytes], bool]) -> bool:
        def fed(chunk: bytes) -> bool:
            pushed.append(chunk)
            return feed(chunk)

        return await push(self, fed)

    monkeypatch.setattr(http1.Body, "push", spied_push)
    route, body = _scripted(upstream, {"text": "one two three four five", "delay": 0.01})
    assert await _words(route, body) == ["one ", "two ", "three ", "four ", "five"]
    if transport == "http1":
        assert taken == [] and reads == [] and len(pushed) >= 5
    else:
        assert len(taken) == 1 and taken[0] is not None and reads == []


async def test_a_silence_past_the_bound_is_a_stall_and_a_steady_body_is_not(
    upstream: ScriptedUpstream,
) -> None:
    """Words 0.1 s apart for half a second arrive whole under a 0.3 s bound; headers then silence
    (the upstream hangs) is a stall, saying how long."""
    route, body = _scripted(upstream, {"text": "a b c d e", "delay": 0.1})
    assert await _words(route, body, stall_seconds=0.3) == ["a ", "b ", "c ", "d ", "e"]
    route, body = _scripted(upstream, {"hang": True})
    with pytest.raises(TransientUpstreamError, match=r"sent nothing for 0\.3 s"):
        await _words(route, body, stall_seconds=0.3)


async def test_a_body_cut_after_output_is_a_fault_said_as_such(upstream: ScriptedUpstream) -> None:
    """The connection closed after two frames, without the body's end: a transient fault (the
    caller decides: after output it is final), saying the answer was cut short."""
    route, body = _scripted(upstream, {"text": "a b c d e f", "drop_after": 2})
    got: list[dict[str, Any]] = []
    with pytest.raises(UpstreamError) as raised:
        await _read(route, body, got)
    assert got  # the frames before the cut came
    assert isinstance(raised.value, TransientUpstreamError)
    assert "cut its answer short (its connection closed mid-body)" in str(raised.value)


async def test_a_cancel_while_the_body_is_silent_is_a_cancel_and_leaves_no_timer(
    upstream: ScriptedUpstream,
) -> None:
    """A reader cancelled while it waits for the next chunk is cancelled (not taken for a stall),
    and the silence bound's timer goes with it."""
    route, body = _scripted(upstream, {"text": "a b", "delay": 5.0, "first_delay": 0.0})
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(_words(route, body, stall_seconds=1.0))
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    timers = [handle for handle in loop._scheduled if "_check" in repr(handle) and not handle.cancelled()]  # type: ignore[attr-defined]
    assert timers == []
