"""Validating create requests and normalising their input (PROTOCOL.md §2, §3)."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import Response

from tests.support.schema import validate_response
from worker.errors import InvalidRequestError, MissingParameterError, UnsupportedParameterError
from worker.protocol.items import check_tool_outputs, normalize_input
from worker.protocol.request import parse_create_request
from worker.protocol.response import Status, build_response, failed, finished

BASE = {"model": "m", "input": "hi"}


@pytest.mark.parametrize(
    ("extra", "error", "param"),
    [
        ({"model": None}, MissingParameterError, "model"),
        ({"input": None}, MissingParameterError, "input"),
        ({"temperature": 2.5}, InvalidRequestError, "temperature"),
        ({"top_p": -0.1}, InvalidRequestError, "top_p"),
        ({"top_logprobs": 21}, InvalidRequestError, "top_logprobs"),
        ({"max_output_tokens": 0}, InvalidRequestError, "max_output_tokens"),
        ({"stream": "yes"}, InvalidRequestError, "stream"),
        ({"metadata": {"k" * 65: "v"}}, InvalidRequestError, "metadata"),
        ({"metadata": {"k": 1}}, InvalidRequestError, "metadata.k"),
        ({"truncation": "sometimes"}, InvalidRequestError, "truncation"),
        ({"background": True, "store": False}, UnsupportedParameterError, "background"),
        ({"conversation": 7}, InvalidRequestError, "conversation"),
        (
            {"conversation": "conv_1", "previous_response_id": "resp_1"},
            InvalidRequestError,
            "previous_response_id",
        ),
        ({"prompt": {"id": "pmpt_1"}}, UnsupportedParameterError, "prompt"),
    ],
)
def test_invalid_requests_name_their_param(extra: dict[str, Any], error: type[Exception], param: str) -> None:
    """Each invalid create body raises the domain error that names the offending parameter."""
    with pytest.raises(error) as caught:
        parse_create_request({**BASE, **extra})
    assert isinstance(caught.value, InvalidRequestError)
    assert caught.value.param == param


def test_nulls_and_unknown_keys_are_accepted() -> None:
    """Explicit nulls for optional params and keys respool does not know are accepted (PROTOCOL.md §2, §10)."""
    request = parse_create_request({**BASE, "temperature": None, "tools": None, "some_new_field": {"x": 1}})
    assert request.temperature is None
    assert request.model_extra == {"some_new_field": {"x": 1}}


def test_a_non_object_body_is_rejected() -> None:
    """A JSON body that is not an object is a 400."""
    with pytest.raises(InvalidRequestError):
        parse_create_request(["model", "m"])


def test_string_input_is_one_user_message_with_an_id() -> None:
    """String input becomes a user message with one input_text part and a msg_ id (PROTOCOL.md §3)."""
    [item] = normalize_input("hello")
    assert item["id"].startswith("msg_")
    assert (item["type"], item["role"], item["content"]) == (
        "message",
        "user",
        [{"type": "input_text", "text": "hello"}],
    )


def test_items_keep_their_ids_and_get_missing_ones() -> None:
    """Items keep the ids a client gave and get fresh ones by type otherwise."""
    items = normalize_input(
        [
            {"role": "assistant", "content": "earlier", "id": "msg_given"},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        ]
    )
    assert items[0]["id"] == "msg_given"
    assert items[0]["content"] == [{"type": "output_text", "text": "earlier", "annotations": []}]
    assert items[1]["id"].startswith("fc_")
    assert items[2]["id"].startswith("fco_")


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"role": "user", "content": 5}, "input[0].content"),
        ({"role": "user", "content": [{"type": "output_text", "text": "x"}]}, "input[0].content[0].type"),
        ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[0].call_id"),
        ({"content": "no role"}, "input[0].type"),
        ({"type": "item_reference", "id": "msg_1"}, "input[0]"),
    ],
)
def test_malformed_items_name_their_param(item: dict[str, Any], param: str) -> None:
    """A malformed input item is a 400 that points at it."""
    with pytest.raises(InvalidRequestError) as caught:
        normalize_input([item])
    assert caught.value.param == param


def test_tool_outputs_need_an_earlier_call() -> None:
    """A function_call_output whose call_id matches no earlier function_call is rejected on `input[i]`."""
    items = normalize_input([{"type": "function_call_output", "call_id": "call_9", "output": "x"}])
    with pytest.raises(InvalidRequestError) as caught:
        check_tool_outputs(items, 0)
    assert caught.value.param == "input[0]"


CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "42"}
USER = {"role": "user", "content": "and now?"}


@pytest.mark.parametrize(
    "items",
    [
        [USER, CALL, USER],
        [USER, CALL],
        [USER, CALL, {**CALL, "call_id": "call_2"}, {**OUTPUT, "call_id": "call_2"}, USER],
        [USER, CALL, {"role": "system", "content": "be brief"}, OUTPUT],
    ],
    ids=["then-a-user-message", "at-the-end", "one-of-two-answered", "then-a-system-message"],
)
def test_a_call_without_its_output_is_refused_as_openai_does(items: list[dict[str, Any]]) -> None:
    """A function_call with no output before the next input message (or the end) is OpenAI's 400, naming the call."""
    with pytest.raises(InvalidRequestError) as caught:
        check_tool_outputs(normalize_input(items), 0)
    assert (caught.value.message, caught.value.param, caught.value.code) == (
        "No tool output found for function call call_1.",
        "input",
        None,
    )


@pytest.mark.parametrize(
    "items",
    [
        [USER, CALL, OUTPUT, USER],
        [USER, CALL, {**CALL, "call_id": "call_2"}, {**OUTPUT, "call_id": "call_2"}, OUTPUT],
        [USER, CALL, {"role": "assistant", "content": "checking"}, OUTPUT],
    ],
    ids=["answered", "parallel-answered-out-of-order", "assistant-text-between"],
)
def test_calls_answered_before_the_next_input_message_are_accepted(items: list[dict[str, Any]]) -> None:
    """Calls whose outputs come (in any order, assistant items between) before the next input message pass."""
    check_tool_outputs(normalize_input(items), 0)


@pytest.mark.parametrize("status", list(Status))
def test_responses_are_valid_in_every_status(status: Status) -> None:
    """A Response in any status passes the Open Responses schema and parses as the SDK's Response."""
    request = parse_create_request({**BASE, "metadata": {"a": "b"}, "tools": [], "temperature": 0.2})
    response = build_response(request, "resp_1", 1_700_000_000, Status.QUEUED)
    if status is Status.FAILED:
        response = failed(response, "boom", 1_700_000_001)
    elif status in (Status.COMPLETED, Status.INCOMPLETE, Status.CANCELLED):
        response = finished(response, status, 1_700_000_001)
    else:
        response = {**response, "status": str(status)}
    validate_response(response)
    parsed = Response.model_validate(response)
    assert parsed.status == status
    assert (parsed.completed_at is not None) == (status is Status.COMPLETED)


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [{"type": "function", "name": "f"}]},
        {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": None}]},
        {"text": {"format": {"type": "json_schema", "name": "A", "schema": {"type": "object"}}}},
        {
            "text": {
                "format": {"type": "json_schema", "name": "A", "schema": {}, "strict": None},
                "verbosity": "low",
            }
        },
        {"text": {"format": {"type": "json_object"}}},
        {"text": {"verbosity": "high"}},
    ],
    ids=[
        "bare function tool",
        "tool with null strict",
        "json_schema",
        "json_schema null strict",
        "json_object",
        "verbosity only",
    ],
)
def test_echoed_tools_and_formats_are_valid(extra: dict[str, Any]) -> None:
    """Tools and text formats given with their optional fields left out are echoed valid for the schema and the SDK."""
    response = build_response(parse_create_request({**BASE, **extra}), "resp_1", 1_700_000_000, Status.QUEUED)
    validate_response(response)
    Response.model_validate(response, strict=True)
    assert [tool["name"] for tool in response["tools"]] == [tool["name"] for tool in extra.get("tools", [])]
