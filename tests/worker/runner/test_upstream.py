"""The upstream call's faults at the transport seam: what is retried, how far apart, and what is final.

An `httpx2.MockTransport` plays the upstream; the module's `sleep` is faked, since time is the one
thing these tests fake, and records every backoff the retry loop asked for.
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import httpx2
import orjson
import pytest

from worker.errors import UpstreamError
from worker.routing import Route, UpstreamApi
from worker.runner import http1, upstream
from worker.runner.upstream import (
    CHAT_STREAM,
    RESPONSES_STREAM,
    RetryPolicy,
    StreamKind,
    create_client,
    stream_json,
)
from worker.settings import Settings

ROUTE = Route("m", UpstreamApi.CHAT, "http://upstream.test/v1")
PAYLOADS = [{"n": 1}, {"n": 2}]
POLICY = RetryPolicy(retries=3, backoff_seconds=0.5, backoff_max_seconds=8.0)

# What the upstream does on one request: answer, or fail the way a network or server can.
type Answer = httpx2.Response | Exception

# Faults that leave nothing behind but the wish to try again, and the ones that will not go away.
TRANSIENT = (
    httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.ReadError, httpx2.ReadTimeout, httpx2.WriteError,
    httpx2.WriteTimeout, httpx2.PoolTimeout, httpx2.CloseError, httpx2.RemoteProtocolError,
    http1.BodyCutError,
)  # fmt: skip
FINAL = (
    httpx2.LocalProtocolError, httpx2.UnsupportedProtocol, httpx2.ProxyError, httpx2.DecodingError,
    httpx2.TooManyRedirects, httpx2.HTTPStatusError, httpx2.SSEError,
)  # fmt: skip
# The abstract ones, never raised as such.
BASES = (
    httpx2.HTTPError, httpx2.RequestError, httpx2.TransportError, httpx2.TimeoutException,
    httpx2.NetworkError, httpx2.ProtocolError,
)  # fmt: skip


def sse(*payloads: object) -> bytes:
    return b"".join(b"data: " + orjson.dumps(payload) + b"\n\n" for payload in payloads) + b"data: [DONE]\n\n"


def ok(*payloads: object) -> httpx2.Response:
    return httpx2.Response(
        200, content=sse(*(payloads or PAYLOADS)), headers={"content-type": "text/event-stream"}
    )


def refusal(status: int, message: str = "go away", headers: dict[str, str] | None = None) -> httpx2.Response:
    return httpx2.Response(status, json={"error": {"message": message, "type": "x"}}, headers=headers)


class CutStream(httpx2.AsyncByteStream):
    """A body that sends `body`, then fails with `fault`: a connection lost mid-stream."""

    def __init__(self, body: bytes, fault: Exception) -> None:
        self.body, self.fault = body, fault

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.body
        raise self.fault


class Upstream:
    """Answers requests from a list, the last answer repeating; counts what it was sent."""

    def __init__(self, *answers: Answer) -> None:
        self.answers = list(answers)
        self.requests: list[httpx2.Request] = []

    async def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        answer = self.answers[min(len(self.requests), len(self.answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.fixture
def delays(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every backoff the retry loop asked for, in seconds, with no time passing."""
    asked: list[float] = []

    async def record(seconds: float) -> None:
        asked.append(seconds)

    monkeypatch.setattr(upstream, "sleep", record)
    return asked


def client_for(fake: Upstream, stall_seconds: float = 300.0) -> httpx2.AsyncClient:
    return create_client(stall_seconds, 4, transport=httpx2.MockTransport(fake))


async def collect(fake: Upstream, policy: RetryPolicy = POLICY, stall_seconds: float = 300.0) -> list[Any]:
    async with client_for(fake, stall_seconds) as client:
        return [payload async for payload in stream_json(client, ROUTE, "/chat/completions", {}, policy)]


async def fail(fake: Upstream, policy: RetryPolicy = POLICY, stall_seconds: float = 300.0) -> UpstreamError:
    with pytest.raises(UpstreamError) as failure:
        await collect(fake, policy, stall_seconds)
    return failure.value


@pytest.mark.parametrize(
    "fault",
    [
        refusal(429, "slow down"),
        refusal(500, "oops"),
        refusal(502, "bad gateway"),
        refusal(503, "overloaded"),
        refusal(408, "timeout"),
        httpx2.ConnectError("refused"),
        httpx2.ConnectTimeout("no answer"),
        httpx2.ReadError("reset by peer"),
        httpx2.RemoteProtocolError("disconnected without a response"),
        httpx2.ReadTimeout("stalled"),
    ],
    ids=repr,
)
async def test_a_transient_fault_before_output_is_retried(delays: list[float], fault: Answer) -> None:
    """429, 408, 5xx, connection errors and stalls before any payload are retried, and the payloads arrive once."""
    fake = Upstream(fault, ok())
    assert await collect(fake) == PAYLOADS
    assert len(fake.requests) == 2
    assert len(delays) == 1


async def test_several_faults_in_a_row_are_retried_until_one_answers(delays: list[float]) -> None:
    """Faults of different kinds, one after another, are each retried until the upstream answers."""
    fake = Upstream(refusal(429), httpx2.ConnectError("refused"), refusal(503), ok())
    assert await collect(fake) == PAYLOADS
    assert len(fake.requests) == 4
    assert len(delays) == 3


async def test_a_retry_sends_the_same_request_again(delays: list[float]) -> None:
    """Every attempt carries the same body and headers as the first."""
    fake = Upstream(refusal(503), ok())
    async with client_for(fake) as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        assert [p async for p in stream_json(client, ROUTE, "/chat/completions", body)] == PAYLOADS
    first, second = fake.requests
    assert (second.url, second.headers, second.content) == (first.url, first.headers, first.content)
    assert orjson.loads(second.content) == body


def http_date(offset: timedelta) -> str:
    return format_datetime(datetime.now(UTC) + offset, usegmt=True)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after": "2"}, 2.0),
        ({"retry-after": "0.25"}, 0.25),
        ({"retry-after-ms": "1500"}, 1.5),
        ({"retry-after-ms": "1500", "retry-after": "3"}, 1.5),
        ({"retry-after": "0"}, 0.0),
        ({"retry-after": "30"}, 8.0),
        ({"retry-after": http_date(timedelta(hours=1))}, 8.0),
        ({"retry-after": http_date(timedelta(hours=-1))}, 0.0),
    ],
)
async def test_retry_after_is_honoured_up_to_the_cap(
    delays: list[float], headers: dict[str, str], expected: float
) -> None:
    """The upstream's retry-after-ms or retry-after (seconds or HTTP date) sets the wait, bounded by the cap."""
    fake = Upstream(refusal(429, headers=headers), ok())
    assert await collect(fake) == PAYLOADS
    assert delays == [expected]


@pytest.mark.parametrize("value", ["soon", "", "nan", "-inf"])
async def test_an_unreadable_retry_after_falls_back_to_backoff(delays: list[float], value: str) -> None:
    """A retry-after that is neither seconds nor a date is ignored: the first backoff step applies."""
    fake = Upstream(refusal(503, headers={"retry-after": value}), ok())
    assert await collect(fake) == PAYLOADS
    assert len(delays) == 1
    assert 0.25 <= delays[0] <= 0.5


@pytest.mark.parametrize(
    ("retry", "low", "high"),
    [
        (1, 0.25, 0.5),
        (2, 0.5, 1.0),
        (3, 1.0, 2.0),
        (4, 2.0, 4.0),
        (5, 4.0, 8.0),
        (6, 4.0, 8.0),
        (500, 4.0, 8.0),
    ],
)
def test_backoff_doubles_with_equal_jitter_up_to_the_cap(retry: int, low: float, high: float) -> None:
    """Retry n waits between half and all of min(cap, base * 2^(n-1)), and not the same every time."""
    waits = [POLICY.delay(retry) for _ in range(200)]
    assert all(low <= wait <= high for wait in waits)
    assert len(set(waits)) > 1


async def test_backoff_between_attempts_grows_and_stays_bounded(delays: list[float]) -> None:
    """Each retry of a failing upstream waits within its doubling step, none longer than the cap."""
    policy = RetryPolicy(retries=6, backoff_seconds=0.5, backoff_max_seconds=3.0)
    await fail(Upstream(refusal(503)), policy)
    steps = [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert len(delays) == len(steps)
    assert all(step / 2 <= delay <= step for delay, step in zip(delays, steps, strict=True))


@pytest.mark.parametrize(
    "answer",
    [
        refusal(400, "context too long"),
        refusal(401, "bad key"),
        refusal(403, "forbidden"),
        refusal(404, "no such model"),
        refusal(422, "unprocessable"),
    ],
    ids=repr,
)
async def test_a_refusal_is_final_with_the_upstreams_message(delays: list[float], answer: Answer) -> None:
    """Any other 4xx is not retried: one request, and the error carries the status and the upstream's message."""
    assert isinstance(answer, httpx2.Response)
    fake = Upstream(answer, ok())
    error = await fail(fake)
    assert len(fake.requests) == 1
    assert delays == []
    assert error.status == answer.status_code
    assert error.message == f"the upstream answered {answer.status_code}: {answer.json()['error']['message']}"


@pytest.mark.parametrize(
    "body",
    [b'data: {"error": {"message": "model crashed"}}\n\n', b"data: not json\n\n", b"data: [1, 2]\n\n"],
)
async def test_a_bad_stream_before_output_is_final(delays: list[float], body: bytes) -> None:
    """An in-band error or a malformed line is the upstream's answer, not a network fault: no retry."""
    fake = Upstream(httpx2.Response(200, content=body), ok())
    await fail(fake)
    assert len(fake.requests) == 1
    assert delays == []


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        (httpx2.ReadError(""), "failed: ReadError"),
        (
            httpx2.RemoteProtocolError("incomplete chunked read"),
            "failed: RemoteProtocolError: incomplete chunked read",
        ),
        (httpx2.ReadTimeout("stalled"), "the upstream sent nothing for 300 s"),
    ],
)
async def test_a_fault_after_output_is_never_retried(
    delays: list[float], fault: Exception, message: str
) -> None:
    """Once a payload was yielded the output reached clients: a later fault ends the stream, with no second request."""
    fake = Upstream(httpx2.Response(200, stream=CutStream(b'data: {"n": 1}\n\n', fault)), ok())
    received: list[Any] = []

    async def receive() -> None:
        async with client_for(fake) as client:
            async for payload in stream_json(client, ROUTE, "/chat/completions", {}, POLICY):
                received.append(payload)

    with pytest.raises(UpstreamError) as failure:
        await receive()
    assert received == [{"n": 1}]
    assert len(fake.requests) == 1
    assert delays == []
    assert message in failure.value.message
    assert "gave up" not in failure.value.message


@pytest.mark.parametrize(
    ("fault", "message", "status"),
    [
        (refusal(503, "overloaded"), "the upstream answered 503: overloaded; gave up after 4 attempts", 503),
        (refusal(429, "slow down"), "the upstream answered 429: slow down; gave up after 4 attempts", 429),
        (
            httpx2.ReadTimeout("stalled"),
            "the upstream sent nothing for 300 s; gave up after 4 attempts",
            None,
        ),
        (
            httpx2.ConnectError("[Errno 111] Connection refused"),
            "could not connect to the upstream at http://upstream.test/v1/chat/completions: "
            "ConnectError: [Errno 111] Connection refused; gave up after 4 attempts",
            None,
        ),
        (
            httpx2.ConnectTimeout("no answer"),
            "could not connect to the upstream at http://upstream.test/v1/chat/completions within 10 s; "
            "gave up after 4 attempts",
            None,
        ),
    ],
)
async def test_when_retries_run_out_the_error_names_the_attempts_and_the_cause(
    delays: list[float], fault: Answer, message: str, status: int | None
) -> None:
    """An upstream that keeps failing gets retries + 1 requests; the error says how many and the last cause."""
    fake = Upstream(fault)
    error = await fail(fake)
    assert len(fake.requests) == POLICY.attempts == 4
    assert len(delays) == 3
    assert (error.message, error.status) == (message, status)


async def test_no_retries_means_one_attempt_and_the_cause_as_it_came(delays: list[float]) -> None:
    """With retries=0 a transient fault is final at once, its message unchanged."""
    fake = Upstream(refusal(503, "overloaded"), ok())
    error = await fail(fake, RetryPolicy(retries=0))
    assert len(fake.requests) == 1
    assert delays == []
    assert error.message == "the upstream answered 503: overloaded"


async def test_the_stall_message_names_the_configured_stall(delays: list[float]) -> None:
    """A stall says how long the upstream was silent: the client's read timeout, from the stall setting."""
    error = await fail(Upstream(httpx2.ReadTimeout("stalled")), RetryPolicy(retries=0), stall_seconds=1.5)
    assert error.message == "the upstream sent nothing for 1.5 s"


def test_the_client_times_out_on_silence_and_on_connect_separately() -> None:
    """The stall setting bounds each read (silence between bytes); the connect setting bounds connecting."""
    settings = Settings(upstream_stall_seconds=7, upstream_connect_seconds=3)
    client = create_client(
        settings.upstream_stall_seconds, 1, connect_seconds=settings.upstream_connect_seconds
    )
    assert (client.timeout.read, client.timeout.connect) == (7, 3)


def test_the_retry_policy_comes_from_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """RESPOOL_UPSTREAM_* env vars set the retries and backoff; a tiny backoff is the testing switch."""
    monkeypatch.setenv("RESPOOL_UPSTREAM_RETRIES", "5")
    monkeypatch.setenv("RESPOOL_UPSTREAM_BACKOFF_SECONDS", "0.01")
    monkeypatch.setenv("RESPOOL_UPSTREAM_BACKOFF_MAX_SECONDS", "0.02")
    policy = RetryPolicy.from_settings(Settings())
    assert policy == RetryPolicy(retries=5, backoff_seconds=0.01, backoff_max_seconds=0.02)
    assert all(policy.delay(retry) <= 0.02 for retry in range(1, 10))


def test_the_defaults_are_three_retries_half_a_second_apart_capped_at_eight() -> None:
    """Unset, the settings give 3 retries from 0.5 s up to 8 s, a 300 s stall and a 10 s connect timeout."""
    settings = Settings()
    assert RetryPolicy.from_settings(settings) == RetryPolicy() == RetryPolicy(3, 0.5, 8.0)
    assert (settings.upstream_stall_seconds, settings.upstream_connect_seconds) == (300, 10)


async def test_cancelling_during_backoff_propagates_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel that arrives while waiting to retry ends the call with CancelledError, and no retry is sent."""
    waiting = asyncio.Event()

    async def wait_forever(seconds: float) -> None:
        waiting.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(upstream, "sleep", wait_forever)
    fake = Upstream(refusal(503), ok())
    task = asyncio.create_task(collect(fake))
    await waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(fake.requests) == 1


def every_httpx_error(kind: type[httpx2.HTTPError] = httpx2.HTTPError) -> set[type[httpx2.HTTPError]]:
    return {kind}.union(*(every_httpx_error(sub) for sub in kind.__subclasses__()))


def test_every_httpx_error_is_classified() -> None:
    """Each exception httpx can raise is listed here as transient or final, so a new one cannot slip by."""
    assert every_httpx_error() == {*TRANSIENT, *FINAL, *BASES}


def raised(kind: type[httpx2.HTTPError]) -> Exception:
    if kind is httpx2.HTTPStatusError:
        request = httpx2.Request("POST", "http://upstream.test")
        return kind("boom", request=request, response=httpx2.Response(500, request=request))
    return kind("boom")


@pytest.mark.parametrize("kind", [*TRANSIENT, *FINAL], ids=lambda kind: kind.__name__)
async def test_every_httpx_error_becomes_an_upstream_error(
    delays: list[float], kind: type[httpx2.HTTPError]
) -> None:
    """Any httpx exception ends as UpstreamError; only the transient ones are tried again."""
    fake = Upstream(raised(kind))
    error = await fail(fake)
    is_transient = kind in TRANSIENT
    assert len(fake.requests) == (POLICY.attempts if is_transient else 1)
    assert ("gave up after 4 attempts" in error.message) is is_transient


# --- what a well-formed request and a finished stream are ----------------------------------------


async def test_every_request_is_json_with_its_content_type() -> None:
    """The body is sent as JSON and says so (FastAPI servers read no body as JSON without it)."""
    fake = Upstream(ok())
    async with client_for(fake) as client:
        body = {"model": "m", "stream": True}
        assert [p async for p in stream_json(client, ROUTE, "/chat/completions", body)] == PAYLOADS
    sent = fake.requests[0]
    assert sent.headers["content-type"] == "application/json"
    assert sent.headers["accept"] == "text/event-stream"
    assert orjson.loads(sent.content) == body


def chat(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


ROLE, TEXT, FINISH = chat({"role": "assistant", "content": ""}), chat({"content": "Hi"}), chat({}, "stop")
USAGE = {
    "object": "chat.completion.chunk",
    "choices": [],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1},
}


def raw(body: bytes) -> httpx2.Response:
    return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})


def frames(*payloads: object, done: bool = True) -> bytes:
    body = b"".join(b"data: " + orjson.dumps(payload) + b"\n\n" for payload in payloads)
    return body + (b"data: [DONE]\n\n" if done else b"")


async def collect_chat(fake: Upstream, kind: StreamKind = CHAT_STREAM) -> list[Any]:
    async with client_for(fake) as client:
        return [p async for p in stream_json(client, ROUTE, "/chat/completions", {}, POLICY, kind)]


async def test_a_finished_chat_stream_yields_every_chunk_held_back_ones_included(delays: list[float]) -> None:
    """The role chunk held back until the first output is yielded before it; usage after the finish too."""
    fake = Upstream(raw(frames(ROLE, TEXT, FINISH, USAGE)))
    assert await collect_chat(fake) == [ROLE, TEXT, FINISH, USAGE]
    assert delays == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "the upstream ended its stream without a finish_reason"),
        (b": keepalive\n\n", "the upstream ended its stream without a finish_reason"),
        (frames(done=True), "the upstream sent [DONE] without a finish_reason"),
        (frames(ROLE, done=False), "the upstream ended its stream without a finish_reason"),
        (frames(ROLE, USAGE, done=True), "the upstream sent [DONE] without a finish_reason"),
    ],
    ids=["empty", "comments-only", "done-only", "role-then-eof", "role-usage-done"],
)
async def test_a_stream_that_ends_unfinished_before_output_is_retried(
    delays: list[float], body: bytes, message: str
) -> None:
    """An empty 200 stream (llama-cpp-python failing inside), or one with no output before it ends,
    is retried: nothing reached a client; what it held back is dropped."""
    fake = Upstream(raw(body), raw(frames(ROLE, TEXT, FINISH)))
    assert await collect_chat(fake) == [ROLE, TEXT, FINISH]
    assert len(fake.requests) == 2
    assert len(delays) == 1

    always = Upstream(raw(body))
    with pytest.raises(UpstreamError) as failure:
        await collect_chat(always)
    assert failure.value.message == f"{message}; gave up after 4 attempts"
    assert len(always.requests) == 4


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (frames(ROLE, TEXT, done=False), "the upstream ended its stream without a finish_reason"),
        (frames(ROLE, TEXT, USAGE, done=True), "the upstream sent [DONE] without a finish_reason"),
    ],
    ids=["eof", "done"],
)
async def test_a_stream_that_ends_unfinished_after_output_fails(
    delays: list[float], body: bytes, message: str
) -> None:
    """Once output was yielded, a stream that ends without a finish_reason is a failure that says so, not retried."""
    fake = Upstream(raw(body), raw(frames(ROLE, TEXT, FINISH)))
    received: list[Any] = []

    async def receive() -> None:
        async with client_for(fake) as client:
            async for payload in stream_json(client, ROUTE, "/chat/completions", {}, POLICY, CHAT_STREAM):
                received.append(payload)

    with pytest.raises(UpstreamError) as failure:
        await receive()
    assert received[:2] == [ROLE, TEXT]
    assert failure.value.message == message
    assert len(fake.requests) == 1
    assert delays == []


async def test_a_responses_stream_ends_only_at_a_terminal_event(delays: list[float]) -> None:
    """A Responses stream that stops after its lifecycle events is retried; one that ends at
    `response.completed` is finished."""
    created = {"type": "response.created", "response": {}}
    delta = {"type": "response.output_text.delta", "delta": "Hi"}
    completed = {"type": "response.completed", "response": {}}
    fake = Upstream(raw(frames(created, done=False)), raw(frames(created, delta, completed, done=False)))
    assert await collect_chat(fake, RESPONSES_STREAM) == [created, delta, completed]
    assert len(fake.requests) == 2

    cut = Upstream(raw(frames(created, delta, done=False)))
    with pytest.raises(UpstreamError, match="without a terminal event"):
        await collect_chat(cut, RESPONSES_STREAM)
    assert len(cut.requests) == 1


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (404, "model_not_found"),
        (401, "upstream_unauthorized"),
        (403, "upstream_forbidden"),
        (400, "server_error"),
    ],
)
async def test_a_refusal_says_what_it_was_in_its_code(delays: list[float], status: int, code: str) -> None:
    """The upstream's 404 is the model not found, 401/403 our key refused; other refusals are server errors."""
    error = await fail(Upstream(refusal(status, "nope")))
    assert (error.status, error.code) == (status, code)


class Chunked(httpx2.AsyncByteStream):
    """A body sent in chunks of `size` bytes, as a network may cut it."""

    def __init__(self, body: bytes, size: int) -> None:
        self.body, self.size = body, size

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for start in range(0, len(self.body), self.size):
            yield self.body[start : start + self.size]


# Every line ending the SSE spec allows, comments and other fields between, and a last line
# with no ending at all.
MIXED = (
    b'data: {"n":1}\r\ndata:{"n":2}\rdata: {"n":3}\n\n: a comment\nevent: x\r\n'
    b'data: {"n":4}\r\n\r\ndata: {"t":"a\xffb"}\n\ndata: [DONE]'
)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 16, len(MIXED)])
async def test_data_lines_are_read_however_the_body_is_cut(delays: list[float], size: int) -> None:
    """LF, CRLF and CR all end a line, wherever the chunks fall; bytes that are not UTF-8 become
    U+FFFD, as a text decoder would make them."""
    answer = httpx2.Response(200, stream=Chunked(MIXED, size), headers={"content-type": "text/event-stream"})
    got = await collect(Upstream(answer))
    assert got == [{"n": 1}, {"n": 2}, {"n": 3}, {"n": 4}, {"t": "a\ufffdb"}]


async def test_a_compressed_body_is_read_through_its_decoding(delays: list[float]) -> None:
    """An upstream (or a proxy before it) that gzips its event stream: the lines are the decoded ones."""
    body = gzip.compress(sse({"n": 1}, {"n": 2}))
    headers = {"content-type": "text/event-stream", "content-encoding": "gzip"}
    answer = httpx2.Response(200, stream=Chunked(body, 5), headers=headers)
    assert await collect(Upstream(answer)) == [{"n": 1}, {"n": 2}]


class Paced(httpx2.AsyncByteStream):
    """A body whose chunks come `gaps` seconds apart (real time: the stall bound is what is tested)."""

    def __init__(self, chunks: list[bytes], gaps: list[float]) -> None:
        self.chunks, self.gaps = chunks, gaps

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk, gap in zip(self.chunks, self.gaps, strict=True):
            await asyncio.sleep(gap)
            yield chunk


def _paced(gaps: list[float]) -> httpx2.Response:
    chunks = [b'data: {"n": %d}\n\n' % n for n in range(len(gaps) - 1)] + [b"data: [DONE]\n\n"]
    return httpx2.Response(200, stream=Paced(chunks, gaps), headers={"content-type": "text/event-stream"})


async def test_a_body_silent_past_the_stall_bound_is_a_stall_and_a_steady_one_is_not(
    delays: list[float],
) -> None:
    """Silence between chunks is bounded (0.3 s here), however long the body lasts: chunks 0.1 s
    apart for 0.6 s arrive whole; a silence of 1 s after the first payload that carries output is
    a stall, final at once (that output reached clients), saying how long."""
    assert await collect(Upstream(_paced([0.1] * 6)), stall_seconds=0.3) == [{"n": n} for n in range(5)]
    error = await fail(Upstream(_paced([0.0, 1.0, 0.0])), stall_seconds=0.3)
    assert "sent nothing for 0.3 s" in str(error)


async def test_a_cancel_while_the_body_is_silent_is_a_cancel(delays: list[float]) -> None:
    """A task cancelled while it waits for the next chunk is cancelled (not taken for a stall)."""
    task = asyncio.ensure_future(collect(Upstream(_paced([0.0, 5.0, 0.0])), stall_seconds=1.0))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
