"""The upstream key never comes back out of an upstream call: an upstream, or a proxy before it, that
quotes the key it was sent in an error has it cut out of the message and of the retry log (issue 7).

An `httpx2.MockTransport` plays the upstream, as in test_upstream.py.
"""

from __future__ import annotations

import logging

import httpx2
import orjson
import pytest

from worker.errors import UpstreamError, redact
from worker.routing import Route, UpstreamApi
from worker.runner.upstream import RetryPolicy, create_client, stream_json

KEY = "sk-upstream-key-0123456789"
ROUTE = Route("m", UpstreamApi.CHAT, "http://upstream.test/v1", api_key_env="REDACTION_TEST_KEY")


def _quoting(status: int, body: bytes) -> httpx2.MockTransport:
    """An upstream answering `body` (with `{key}` filled in from the request) with `status`."""

    def answer(request: httpx2.Request) -> httpx2.Response:
        sent = request.headers["authorization"].removeprefix("Bearer ").encode()
        return httpx2.Response(status, content=body.replace(b"{key}", sent))

    return httpx2.MockTransport(answer)


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (401, orjson.dumps({"error": {"message": "Incorrect API key provided: {key}."}})),
        (403, b"<html>forbidden for Bearer {key}</html>"),
        (503, orjson.dumps({"error": {"message": "overloaded ({key})"}})),
        (200, b'data: {"error": {"message": "key {key} expired"}}\n\n'),
        (200, b"data: not json, but {key}\n\n"),
    ],
)
async def test_a_key_quoted_back_is_redacted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, status: int, body: bytes
) -> None:
    """A refusal, a retried fault, an in-band error or a bad line quoting the key carries `[redacted]`
    instead, in the error and in the retry log alike; the key was sent all the same."""
    monkeypatch.setenv("REDACTION_TEST_KEY", KEY)
    policy = RetryPolicy(retries=1, backoff_seconds=0.0, backoff_max_seconds=0.0)
    caplog.set_level(logging.INFO, logger="respool.upstream")
    async with create_client(10.0, 2, transport=_quoting(status, body)) as client:
        with pytest.raises(UpstreamError) as caught:
            async for _ in stream_json(client, ROUTE, "/chat/completions", {}, policy):
                pass
    assert "[redacted]" in caught.value.message
    assert KEY not in str(caught.value) and KEY not in caught.value.message
    assert KEY not in caplog.text
    if status == 503:
        assert "attempt 1 failed" in caplog.text  # the retry was logged, redacted


def test_redact_cuts_every_occurrence_and_leaves_text_without_a_key() -> None:
    """Every occurrence of the secret goes; no secret (an upstream without a key) changes nothing."""
    assert redact(f"{KEY} and {KEY}", KEY) == "[redacted] and [redacted]"
    assert redact("nothing here", "") == "nothing here"
