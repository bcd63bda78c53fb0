"""Chat Completions chunks => Responses events, on chunk sequences in the shapes real servers send."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from openai.types.responses import ResponseOutputItem, ResponseStreamEvent, ResponseUsage
from pydantic import TypeAdapter

from tests.support.schema import validate_event, validate_response
from worker.errors import UpstreamStreamError
from worker.translation.chat_stream import Outcome, finish_stream, start_stream, translate_chunk
from worker.translation.chat_tools import call_shapes

FIXTURES = Path(__file__).parent / "fixtures"
EVENT = TypeAdapter(ResponseStreamEvent)
OUTPUT_ITEM = TypeAdapter(ResponseOutputItem)

ADDED, DONE = "response.output_item.added", "response.output_item.done"
PREFIXES = dict(text="response.output_text", refusal="response.refusal", reasoning="response.reasoning_text")
CALL_DONE = ["response.function_call_arguments.done", DONE]
Events = list[dict[str, Any]]

# What `ResponseResource` requires besides what the outcome carries.
RESPONSE = (
    dict.fromkeys(("previous_response_id", "instructions", "error", "reasoning", "max_output_tokens"))
    | dict.fromkeys(("max_tool_calls", "safety_identifier", "prompt_cache_key", "metadata"))
    | dict(id="resp_1", object="response", created_at=1, model="m", tools=[], tool_choice="auto")
    | dict(truncation="disabled", parallel_tool_calls=True, text={"format": {"type": "text"}}, top_p=1.0)
    | dict(presence_penalty=0.0, frequency_penalty=0.0, top_logprobs=0, temperature=1.0, store=True)
    | dict(background=False, service_tier="default")
)


def part(kind: str, deltas: int) -> list[str]:
    """The events of one content part with `deltas` deltas."""
    prefix = PREFIXES[kind]
    return [
        "response.content_part.added",
        *[f"{prefix}.delta"] * deltas,
        f"{prefix}.done",
        "response.content_part.done",
    ]


def item(kind: str, deltas: int) -> list[str]:
    """The events of a message or reasoning item with one part."""
    return [ADDED, *part(kind, deltas), DONE]


def call(deltas: int) -> list[str]:
    """A function call's `.added` and argument deltas (its `.done` events come later)."""
    return [ADDED, *["response.function_call_arguments.delta"] * deltas]


def run(
    chunks: Events,
    *,
    include_logprobs: bool = False,
    top_logprobs: int = 20,
    max_output_tokens: int | None = None,
    tools: Events = (),  # type: ignore[assignment]
) -> tuple[Events, Outcome]:
    state = start_stream(
        include_logprobs=include_logprobs,
        top_logprobs=top_logprobs,
        max_output_tokens=max_output_tokens,
        call_shapes=call_shapes({"tools": list(tools)}),
    )
    events = [event for chunk in chunks for event in translate_chunk(state, chunk)]
    closing, outcome = finish_stream(state)
    return events + closing, outcome


def load(name: str) -> Events:
    chunks: Events = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))["chunks"]
    return chunks


def fold(events: Events) -> Events:
    """The output items a client rebuilds from `.added` events and deltas alone."""
    items: dict[int, dict[str, Any]] = {}
    for event in events:
        kind, index = event["type"], event.get("output_index")
        if kind == ADDED:
            items[index] = copy.deepcopy(event["item"])
        elif kind == "response.content_part.added":
            items[index]["content"].append(copy.deepcopy(event["part"]))
        elif kind == "response.function_call_arguments.delta":
            items[index]["arguments"] += event["delta"]
        elif kind == "response.custom_tool_call_input.delta":
            items[index]["input"] += event["delta"]
        elif kind.endswith(".delta"):
            target = items[index]["content"][event["content_index"]]
            target["refusal" if target["type"] == "refusal" else "text"] += event["delta"]
            target.get("logprobs", []).extend(event.get("logprobs", []))
        elif kind == DONE:
            items[index]["status"] = event["item"]["status"]
    return [items[index] for index in sorted(items)]


def texts(output: Events) -> list[tuple[str, str, str]]:
    """Each output item as (type, status, its full text, or its name and arguments)."""
    summary = []
    for entry in output:
        if entry["type"] == "function_call":
            text = f"{entry['name']}{entry['arguments']}"
        else:
            text = "|".join(p.get("text", p.get("refusal", "")) for p in entry["content"])
        summary.append((entry["type"], entry["status"], text))
    return summary


def msg(text: str, status: str = "completed") -> tuple[str, str, str]:
    return ("message", status, text)


def rs(text: str) -> tuple[str, str, str]:
    return ("reasoning", "completed", text)


def fc(text: str) -> tuple[str, str, str]:
    return ("function_call", "completed", text)


def usage(prompt: int, completion: int, *, cached: int = 0, reasoning: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


# fixture => (event types, output items as (type, status, text), usage)
CASES: dict[str, tuple[list[str], list[tuple[str, str, str]], dict[str, Any] | None]] = {
    "openai_text": (item("text", 4), [msg("Hello! How can I help?")], usage(19, 9)),
    "openai_refusal": (item("refusal", 3), [msg("I'm sorry, I can't help with that.")], usage(41, 8)),
    "openai_parallel_tool_calls": (
        [*call(3), *call(3), *call(2), *CALL_DONE * 3],
        [
            fc('get_weather{"location": "Paris"}'),
            fc('get_weather{"location": "Tokyo"}'),
            fc('get_time{"tz": "Asia/Tokyo"}'),
        ],
        usage(82, 64),
    ),
    "openai_usage_cached_reasoning": (
        item("text", 2),
        [msg("The answer is 42.")],
        usage(1924, 412, cached=1792, reasoning=384),
    ),
    "azure_openai_content_filter": (
        item("text", 3),
        [msg("The duel began at dawn", "incomplete")],
        usage(27, 6),
    ),
    "vllm_reasoning_content": (
        [*item("reasoning", 4), *item("text", 2)],
        [rs("Compare 9.11 and 9.8: 0.8 > 0.11."), msg("9.8 is greater.")],
        usage(17, 43),
    ),
    "vllm_reasoning": (
        [*item("reasoning", 2), *item("text", 2)],
        [rs("The user greets me."), msg("\n\nHi there!")],
        usage(12, 28, cached=8),
    ),
    "vllm_length": (item("text", 5), [msg("Once upon a time,", "incomplete")], usage(20, 6)),
    "vllm_tool_call_then_text": (
        [*call(3), *CALL_DONE, *item("text", 2)],
        [fc('get_weather{"city": "Paris"}'), msg("I'll check the weather.")],
        usage(210, 35),
    ),
    "ollama_reasoning_tool_call": (
        [*item("reasoning", 3), *call(1), *CALL_DONE],
        [rs("Need the weather tool."), fc('get_weather{"city":"Paris"}')],
        usage(160, 31),
    ),
    "ollama_no_usage": (item("text", 3), [msg("Hi there.")], None),
    "llamacpp_reasoning_content": (
        [*item("reasoning", 2), *item("text", 2)],
        [rs("User says hi."), msg("Hello!")],
        usage(75, 9),
    ),
    "llamacpp_usage_on_finish": (item("text", 2), [msg("Hello there")], usage(1085, 2)),
}
FIXTURE_NAMES = list(CASES)


@pytest.mark.parametrize(("fixture", "expected"), CASES.items(), ids=FIXTURE_NAMES)
def test_event_sequence(fixture: str, expected: tuple[list[str], list[tuple[str, str, str]], Any]) -> None:
    """A recorded upstream stream becomes exactly the expected events, items and usage."""
    events, outcome = run(load(fixture))
    assert ([event["type"] for event in events], texts(outcome.output), outcome.usage) == expected


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_events_add_up_to_the_output(fixture: str) -> None:
    """A client folding the deltas gets the same items the `.done` events and the outcome carry."""
    events, outcome = run(load(fixture))
    assert fold(events) == outcome.output
    done = {event["output_index"]: event["item"] for event in events if event["type"] == DONE}
    assert [done[index] for index in sorted(done)] == outcome.output


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_events_keep_the_sdk_order_rules(fixture: str) -> None:
    """Items are added before their deltas and parts, get rising output indexes, and are all done (§0.4)."""
    events, _ = run(load(fixture))
    added: list[int] = []
    done: set[int] = set()
    for event in events:
        index = event.get("output_index")
        if event["type"] == ADDED:
            assert index == len(added)
            added.append(index)
        elif event["type"] == DONE:
            done.add(index)
        else:
            assert index in added and index not in done, event
    assert done == set(added)


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_events_match_both_schemas(fixture: str) -> None:
    """Every event validates against the Open Responses schema and parses as the SDK's event union."""
    events, outcome = run(load(fixture), include_logprobs=True)
    for sequence_number, event in enumerate(events):
        wire = {**event, "sequence_number": sequence_number}
        validate_event(wire)
        assert EVENT.validate_python(wire).type == event["type"]
    completed_at = 2 if outcome.status == "completed" else None
    response = {**RESPONSE, "status": outcome.status, "completed_at": completed_at, "output": outcome.output}
    validate_response({**response, "incomplete_details": outcome.incomplete_details, "usage": outcome.usage})


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_outcome_parses_with_the_sdk(fixture: str) -> None:
    """The final output items and usage parse as the SDK's `ResponseOutputItem` and `ResponseUsage`."""
    _, outcome = run(load(fixture))
    for entry in outcome.output:
        assert OUTPUT_ITEM.validate_python(entry).type == entry["type"]
    if outcome.usage is not None:
        ResponseUsage.model_validate(outcome.usage)


@pytest.mark.parametrize(
    ("fixture", "status", "details"),
    [
        ("openai_text", "completed", None),
        ("openai_parallel_tool_calls", "completed", None),
        ("vllm_length", "incomplete", {"reason": "max_output_tokens"}),
        ("azure_openai_content_filter", "incomplete", {"reason": "content_filter"}),
    ],
)
def test_finish_reason_sets_the_outcome(fixture: str, status: str, details: dict[str, str] | None) -> None:
    """`length` and `content_filter` end the response incomplete with OpenAI's reason; the rest complete it."""
    _, outcome = run(load(fixture))
    assert (outcome.status, outcome.incomplete_details) == (status, details)


def test_logprobs_are_translated_when_asked_for() -> None:
    """With logprobs requested, each text delta and the final part carry token, logprob, bytes and top_logprobs."""
    events, outcome = run(load("vllm_logprobs"), include_logprobs=True, top_logprobs=2)
    deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    assert deltas[0]["logprobs"] == [
        {
            "token": "Hello",
            "logprob": -0.0012,
            "bytes": [72, 101, 108, 108, 111],
            "top_logprobs": [
                {"token": "Hello", "logprob": -0.0012, "bytes": [72, 101, 108, 108, 111]},
                {"token": "Hi", "logprob": -6.75, "bytes": [72, 105]},
            ],
        }
    ]
    final = outcome.output[0]["content"][0]["logprobs"]
    assert [entry["token"] for entry in final] == ["Hello", " world", "é"]
    assert final[2]["bytes"] == [195, 169]


def test_logprobs_stay_empty_unless_asked_for() -> None:
    """Without `include: message.output_text.logprobs` the upstream's logprobs are not passed on."""
    events, outcome = run(load("vllm_logprobs"))
    assert all(event["logprobs"] == [] for event in events if "logprobs" in event)
    assert outcome.output[0]["content"][0]["logprobs"] == []


def chunk(
    delta: dict[str, Any], finish_reason: str | None = None, *, logprobs: Any = None, **extra: Any
) -> dict[str, Any]:
    """A minimal chunk in OpenAI's shape."""
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"object": "chat.completion.chunk", "choices": [choice], **extra}


def tool_chunk(index: int, call_id: str | None = None, **function: str) -> dict[str, Any]:
    """A chunk with one tool call delta."""
    delta = {"index": index, "function": function, **({"id": call_id} if call_id else {})}
    return chunk({"tool_calls": [delta]})


@pytest.mark.parametrize(
    "delta",
    [
        {},
        {"role": "assistant"},
        {"role": "assistant", "content": None},
        {"content": ""},
        {"content": "", "reasoning": ""},
        {"tool_calls": []},
        {"tool_calls": [{"index": 3, "function": {"arguments": ""}}]},
    ],
)
def test_empty_deltas_add_nothing(delta: dict[str, Any]) -> None:
    """Role-only, empty and null deltas produce no events and no output items."""
    state = start_stream()
    assert translate_chunk(state, chunk(delta)) == []
    assert finish_stream(state) == ([], Outcome("completed", None, [], None))


def test_reasoning_sent_under_both_names_counts_once() -> None:
    """A vLLM delta carrying the same text as `reasoning` and `reasoning_content` is not doubled."""
    events, outcome = run([chunk({"reasoning": "think", "reasoning_content": "think"}), chunk({}, "stop")])
    deltas = [event["delta"] for event in events if event["type"] == "response.reasoning_text.delta"]
    assert deltas == ["think"]
    assert outcome.output[0]["content"] == [{"type": "reasoning_text", "text": "think"}]


def test_refusal_after_text_is_a_second_part_of_the_same_message() -> None:
    """Text then refusal make one message with an `output_text` part and a `refusal` part."""
    events, outcome = run([chunk({"content": "Sure"}), chunk({"refusal": "No."}), chunk({}, "stop")])
    assert [event["type"] for event in events] == [ADDED, *part("text", 1), *part("refusal", 1), DONE]
    assert [entry["type"] for entry in outcome.output[0]["content"]] == ["output_text", "refusal"]


def test_tool_call_ids_come_from_the_upstream_or_are_minted() -> None:
    """`call_id` is the upstream's tool call id; a call without one gets a fresh `call_…` id; items get `fc_…`."""
    _, outcome = run([tool_chunk(0, "call_up", name="a"), tool_chunk(1, name="b"), chunk({}, "tool_calls")])
    first, second = outcome.output
    assert first["call_id"] == "call_up"
    assert second["call_id"].startswith("call_") and second["call_id"] != "call_up"
    assert first["id"].startswith("fc_") and first["id"] != second["id"]


def test_a_new_id_at_a_known_index_starts_another_call() -> None:
    """Servers that number every call 0 still yield one item per distinct tool call id."""
    chunks = [tool_chunk(0, "call_a", name="a"), tool_chunk(0, "call_b", name="b"), tool_chunk(0, "call_b")]
    _, outcome = run([*chunks, chunk({}, "tool_calls")])
    assert [(entry["call_id"], entry["name"]) for entry in outcome.output] == [
        ("call_a", "a"),
        ("call_b", "b"),
    ]


def test_arguments_for_an_ended_call_fail_loudly() -> None:
    """Argument pieces for a call that text has already closed are an upstream fault, not silently dropped."""
    state = start_stream()
    translate_chunk(state, tool_chunk(0, "call_a", name="a"))
    translate_chunk(state, chunk({"content": "Done."}))
    with pytest.raises(UpstreamStreamError, match="tool call 0"):
        translate_chunk(state, tool_chunk(0, arguments="{}"))


def test_missing_token_bytes_are_derived_from_the_token() -> None:
    """A logprob without `bytes` (null upstream) gets the token's UTF-8 bytes, which the Responses shape requires."""
    token = {"token": "é", "logprob": -1.0, "bytes": None, "top_logprobs": []}
    events, _ = run([chunk({"content": "é"}, logprobs={"content": [token]})], include_logprobs=True)
    assert events[2]["logprobs"] == [{"token": "é", "logprob": -1.0, "bytes": [195, 169], "top_logprobs": []}]


NULL_DETAILS = dict.fromkeys(("prompt_tokens_details", "completion_tokens_details"))


@pytest.mark.parametrize(
    ("chat_usage", "expected"),
    [
        ({"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}, usage(5, 2)),
        ({"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, **NULL_DETAILS}, usage(5, 2)),
        ({"prompt_tokens": 5, "completion_tokens": 2}, usage(5, 2)),
    ],
)
def test_usage_always_has_every_int(chat_usage: dict[str, Any], expected: dict[str, Any]) -> None:
    """Usage without details or total still fills every Responses usage int (PROTOCOL.md §1.4)."""
    state = start_stream()
    translate_chunk(state, {"choices": [], "usage": chat_usage})
    assert finish_stream(state)[1].usage == expected


def test_the_last_usage_wins() -> None:
    """Servers that send running usage on every chunk report the final totals."""
    state = start_stream()
    translate_chunk(state, chunk({"content": "a"}, usage={"prompt_tokens": 5, "completion_tokens": 1}))
    translate_chunk(
        state, chunk({"content": "b"}, "stop", usage={"prompt_tokens": 5, "completion_tokens": 2})
    )
    assert finish_stream(state)[1].usage == usage(5, 2)


def test_item_ids_are_minted_in_openai_shapes() -> None:
    """Reasoning items get `rs_…` ids and messages `msg_…` ids."""
    _, outcome = run(load("llamacpp_reasoning_content"))
    assert [entry["id"].split("_")[0] for entry in outcome.output] == ["rs", "msg"]


def test_top_logprobs_carry_at_most_the_number_asked_for() -> None:
    """An upstream that adds the sampled token as one more candidate (llama-cpp-python) is cut to `top_logprobs`."""
    candidates = [{"token": t, "logprob": -float(n), "bytes": None} for n, t in enumerate(["a", "b", "c"])]
    token = {"token": "a", "logprob": 0.0, "bytes": None, "top_logprobs": candidates}
    logprobs = {"content": [token]}
    for asked, expected in ((2, ["a", "b"]), (1, ["a"]), (0, [])):
        events, _ = run(
            [chunk({"content": "a"}, logprobs=logprobs)], include_logprobs=True, top_logprobs=asked
        )
        assert [top["token"] for top in events[2]["logprobs"][0]["top_logprobs"]] == expected


# llama-cpp-python's answer when `max_tokens` runs out inside a call's arguments: `tool_calls`, and
# the arguments as far as they got (its usage is absent from streams).
CUT_CALL = [tool_chunk(0, "call_w", name="get_weather", arguments='{"ci'), chunk({}, "tool_calls")]


def test_a_call_cut_by_the_token_limit_ends_incomplete() -> None:
    """A call whose arguments are not JSON, with `max_output_tokens` set and no usage, ends incomplete (max_output_tokens)."""
    events, outcome = run(CUT_CALL, max_output_tokens=3)
    assert (outcome.status, outcome.incomplete_details) == ("incomplete", {"reason": "max_output_tokens"})
    assert outcome.output[0]["status"] == "incomplete"
    assert outcome.output[0]["arguments"] == '{"ci'
    assert events[-1]["item"]["status"] == "incomplete"


def test_a_call_cut_with_usage_at_the_limit_ends_incomplete() -> None:
    """Usage that shows the limit reached confirms the cut: incomplete."""
    spent = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}
    _, outcome = run([*CUT_CALL, spent], max_output_tokens=3)
    assert outcome.status == "incomplete"


@pytest.mark.parametrize(
    ("max_output_tokens", "usage_chunks"),
    [
        (None, []),
        (50, [{"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}]),
    ],
    ids=["no-limit", "limit-not-reached"],
)
def test_a_call_with_malformed_arguments_otherwise_fails(
    max_output_tokens: int | None, usage_chunks: Events
) -> None:
    """Arguments that are not JSON with no token limit to blame are a failure naming the call, never `completed`."""
    with pytest.raises(UpstreamStreamError, match=r"get_weather.*not valid JSON"):
        run([*CUT_CALL, *usage_chunks], max_output_tokens=max_output_tokens)


@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', "", "[]"])
def test_calls_with_json_or_no_arguments_complete(arguments: str) -> None:
    """Calls whose arguments parse (or that have none) complete, token limit or not."""
    calls = [tool_chunk(0, "call_w", name="get_weather", arguments=arguments), chunk({}, "tool_calls")]
    _, outcome = run(calls, max_output_tokens=3)
    assert outcome.status == "completed"


def test_llama_cpp_pythons_extra_candidate_is_cut_on_its_real_stream() -> None:
    """A real llama-cpp-python 0.3.36 stream asked for 2 top logprobs, which sends 3 for some tokens: 2 each."""
    chunks = load("llamacpp_python_top_logprobs")
    sent = [
        len(token["top_logprobs"])
        for c in chunks
        for token in ((c["choices"][0].get("logprobs") or {}).get("content") or [])
    ]
    assert max(sent) == 3  # what the server sends
    events, outcome = run(chunks, include_logprobs=True, top_logprobs=2, max_output_tokens=5)
    told = [
        len(t["top_logprobs"])
        for e in events
        if e["type"] == "response.output_text.delta"
        for t in e["logprobs"]
    ]
    assert told == [2] * len(sent)
    assert [len(t["top_logprobs"]) for t in outcome.output[0]["content"][0]["logprobs"]] == [2] * len(sent)
    assert (outcome.status, outcome.incomplete_details) == ("incomplete", {"reason": "max_output_tokens"})


def test_llama_cpp_pythons_cut_call_on_its_real_stream_ends_incomplete() -> None:
    """A real llama-cpp-python 0.3.36 call cut at '{"c' by max_tokens 3, said `tool_calls`: incomplete, and valid."""
    events, outcome = run(load("llamacpp_python_cut_tool_call"), max_output_tokens=3)
    assert (outcome.status, outcome.incomplete_details) == ("incomplete", {"reason": "max_output_tokens"})
    (call,) = outcome.output
    assert (call["type"], call["name"], call["arguments"], call["status"]) == (
        "function_call",
        "get_weather",
        '{"c',
        "incomplete",
    )
    for sequence_number, event in enumerate(events):
        validate_event({**event, "sequence_number": sequence_number})


NAMESPACED_AND_CUSTOM = [
    {
        "type": "namespace",
        "name": "agents",
        "description": "Agents.",
        "tools": [{"type": "function", "name": "spawn"}],
    },
    {"type": "custom", "name": "apply_patch"},
    {"type": "function", "name": "get_time", "description": None, "parameters": None, "strict": None},
]


def test_calls_of_namespaced_and_custom_tools_come_back_as_their_items() -> None:
    """A chat call of `agents__spawn` is a `function_call` of `spawn` in namespace `agents`; one of a
    custom tool is a `custom_tool_call` whose input is the `input` argument, told as input events."""
    chunks = [
        tool_chunk(0, "call_a", name="agents__spawn", arguments='{"task":'),
        tool_chunk(0, arguments='"t"}'),
        tool_chunk(1, "call_b", name="apply_patch", arguments='{"input": "*** Begin'),
        tool_chunk(1, arguments=' Patch\\n"}'),
        tool_chunk(2, "call_c", name="get_time", arguments="{}"),
        chunk({}, "tool_calls"),
    ]
    events, outcome = run(chunks, tools=NAMESPACED_AND_CUSTOM)
    spawn, patch, clock = outcome.output
    assert (spawn["type"], spawn["name"], spawn["namespace"], spawn["arguments"]) == (
        "function_call",
        "spawn",
        "agents",
        '{"task":"t"}',
    )
    assert (patch["type"], patch["name"], patch["input"], patch["call_id"]) == (
        "custom_tool_call",
        "apply_patch",
        "*** Begin Patch\n",
        "call_b",
    )
    assert patch["id"].startswith("ctc_") and "namespace" not in patch and "arguments" not in patch
    assert (clock["type"], clock["name"]) == ("function_call", "get_time") and "namespace" not in clock
    patch_events = [event["type"] for event in events if event.get("item_id") == patch["id"]]
    assert patch_events == ["response.custom_tool_call_input.delta", "response.custom_tool_call_input.done"]
    assert fold(events) == outcome.output
    for sequence_number, event in enumerate(events):
        wire = {**event, "sequence_number": sequence_number}
        validate_event(wire)
        assert EVENT.validate_python(wire).type == event["type"]
    for entry in outcome.output:
        assert OUTPUT_ITEM.validate_python(entry).type == entry["type"]
    validate_response(
        {**RESPONSE, "status": "completed", "completed_at": 2, "output": outcome.output}
        | {"incomplete_details": None, "usage": None, "tools": NAMESPACED_AND_CUSTOM}
    )


def test_a_custom_call_whose_arguments_are_not_the_input_object_keeps_them_as_its_input() -> None:
    """An upstream that sends a custom tool's input bare (not `{"input": ...}`) still gets it through."""
    _, outcome = run(
        [tool_chunk(0, "call_b", name="apply_patch", arguments='"just text"'), chunk({}, "tool_calls")],
        tools=NAMESPACED_AND_CUSTOM,
    )
    assert outcome.output[0]["input"] == '"just text"'
