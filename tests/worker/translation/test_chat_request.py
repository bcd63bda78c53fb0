"""Responses create request => Chat Completions body: every rule, and every refusal with its `param`."""

from __future__ import annotations

from typing import Any

import pytest

from worker.errors import InvalidRequestError, MissingParameterError, UnsupportedParameterError
from worker.translation.chat_request import check, includes_logprobs, to_chat_request
from worker.translation.chat_tools import CUSTOM_PARAMETERS

Item = dict[str, Any]
BASE = {"model": "up", "stream": True, "stream_options": {"include_usage": True}}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather.",
    "parameters": {"type": "object"},
}
TIME = {"type": "function", "name": "get_time", "parameters": None, "strict": None}
HOSTED = {"type": "web_search"}
NAMESPACE = {
    "type": "namespace",
    "name": "agents",
    "description": "Agents.",
    "tools": [{"type": "function", "name": "spawn"}, {"type": "custom", "name": "note"}],
}
PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
}


def message(role: str, *parts: Item) -> Item:
    return {"id": "msg_x", "type": "message", "role": role, "status": "completed", "content": list(parts)}


def text(value: str) -> Item:
    return {"type": "input_text", "text": value}


def output_text(value: str) -> Item:
    return {"type": "output_text", "text": value, "annotations": []}


def function_call(call_id: str, name: str, arguments: str = "{}") -> Item:
    return {"id": "fc_x", "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}


def call_output(call_id: str, output: Any) -> Item:
    return {"id": "fco_x", "type": "function_call_output", "call_id": call_id, "output": output}


def reasoning(*, content: list[str] | None = None, summary: tuple[str, ...] = ()) -> Item:
    item: Item = {
        "id": "rs_x",
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": s} for s in summary],
    }
    if content is not None:
        item["content"] = [{"type": "reasoning_text", "text": c} for c in content]
    return item


def tool_call(call_id: str, name: str, arguments: str = "{}") -> Item:
    """A chat assistant message's tool call."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_function(name: str, **extra: Any) -> Item:
    return {"type": "function", "function": {"name": name, **extra}}


HELLO = [message("user", text("Hi"))]
USER_HI = {"role": "user", "content": "Hi"}
LOOK = [
    text("Look:"),
    {"type": "input_image", "image_url": "https://x/cat.png", "detail": "high"},
    {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": None},
    {"type": "input_file", "file_data": "data:application/pdf;base64,JVBE", "filename": "a.pdf"},
    {"type": "input_file", "file_id": "file-123"},
]
LOOK_PARTS = [
    {"type": "text", "text": "Look:"},
    {"type": "image_url", "image_url": {"url": "https://x/cat.png", "detail": "high"}},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBE", "filename": "a.pdf"}},
    {"type": "file", "file": {"file_id": "file-123"}},
]
TURN = [
    message("assistant", output_text("Let me "), output_text("check.")),
    function_call("call_1", "get_weather", '{"city":"Paris"}'),
    function_call("call_2", "get_time"),
    call_output("call_1", "18C"),
    call_output("call_2", [text("12:00"), text(" UTC")]),
]
TURN_MESSAGES = [
    {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            tool_call("call_1", "get_weather", '{"city":"Paris"}'),
            tool_call("call_2", "get_time"),
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00 UTC"},
]
THINKING = reasoning(content=["Think", " hard."], summary=("Thought.",))
THOUGHT = {"reasoning_content": "Think hard.", "reasoning": "Think hard."}
SUMMARISED = {"reasoning_content": "First.\n\nSecond.", "reasoning": "First.\n\nSecond."}

# (id, instructions, input items, chat messages)
CONVERSATIONS = [
    ("user-text-part-becomes-string", None, HELLO, [USER_HI]),
    (
        "instructions-lead-as-system",
        "Be brief.",
        HELLO,
        [{"role": "system", "content": "Be brief."}, USER_HI],
    ),
    (
        "developer-and-system-become-system",
        None,
        [message("developer", text("Rules.")), message("system", text("More."))],
        [{"role": "system", "content": "Rules."}, {"role": "system", "content": "More."}],
    ),
    ("string-content-kept", None, [{"type": "message", "role": "user", "content": "Hi"}], [USER_HI]),
    ("message-without-type", None, [{"role": "user", "content": [text("Hi")]}], [USER_HI]),
    ("image-and-file-parts", None, [message("user", *LOOK)], [{"role": "user", "content": LOOK_PARTS}]),
    ("assistant-text-and-calls-merge", None, [*HELLO, *TURN], [USER_HI, *TURN_MESSAGES]),
    (
        "namespaced-and-custom-calls-by-their-chat-names",
        None,
        [
            {**function_call("call_1", "spawn", '{"task":"t"}'), "namespace": "agents"},
            {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch", "input": 'say "hi"'},
            call_output("call_1", "spawned"),
            {"type": "custom_tool_call_output", "call_id": "call_2", "output": "patched"},
        ],
        [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    tool_call("call_1", "agents__spawn", '{"task":"t"}'),
                    tool_call("call_2", "apply_patch", '{"input":"say \\"hi\\""}'),
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "spawned"},
            {"role": "tool", "tool_call_id": "call_2", "content": "patched"},
        ],
    ),
    (
        "call-without-text-has-empty-content",
        None,
        [function_call("call_1", "get_time")],
        [{"role": "assistant", "content": "", "tool_calls": [tool_call("call_1", "get_time")]}],
    ),
    (
        "refusal-replayed-as-content",
        None,
        [message("assistant", output_text("Sure. "), {"type": "refusal", "refusal": "But not that."})],
        [{"role": "assistant", "content": "Sure. But not that."}],
    ),
    (
        "reasoning-text-attached-to-next-assistant",
        None,
        [*HELLO, THINKING, message("assistant", output_text("42"))],
        [USER_HI, {"role": "assistant", "content": "42", **THOUGHT}],
    ),
    (
        "reasoning-summary-attached-to-tool-call",
        None,
        [reasoning(summary=("First.", "Second.")), function_call("call_1", "get_time")],
        [{"role": "assistant", "content": "", "tool_calls": [tool_call("call_1", "get_time")], **SUMMARISED}],
    ),
    (
        "encrypted-only-reasoning-adds-nothing",
        None,
        [{**reasoning(), "encrypted_content": "gAAAA"}, message("assistant", output_text("ok"))],
        [{"role": "assistant", "content": "ok"}],
    ),
    (
        "assistant-turns-split-by-user",
        None,
        [message("assistant", output_text("a")), *HELLO, message("assistant", output_text("b"))],
        [{"role": "assistant", "content": "a"}, USER_HI, {"role": "assistant", "content": "b"}],
    ),
]


@pytest.mark.parametrize(
    ("instructions", "items", "expected"), [pytest.param(*case, id=name) for name, *case in CONVERSATIONS]
)
def test_conversation_becomes_messages(
    instructions: str | None, items: list[Item], expected: list[Item]
) -> None:
    """Every input item kind reaches the upstream as the chat message a chat template renders."""
    assert to_chat_request({"instructions": instructions}, items, "up")["messages"] == expected


LOGPROBS = ["message.output_text.logprobs"]
OWNED = {
    "model": "client-model",
    "metadata": {"k": "v"},
    "store": False,
    "background": True,
    "previous_response_id": "resp_1",
    "stream": False,
    "stream_options": {"include_obfuscation": False},
    "include": ["reasoning.encrypted_content", "message.input_image.image_url"],
    "truncation": "auto",
    "service_tier": "flex",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "max_tool_calls": 3,
    "a_future_parameter": 1,
    **dict.fromkeys(("prompt", "conversation", "moderation")),
}
ONLY_TIME = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
SCHEMA_FORMAT = {"type": "json_schema", "name": "a", "schema": {"type": "object"}, "strict": True}
DESCRIBED_FORMAT = {**SCHEMA_FORMAT, "schema": {}, "description": "An answer.", "strict": None}
SAMPLING = {"temperature": 0.2, "top_p": 0.9, "presence_penalty": 0.5, "frequency_penalty": 0.1}

# (id, Responses request, the Chat Completions keys it adds)
PARAMETERS = [
    ("nothing-extra", {}, {}),
    (
        "function-tools",
        {"tools": [WEATHER, TIME]},
        {
            "tools": [
                chat_function("get_weather", description="Weather.", parameters={"type": "object"}),
                chat_function("get_time"),
            ]
        },
    ),
    (
        "tool-choice-string-and-parallel",
        {"tools": [TIME], "tool_choice": "required", "parallel_tool_calls": False},
        {"tools": [chat_function("get_time")], "tool_choice": "required", "parallel_tool_calls": False},
    ),
    (
        "tool-choice-named-function",
        {"tools": [TIME], "tool_choice": {"type": "function", "name": "get_time"}},
        {
            "tools": [chat_function("get_time")],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        },
    ),
    (
        "allowed-tools-restrict-the-list",
        {"tools": [WEATHER, TIME], "tool_choice": ONLY_TIME},
        {"tools": [chat_function("get_time")], "tool_choice": "required"},
    ),
    (
        "server-side-tools-not-offered",
        {"tools": [HOSTED, TIME, {"type": "mcp", "server_label": "s"}, {"type": "file_search"}]},
        {"tools": [chat_function("get_time")]},
    ),
    ("only-server-side-tools", {"tools": [HOSTED], "tool_choice": "auto"}, {}),
    (
        "custom-tool-as-a-function-of-one-string",
        {"tools": [PATCH], "tool_choice": {"type": "custom", "name": "apply_patch"}},
        {
            "tools": [
                chat_function(
                    "apply_patch",
                    description="Edit files.\nIts input follows this lark:\nstart: /.+/",
                    parameters=CUSTOM_PARAMETERS,
                )
            ],
            "tool_choice": {"type": "function", "function": {"name": "apply_patch"}},
        },
    ),
    (
        "namespace-members-by-prefixed-names",
        {"tools": [NAMESPACE, TIME]},
        {
            "tools": [
                chat_function("agents__spawn"),
                chat_function("agents__note", parameters=CUSTOM_PARAMETERS),
                chat_function("get_time"),
            ]
        },
    ),
    ("tool-settings-without-tools-dropped", {"tool_choice": "auto", "parallel_tool_calls": True}, {}),
    ("tool-choice-none-without-tools", {"tool_choice": "none", "tools": []}, {}),
    (
        "json-schema",
        {"text": {"format": SCHEMA_FORMAT}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"type": "object"}, "strict": True},
            }
        },
    ),
    (
        "json-schema-with-description",
        {"text": {"format": DESCRIBED_FORMAT}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {}, "description": "An answer."},
            }
        },
    ),
    (
        "json-object",
        {"text": {"format": {"type": "json_object"}}},
        {"response_format": {"type": "json_object"}},
    ),
    ("text-and-verbosity", {"text": {"format": {"type": "text"}, "verbosity": "low"}}, {"verbosity": "low"}),
    ("max-output-tokens", {"max_output_tokens": 64}, {"max_tokens": 64}),
    ("sampling", SAMPLING, SAMPLING),
    ("zero-temperature-kept", {"temperature": 0}, {"temperature": 0}),
    ("reasoning-effort", {"reasoning": {"effort": "high", "summary": "auto"}}, {"reasoning_effort": "high"}),
    ("reasoning-summary-only", {"reasoning": {"summary": "detailed", "mode": "standard"}}, {}),
    ("logprobs-with-top", {"include": LOGPROBS, "top_logprobs": 5}, {"logprobs": True, "top_logprobs": 5}),
    ("logprobs-top-0", {"include": LOGPROBS, "top_logprobs": 0}, {"logprobs": True}),
    ("logprobs-without-top", {"include": LOGPROBS}, {"logprobs": True}),
    ("top-logprobs-without-include", {"top_logprobs": 5}, {}),
    ("user", {"user": "u-1"}, {"user": "u-1"}),
    ("safety-identifier-wins", {"user": "u-1", "safety_identifier": "s-1"}, {"user": "s-1"}),
    ("respool-business-not-forwarded", OWNED, {}),
]


@pytest.mark.parametrize(
    ("request_", "expected"), [pytest.param(*case, id=name) for name, *case in PARAMETERS]
)
def test_request_parameters(request_: dict[str, Any], expected: dict[str, Any]) -> None:
    """Each parameter becomes its chat counterpart or nothing, in a body that always streams with usage."""
    body = to_chat_request(request_, HELLO, "up")
    assert {key: body[key] for key in BASE} == BASE
    assert {key: value for key, value in body.items() if key not in BASE and key != "messages"} == expected


@pytest.mark.parametrize(
    ("request_", "expected"), [({"include": LOGPROBS}, True), ({"include": None}, False), ({}, False)]
)
def test_includes_logprobs(request_: dict[str, Any], expected: bool) -> None:
    """The stream side is told to carry logprobs exactly when the client included them."""
    assert includes_logprobs(request_) is expected


# Unsupported (unsupported_parameter), Missing (missing_required_parameter), inValid (invalid_value).
U, M, V = UnsupportedParameterError, MissingParameterError, InvalidRequestError
ALLOWED = {"type": "allowed_tools", "mode": "auto"}
IMAGE = {"type": "input_image", "image_url": "https://x/a.png", "detail": "auto"}

# (id, request, error, param): parameters nobody here can honour.
PARAMETER_ERRORS = [
    ("nameless-tool", {"tools": [{"type": "function"}]}, M, "tools[0].name"),
    ("nameless-custom-tool", {"tools": [{"type": "custom"}]}, M, "tools[0].name"),
    ("nameless-namespace", {"tools": [{"type": "namespace", "tools": [TIME]}]}, M, "tools[0].name"),
    ("hosted-in-namespace", {"tools": [{**NAMESPACE, "tools": [HOSTED]}]}, U, "tools[0].tools[0]"),
    (
        "namespaced-nameless",
        {"tools": [{**NAMESPACE, "tools": [{"type": "function"}]}]},
        M,
        "tools[0].tools[0].name",
    ),
    ("one-chat-name-twice", {"tools": [TIME, {**TIME, "type": "custom"}]}, V, "tools[1]"),
    ("namespace-clash", {"tools": [NAMESPACE, {"type": "function", "name": "agents__spawn"}]}, V, "tools[1]"),
    ("hosted-choice", {"tools": [TIME], "tool_choice": {"type": "file_search"}}, U, "tool_choice"),
    (
        "custom-choice-unknown",
        {"tools": [TIME], "tool_choice": {"type": "custom", "name": "x"}},
        V,
        "tool_choice.name",
    ),
    ("bad-choice", {"tools": [TIME], "tool_choice": "sometimes"}, U, "tool_choice"),
    (
        "choice-unknown",
        {"tools": [TIME], "tool_choice": {"type": "function", "name": "x"}},
        V,
        "tool_choice.name",
    ),
    ("required-without-tools", {"tool_choice": "required"}, V, "tool_choice"),
    (
        "allowed-hosted",
        {"tools": [TIME], "tool_choice": {**ALLOWED, "tools": [HOSTED]}},
        U,
        "tool_choice.tools[0]",
    ),
    (
        "allowed-unknown",
        {"tools": [TIME], "tool_choice": {**ALLOWED, "tools": [{"type": "function", "name": "x"}]}},
        V,
        "tool_choice.tools[0].name",
    ),
    ("text-format", {"text": {"format": {"type": "grammar"}}}, U, "text.format.type"),
    ("schemaless", {"text": {"format": {"type": "json_schema", "name": "a"}}}, M, "text.format.schema"),
    ("reasoning-mode", {"reasoning": {"mode": "pro"}}, U, "reasoning.mode"),
    ("prompt", {"prompt": {"id": "pmpt_1"}}, U, "prompt"),
    ("moderation", {"moderation": {"model": "omni-moderation-latest"}}, U, "moderation"),
]

# (id, input items, error, param): items a chat conversation cannot carry; indexes count earlier turns.
ITEM_ERRORS = [
    ("item-reference", [*HELLO, {"type": "item_reference", "id": "msg_1"}], U, "input[1]"),
    ("computer-call", [{"type": "computer_call", "call_id": "c"}], U, "input[0]"),
    ("file-search-call", [*HELLO, {"type": "file_search_call", "id": "fs"}], U, "input[1]"),
    ("unknown-item", [{"type": "frobnicate"}], U, "input[0]"),
    ("unknown-role", [message("tool", text("x"))], V, "input[0].role"),
    (
        "image-by-file-id",
        [message("user", text("x"), {**IMAGE, "image_url": None, "file_id": "f"})],
        U,
        "input[0].content[1].file_id",
    ),
    (
        "file-by-url",
        [message("user", {"type": "input_file", "file_url": "https://x/a.pdf"})],
        U,
        "input[0].content[0].file_url",
    ),
    (
        "empty-file",
        [message("user", {"type": "input_file", "filename": "a.pdf"})],
        M,
        "input[0].content[0].file_data",
    ),
    ("image-in-system", [message("system", text("x"), IMAGE)], U, "input[0].content[1]"),
    ("unknown-part", [message("user", {"type": "input_audio"})], U, "input[0].content[0]"),
    ("unknown-assistant-part", [message("assistant", {"type": "output_audio"})], U, "input[0].content[0]"),
    (
        "image-tool-output",
        [function_call("c", "f", "{}"), call_output("c", [IMAGE])],
        U,
        "input[1].output[0]",
    ),
    ("call-without-call-id", [function_call("", "f", "{}")], M, "input[0].call_id"),
    ("call-without-name", [function_call("c", "", "{}")], M, "input[0].name"),
    ("output-without-call-id", [call_output("", "x")], M, "input[0].call_id"),
    ("output-without-output", [call_output("c", None)], M, "input[0].output"),
]


@pytest.mark.parametrize(
    ("request_", "error", "param"), [pytest.param(*case, id=name) for name, *case in PARAMETER_ERRORS]
)
def test_unhonourable_parameters_are_a_400_naming_the_param(
    request_: dict[str, Any], error: type[InvalidRequestError], param: str
) -> None:
    """A parameter the upstream cannot do and respool cannot honour is refused, never dropped, and named."""
    assert_refused(request_, HELLO, error, param)


@pytest.mark.parametrize(
    ("items", "error", "param"), [pytest.param(*case, id=name) for name, *case in ITEM_ERRORS]
)
def test_unsupported_input_is_a_400_naming_the_item(
    items: list[dict[str, Any]], error: type[InvalidRequestError], param: str
) -> None:
    """An input item or part a chat conversation cannot carry is refused, and the error points at it."""
    assert_refused({}, items, error, param)


def assert_refused(
    request: dict[str, Any], items: list[dict[str, Any]], error: type[InvalidRequestError], param: str
) -> None:
    with pytest.raises(error) as raised:
        to_chat_request(request, items, "up")
    assert type(raised.value) is error
    assert (raised.value.param, raised.value.status) == (param, 400)


@pytest.mark.parametrize(
    ("request_", "items", "error", "param"),
    [pytest.param(case[0], HELLO, *case[1:], id=name) for name, *case in PARAMETER_ERRORS]
    + [pytest.param({}, *case, id=name) for name, *case in ITEM_ERRORS],
)
def test_the_check_at_create_refuses_what_translation_would(
    request_: dict[str, Any], items: list[dict[str, Any]], error: type[InvalidRequestError], param: str
) -> None:
    """`check`, which the API runs at create, raises exactly the 400 translating would, naming the same param."""
    with pytest.raises(error) as raised:
        check(request_, items)
    assert type(raised.value) is error
    assert raised.value.param == param


@pytest.mark.parametrize("items", [pytest.param(items, id=name) for name, _, items, _ in CONVERSATIONS])
def test_the_check_passes_what_translation_takes(items: list[Item]) -> None:
    """Every conversation translation takes passes the check."""
    check({}, items)
