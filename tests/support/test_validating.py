"""The validating transport: invalid answers are recorded, valid ones pass, and the client sees them unchanged."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support.validating import AsyncValidatingTransport, ValidatingTransport

EVENT_STREAM = {"content-type": "text/event-stream"}
URL = "http://respool.test/v1/responses"


def _response(**changes: Any) -> dict[str, Any]:
    """A valid completed Response object, with `changes` applied."""
    response = (
        dict.fromkeys(("previous_response_id", "instructions", "error", "reasoning", "max_output_tokens"))
        | dict.fromkeys(("max_tool_calls", "safety_identifier", "prompt_cache_key", "incomplete_details"))
        | dict(id="resp_1", object="response", created_at=1, completed_at=2, model="m", status="completed")
        | dict(tools=[], tool_choice="auto", truncation="disabled", parallel_tool_calls=True, output=[])
        | dict(text={"format": {"type": "text"}}, top_p=1.0, presence_penalty=0.0, frequency_penalty=0.0)
        | dict(top_logprobs=0, temperature=1.0, store=True, background=False, service_tier="default")
        | dict(metadata={}, usage=None)
    )
    return {**response, **changes}


def _text_delta(sequence_number: int, **changes: Any) -> dict[str, Any]:
    delta = {"item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": "Hi", "logprobs": []}
    return {"type": "response.output_text.delta", "sequence_number": sequence_number, **delta, **changes}


def _frame(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def _valid_stream() -> bytes:
    created = {"type": "response.created", "sequence_number": 0, "response": _response(status="in_progress")}
    return b": keepalive\n\n" + _frame(created) + _frame(_text_delta(1)) + b": keepalive\n\n"


def _serve(content: bytes, headers: dict[str, str]) -> httpx.MockTransport:
    return httpx.MockTransport(lambda request: httpx.Response(200, headers=headers, content=content))


def _read(transport: httpx.BaseTransport, chunk_size: int = 7) -> bytes:
    """The body as a client reads it, in small chunks so that frames and lines are split across them."""
    with httpx.Client(transport=transport) as http, http.stream("GET", URL) as answer:
        return b"".join(answer.iter_bytes(chunk_size))


@pytest.fixture
def failures() -> list[str]:
    return []


@pytest.fixture
def stream_check(failures: list[str]) -> Callable[[bytes], bytes]:
    return lambda body: _read(ValidatingTransport(_serve(body, EVENT_STREAM), failures))


def test_a_valid_stream_is_not_flagged(stream_check: Callable[[bytes], bytes], failures: list[str]) -> None:
    """A valid stream with comment heartbeats, even read in 7-byte pieces, records no failure."""
    stream_check(_valid_stream())
    assert failures == []


def test_the_client_receives_the_stream_unchanged(
    stream_check: Callable[[bytes], bytes], failures: list[str]
) -> None:
    """The client gets exactly the bytes sent, valid or not."""
    body = _valid_stream() + b"id: 3\ndata: {oops\n\n"
    assert stream_check(body) == body
    assert failures


BROKEN = {
    "a delta with an invalid logprob": (_frame(_text_delta(1, logprobs=[{"token": "Hi"}])), "logprob"),
    "an id: line": (b"id: 7\n" + _frame(_text_delta(1)), "`id:` line"),
    "an event with no data": (b"event: response.output_text.delta\n\n", "no `data:`"),
    "an unknown event type": (_frame(_text_delta(1, type="response.cancelled")), "response.cancelled"),
    "a gap in sequence numbers": (_frame(_text_delta(1)) + _frame(_text_delta(3)), "3 follows 1"),
    "a repeated sequence number": (_frame(_text_delta(1)) + _frame(_text_delta(1)), "1 follows 1"),
    "data that is not JSON": (b"data: {oops\n\n", "not JSON"),
    "a frame cut off at the end": (_frame(_text_delta(1))[:-1], "ends inside a frame"),
    "an event line naming another type": (
        b"event: response.refusal.delta\ndata: " + json.dumps(_text_delta(1)).encode() + b"\n\n",
        "names 'response.refusal.delta'",
    ),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_stream_is_flagged(
    stream_check: Callable[[bytes], bytes], failures: list[str], case: str
) -> None:
    """Each kind of broken event or frame is recorded, with a message that names the problem."""
    body, expected = BROKEN[case]
    stream_check(body)
    assert any(expected in failure for failure in failures), failures


def test_lines_may_end_in_cr_crlf_or_lf(stream_check: Callable[[bytes], bytes], failures: list[str]) -> None:
    """CR, CRLF and LF all end lines (PROTOCOL.md §5.3), even when a CRLF is split between chunks."""
    lines = _frame(_text_delta(1)).replace(b"\n", b"\r\n") + _frame(_text_delta(2)).replace(b"\n", b"\r")
    stream_check(lines)
    assert failures == []


def test_a_stream_left_early_is_not_flagged(failures: list[str]) -> None:
    """A client that stops reading mid-frame does not make the unfinished frame a failure."""
    transport = ValidatingTransport(_serve(_valid_stream(), EVENT_STREAM), failures)
    with httpx.Client(transport=transport) as http, http.stream("GET", URL) as answer:
        next(answer.iter_bytes(20))
    assert failures == []


def _json_check(body: dict[str, Any], failures: list[str], path: str = "/v1/responses/resp_1") -> None:
    inner = httpx.MockTransport(lambda request: httpx.Response(200, json=body))
    with httpx.Client(transport=ValidatingTransport(inner, failures)) as http:
        http.get("http://respool.test" + path)


RESPONSES: dict[str, tuple[dict[str, Any], str | None]] = {
    "a valid Response": (_response(), None),
    "a deletion": ({"id": "resp_1", "object": "response", "deleted": True}, None),
    "a Response without its nullable fields": (
        {key: value for key, value in _response().items() if key != "instructions"},
        "'instructions' is a required property",
    ),
    "a Response of an unknown status": (_response(status="done"), "status"),
}


@pytest.mark.parametrize("case", RESPONSES)
def test_json_responses_are_checked(failures: list[str], case: str) -> None:
    """A Response object is checked against the schema and the SDK; a deletion is not a Response."""
    body, expected = RESPONSES[case]
    _json_check(body, failures)
    if expected is None:
        assert failures == []
    else:
        assert any(expected in failure for failure in failures), failures


def test_input_items_need_ids(failures: list[str]) -> None:
    """An input_items page with an item without an id is flagged (PROTOCOL.md §5.1)."""
    page = {"object": "list", "data": [{"type": "message", "role": "user", "content": []}], "has_more": False}
    _json_check(page, failures, path="/v1/responses/resp_1/input_items")
    assert any("input item 0 has no id" in failure for failure in failures)


async def test_the_async_transport_checks_streams(failures: list[str]) -> None:
    """The async transport records an invalid event and passes the bytes on unchanged."""
    body = _valid_stream() + _frame(_text_delta(2, logprobs=[{"token": "Hi"}]))
    transport = AsyncValidatingTransport(httpx.MockTransport(_serve(body, EVENT_STREAM).handler), failures)
    async with httpx.AsyncClient(transport=transport) as http, http.stream("GET", URL) as answer:
        received = b"".join([chunk async for chunk in answer.aiter_bytes(5)])
    assert received == body
    assert any("logprob" in failure for failure in failures), failures


def test_a_recorded_failure_fails_the_test(pytester: pytest.Pytester) -> None:
    """A test whose client received an invalid event fails, through the autouse check in tests/conftest.py."""
    pytester.makepyfile(
        """
        import httpx

        from tests.conftest import wire_is_valid
        from tests.support.validating import ValidatingTransport

        def test_receives_a_broken_event():
            body = b'id: 1\\ndata: {"type": "response.output_text.delta", "sequence_number": 0}\\n\\n'
            inner = httpx.MockTransport(
                lambda request: httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)
            )
            with httpx.Client(transport=ValidatingTransport(inner)) as http:
                assert http.get("http://respool.test/v1/responses/resp_1?stream=true").content == body
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:asyncio")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*respool sent invalid output*", "*`id:` line*", "*item_id*"])
