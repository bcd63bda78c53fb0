"""Rebuilding the output from the events told so far: what a new attempt ends when the last one died mid-output."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.schema import validate_event
from tests.worker.translation import test_chat_stream, test_native
from worker.translation.output import close_open, output_items, tell_rest, tell_whole
from worker.translation.replay import rebuild

Events = list[dict[str, Any]]


def _streams() -> dict[str, Events]:
    streams = {
        f"chat/{name}": test_chat_stream.run(test_chat_stream.load(name))[0]
        for name in test_chat_stream.FIXTURE_NAMES
    }
    streams |= {f"native/{name}": test_native.run(test_native.load(name))[0] for name in test_native.NAMES}
    return streams


STREAMS = _streams()


@pytest.mark.parametrize("name", STREAMS)
def test_a_stream_cut_anywhere_closes_into_what_was_told(name: str) -> None:
    """Cut after any event, the rebuilt output closes with valid `.done` events into items whose
    text is exactly what the deltas told, every item done, the open ones `incomplete`."""
    events = STREAMS[name]
    for cut in range(len(events) + 1):
        told = events[:cut]
        out = rebuild(told)
        closing = close_open(out, "incomplete")
        for number, event in enumerate(closing):
            if not test_native._is_hosted(event):  # the schema has no hosted tool items
                validate_event({**event, "sequence_number": number})
        whole = told + closing
        added = {e["output_index"] for e in whole if e["type"] == "response.output_item.added"}
        done = {e["output_index"]: e["item"] for e in whole if e["type"] == "response.output_item.done"}
        assert set(done) == added, f"cut at {cut}: items left open"
        assert [done[index] for index in sorted(done)] == output_items(out), f"cut at {cut}"
        if name.startswith("chat/") and all(
            e["type"] != "response.function_call_arguments.delta" for e in told
        ):
            assert test_chat_stream.fold(whole) == output_items(out), f"cut at {cut}"


def test_a_whole_stream_leaves_nothing_open() -> None:
    """A stream told to its end rebuilds with nothing open and the same items its `.done` events carry."""
    events = STREAMS["chat/vllm_reasoning"]
    out = rebuild(events)
    assert close_open(out, "incomplete") == []
    assert output_items(out) == [e["item"] for e in events if e["type"] == "response.output_item.done"]


def test_a_tool_loops_mcp_calls_are_rebuilt_from_their_events() -> None:
    """A takeover rebuilds an MCP call, run or still open, exactly as its events told it (DESIGN.md §10)."""
    from worker.translation import output as out_module
    from worker.translation.replay import rebuild

    out = out_module.Output()
    events = out_module.open_call(out, 0, None, "lookup", {"server_label": "tools"}, item_type="mcp_call")
    item = out_module.call(out, 0)
    assert item is not None
    events += out_module.append_arguments(item, '{"city":')
    events += out_module.append_arguments(item, '"Paris"}')
    events += out_module.close_open(out, "completed")  # the turn ends: the call waits to be run
    assert out.pending == [item]
    events += out_module.end_call(out, item, output="Sunny")
    events += out_module.open_call(out, 1, None, "add", {"server_label": "tools"}, item_type="mcp_call")
    second = out_module.call(out, 1)
    assert second is not None
    events += out_module.append_arguments(second, '{"a": 1')
    rebuilt = rebuild(events)
    assert out_module.output_items(rebuilt) == out_module.output_items(out)
    ran, open_call = out_module.output_items(rebuilt)
    assert (ran["status"], ran["output"], ran["arguments"]) == ("completed", "Sunny", '{"city":"Paris"}')
    assert (open_call["status"], open_call["arguments"]) == ("in_progress", '{"a": 1')
    kinds = [event["type"] for event in events if event.get("output_index") == 0]
    assert kinds == [
        "response.output_item.added",
        "response.mcp_call.in_progress",
        "response.mcp_call_arguments.delta",
        "response.mcp_call_arguments.delta",
        "response.mcp_call_arguments.done",
        "response.mcp_call.completed",
        "response.output_item.done",
    ]


def test_a_web_search_is_told_run_and_rebuilt_as_openai_tells_it() -> None:
    """A web search call: added and in progress, searching, completed with its action, done; a
    takeover rebuilds it with its status, and a search still open closes `incomplete`."""
    from worker.translation import output as out_module
    from worker.translation.chat_messages import SEARCH_RESULTS, to_chat_messages
    from worker.translation.replay import rebuild

    out = out_module.Output()
    events = out_module.open_call(out, 0, "call_0", "web_search", None, item_type="web_search_call")
    item = out_module.call(out, 0)
    assert item is not None
    events += out_module.append_arguments(item, '{"query": "respool"}')  # never told as such
    events += out_module.close_open(out, "completed")
    assert out.pending == [item]
    events += out_module.search_started(item, "respool")
    action = {"type": "search", "query": "respool", "sources": [{"type": "url", "url": "https://x.org/r"}]}
    events += out_module.end_search(out, item, action)
    events += out_module.open_call(out, 1, "call_1", "web_search", None, item_type="web_search_call")
    assert [event["type"] for event in events] == [
        "response.output_item.added",
        "response.web_search_call.in_progress",
        "response.web_search_call.searching",
        "response.web_search_call.completed",
        "response.output_item.done",
        "response.output_item.added",
        "response.web_search_call.in_progress",
    ]
    searched = {"id": item.id, "type": "web_search_call", "status": "completed", "action": action}
    assert events[4]["item"] == searched
    rebuilt = rebuild(events)
    assert out_module.output_items(rebuilt) == out_module.output_items(out)
    closed = out_module.close_open(rebuilt, "incomplete")
    assert closed[-1]["item"]["status"] == "incomplete" and "arguments" not in closed[-1]["item"]
    # The model is told the search as a call of web_search and what it found.
    messages = to_chat_messages(None, [{**searched, SEARCH_RESULTS: "found: https://x.org/r"}])
    assert messages == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": item.id,
                    "type": "function",
                    "function": {"name": "web_search", "arguments": '{"query":"respool"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": item.id, "content": "found: https://x.org/r"},
    ]
    # Without the loop's journal (a chain's earlier search): what the item itself says.
    assert to_chat_messages(None, [searched])[1]["content"] == (
        "Searched the web for 'respool'. Sources: https://x.org/r"
    )


@pytest.mark.parametrize("name", STREAMS)
def test_finished_items_told_whole_add_up_to_themselves(name: str) -> None:
    """A final Response's output told whole (its end committed, its last append lost: DESIGN.md §4)
    rebuilds into exactly those items, ids kept; the events keep the SDK's order rules and schemas,
    and the SDK's stream accumulator takes them into the same items and text."""
    final = [event["item"] for event in STREAMS[name] if event["type"] == "response.output_item.done"]
    told = tell_whole(final)
    rebuilt = rebuild(told)
    assert close_open(rebuilt, "incomplete") == []
    assert output_items(rebuilt) == final
    added = [e for e in told if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == list(range(len(final)))
    for event in added:  # as a turn tells them: opened empty, filled by deltas
        if event["item"]["type"] == "message":
            assert (event["item"]["status"], event["item"]["content"]) == ("in_progress", [])
        elif event["item"]["type"] == "function_call":
            assert (event["item"]["status"], event["item"]["arguments"]) == ("in_progress", "")
    _the_sdk_takes(told, final)


@pytest.mark.parametrize("name", STREAMS)
def test_a_stream_cut_anywhere_is_told_the_rest_of_its_items(name: str) -> None:
    """Cut after any event (a turn's last read, kept for the response's end, whose append was lost:
    DESIGN.md §4), the rest told from the final items goes on where the stream stopped: together
    they rebuild into exactly those items (each part's deltas adding up to its text, nothing told
    twice), keep the SDK's order rules and schemas, and the SDK's accumulator takes them so too."""
    events = STREAMS[name]
    final = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    for cut in range(len(events) + 1):
        told = events[:cut]
        rest = tell_rest(rebuild(told), final)
        rebuilt = rebuild(told + rest)
        assert close_open(rebuilt, "incomplete") == [], f"cut at {cut}"
        assert output_items(rebuilt) == final, f"cut at {cut}"
        _the_sdk_takes(told + rest, final)
    assert tell_rest(rebuild(events), final) == []


def test_told_text_that_is_not_the_final_texts_start_is_told_done_alone() -> None:
    """Nothing told can be taken back: a part whose told text is not the start of its final text
    ends with that text in its `.done` events, no delta added."""
    events = STREAMS["chat/openai_text"]
    final = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    first_delta = next(n for n, e in enumerate(events) if e["type"] == "response.output_text.delta")
    told = [*events[:first_delta], {**events[first_delta], "delta": "Not so"}]
    rest = tell_rest(rebuild(told), final)
    assert [e["type"] for e in rest] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert rest[0]["text"] == final[0]["content"][0]["text"]
    assert rest[-1]["item"] == final[0]


def _the_sdk_takes(told: Events, final: Events) -> None:
    """`told` are valid events (numbered), and the SDK's stream accumulator takes them into `final`'s
    items and output text."""
    from openai import omit
    from openai.lib.streaming.responses._responses import ResponseStreamState

    outcome = test_native.Outcome(status="completed", output=final, usage=None, incomplete_details=None)
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in test_native.numbered(told, outcome):
        if not test_native._is_hosted(event):  # the schema has no hosted tool items
            validate_event(event)
        state.handle_event(test_native.EVENT.validate_python(event))
    snapshot = state._ResponseStreamState__current_snapshot  # type: ignore[attr-defined]
    assert [(item.type, item.id) for item in snapshot.output] == [(i["type"], i["id"]) for i in final]
    # (the SDK's accumulator folds output text alone: a refusal's deltas are left to the client)
    texts = [
        [p.text for p in i.content if p.type == "output_text"] for i in snapshot.output if i.type == "message"
    ]
    assert texts == [
        [p["text"] for p in i["content"] if p["type"] == "output_text"]
        for i in final
        if i["type"] == "message"
    ]


def test_nothing_to_tell_is_told_as_nothing() -> None:
    """An end with no output (a cancel, a failure before any) tells no item."""
    assert tell_whole([]) == []
