"""Building the frames the scripted upstream sends: pure, no I/O.

Owns turning a script and a request body into the Chat Completions chunks (and the assembled
`chat.completion` a non-streaming client gets) and the Responses events that
`tests.support.scripted_upstream` sends, plus their compact JSON encoding. Pure functions only:
no sockets, no files, no server state.
"""

from __future__ import annotations

import itertools
import json
import re
import time
import uuid
from typing import Any, cast

type Json = dict[str, Any]

DEFAULT_MODEL = "scripted"


def conversation(items: object) -> list[tuple[str, str]]:
    """(role, text) of each message in chat `messages` or Responses `input`."""
    if isinstance(items, str):
        return [("user", items)]
    pairs = []
    for item in items if isinstance(items, list) else []:
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, list):
            content = " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        if isinstance(content, str) and "role" in item:
            pairs.append((str(item["role"]), content))
    return pairs


def script_text(script: Json, turns: list[tuple[str, str]]) -> str:
    if "text" in script:
        return str(script["text"])
    said = next((text for role, text in reversed(turns) if role == "user"), "")
    return f"Hello from the scripted upstream. You said: {said}"


def text_pieces(text: str, words_per_chunk: int) -> list[str]:
    """The text cut into chunks of whole words, each word keeping the whitespace after it."""
    words = re.findall(r"\S+\s*|\s+", text)
    return ["".join(batch) for batch in itertools.batched(words, max(1, words_per_chunk))]


def count_words(turns: list[tuple[str, str]]) -> int:
    return sum(len(text.split()) for _, text in turns)


def chat_chunk(envelope: Json, delta: Json, finish_reason: str | None = None) -> Json:
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    return {**envelope, "choices": [choice]}


def raw_chat_chunk(envelope: Json, given: Json) -> Json:
    """A script's raw chunk: full chunks get missing envelope fields, shorthands become choices[0]."""
    if "object" in given or "choices" in given:
        return {**envelope, **given}
    if set(given) == {"usage"}:
        return {**envelope, "choices": [], "usage": given["usage"]}
    choice = {"index": 0, "delta": {}, "finish_reason": None, "logprobs": None, **given}
    return {**envelope, "choices": [choice]}


def chat_chunks(script: Json, body: Json, envelope: Json, *, is_usage_wanted: bool) -> list[Json]:
    """Every chat.completion.chunk the script produces, without the closing [DONE]."""
    if "chunks" in script:
        return [raw_chat_chunk(envelope, given) for given in script["chunks"]]
    if "tool_loop" in script:
        return tool_loop_chunks(script["tool_loop"], body, envelope, is_usage_wanted=is_usage_wanted)
    turns = conversation(body.get("messages"))
    pieces = text_pieces(script_text(script, turns), int(script.get("words_per_chunk", 1)))
    deltas = [{"role": "assistant", "content": ""}, *({"content": piece} for piece in pieces)]
    chunks = [chat_chunk(envelope, delta) for delta in deltas]
    chunks.append(chat_chunk(envelope, {}, script.get("finish_reason", "stop")))
    prompt_tokens = count_words(turns)
    counted = {"prompt_tokens": prompt_tokens, "completion_tokens": len(pieces)}
    usage = script.get("usage", {**counted, "total_tokens": prompt_tokens + len(pieces)})
    if is_usage_wanted and usage is not None:
        chunks.append({**envelope, "choices": [], "usage": usage})
    return chunks


# Arguments the tool-loop model fills a tool's parameters with, per JSON Schema type.
SAMPLE_ARGUMENTS = {"string": "Paris", "integer": 2, "number": 0.01, "boolean": True}


def tool_loop_step(spec: Json, offered: list[Json], results: list[str]) -> tuple[Json | None, str]:
    """What the tool-loop model does next, given the functions it is offered (`name`, `parameters`)
    and the tool results so far: `(the function it calls, its arguments as JSON)` while it has seen
    fewer than `steps` results (default 1), else `(None, its answer)`. It calls the tool `tool` names
    (default: the first one offered; `tools` gives one per step), its parameters filled with sample
    values (`arguments` gives them instead); then it answers "The tool said: <last result>"."""
    steps = int(spec.get("steps", 1))
    names = spec.get("tools") or ([spec["tool"]] if spec.get("tool") else [])
    if len(results) < steps and offered:
        wanted = names[len(results) % len(names)] if names else offered[0]["name"]
        function = next((f for f in offered if f["name"].endswith(wanted)), offered[0])
        properties = (function.get("parameters") or {}).get("properties") or {}
        arguments = spec.get("arguments") or {
            key: SAMPLE_ARGUMENTS.get(value.get("type"), "x") for key, value in properties.items()
        }
        return function, json.dumps(arguments)
    return None, f"The tool said: {results[-1] if results else 'nothing'}"


def tool_loop_chunks(spec: Json, body: Json, envelope: Json, *, is_usage_wanted: bool) -> list[Json]:
    """The tool-loop model (`tool_loop_step`) on Chat Completions. The script's `delay` paces every
    turn's frames. Usage: the words of the messages in, one token per call or answer word out."""
    messages = body.get("messages") or []
    results = [str(message.get("content")) for message in messages if message.get("role") == "tool"]
    offered = [tool["function"] for tool in body.get("tools") or []]
    function, said = tool_loop_step(spec, offered, results)
    if function is not None:
        call = {"index": 0, "id": f"call_{len(results)}", "type": "function"}
        call["function"] = {"name": function["name"], "arguments": said}
        chunks = [
            chat_chunk(envelope, {"role": "assistant", "content": None, "tool_calls": [call]}),
            chat_chunk(envelope, {}, "tool_calls"),
        ]
        made = 1
    else:
        pieces = text_pieces(said, 1)
        chunks = [chat_chunk(envelope, {"role": "assistant", "content": ""})]
        chunks += [chat_chunk(envelope, {"content": piece}) for piece in pieces]
        chunks.append(chat_chunk(envelope, {}, "stop"))
        made = len(pieces)
    if is_usage_wanted:
        read = count_words(conversation(messages))
        usage = {"prompt_tokens": read, "completion_tokens": made, "total_tokens": read + made}
        chunks.append({**envelope, "choices": [], "usage": usage})
    return chunks


def merge_tool_call(calls: dict[int, Json], delta: Json) -> None:
    call = calls.setdefault(delta.get("index", 0), {"id": "", "type": "function"})
    function = call.setdefault("function", {"name": "", "arguments": ""})
    call["id"] = delta.get("id") or call["id"]
    function["name"] += (delta.get("function") or {}).get("name") or ""
    function["arguments"] += (delta.get("function") or {}).get("arguments") or ""


def assemble_completion(chunks: list[Json], envelope: Json) -> Json:
    """The chat.completion object a non-streaming client gets for the same chunks."""
    content, finish_reason, usage, calls = "", "stop", None, cast(dict[int, Json], {})
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                merge_tool_call(calls, call)
            finish_reason = choice.get("finish_reason") or finish_reason
    message: Json = {"role": "assistant", "content": content or None, "refusal": None}
    if calls:
        message["tool_calls"] = [calls[index] for index in sorted(calls)]
    choice = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
    return {**envelope, "object": "chat.completion", "choices": [choice], "usage": usage}


def response_snapshot(body: Json, response_id: str, status: str, output: list[Json], usage: object) -> Json:
    now = int(time.time())
    return {
        "id": response_id, "object": "response", "created_at": now, "status": status,
        "model": body.get("model", DEFAULT_MODEL), "output": output, "usage": usage,
        "completed_at": now if status == "completed" else None, "error": None,
        "incomplete_details": None, "instructions": body.get("instructions"),
        "metadata": body.get("metadata") or {}, "parallel_tool_calls": True, "tool_choice": "auto",
        "tools": [], "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "text": {"format": {"type": "text"}}, "background": False,
    }  # fmt: skip


def responses_usage(script: Json, turns: list[tuple[str, str]], output_tokens: int) -> Json | None:
    input_tokens = count_words(turns)
    counted = {
        "input_tokens": input_tokens, "output_tokens": output_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": input_tokens + output_tokens,
    }  # fmt: skip
    return cast(Json | None, script.get("usage", counted))


def response_events(script: Json, body: Json) -> list[Json]:
    """The Responses events of one text message, numbered from 0 (PROTOCOL.md §4.1 order)."""
    if "events" in script:
        return [{"sequence_number": i, **event} for i, event in enumerate(script["events"])]
    turns = conversation(body.get("input"))
    text = script_text(script, turns)
    if "tool_loop" in script:
        items = body["input"] if isinstance(body["input"], list) else []
        results = [str(item.get("output")) for item in items if item.get("type") == "function_call_output"]
        offered = [tool for tool in body.get("tools") or [] if tool.get("type") == "function"]
        function, text = tool_loop_step(script["tool_loop"], offered, results)
        if function is not None:
            return function_call_events(body, function["name"], text, len(results))
    pieces = text_pieces(text, int(script.get("words_per_chunk", 1)))
    response_id, message_id = f"resp_up{uuid.uuid4().hex}", f"msg_up{uuid.uuid4().hex}"
    started = response_snapshot(body, response_id, "in_progress", [], None)
    where = {"item_id": message_id, "output_index": 0, "content_index": 0}
    message: Json = {"type": "message", "id": message_id, "role": "assistant", "status": "in_progress"}
    message["content"] = []
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    full_part, done_message = {**part, "text": text}, {**message, "status": "completed"}
    done_message["content"] = [full_part]
    usage = responses_usage(script, turns, len(pieces))
    events: list[Json] = [
        {"type": "response.created", "response": started},
        {"type": "response.in_progress", "response": started},
        {"type": "response.output_item.added", "output_index": 0, "item": message},
        {"type": "response.content_part.added", **where, "part": part},
        *({"type": "response.output_text.delta", **where, "delta": p, "logprobs": []} for p in pieces),
        {"type": "response.output_text.done", **where, "text": text, "logprobs": []},
        {"type": "response.content_part.done", **where, "part": full_part},
        {"type": "response.output_item.done", "output_index": 0, "item": done_message},
        {"type": "response.completed",
         "response": response_snapshot(body, response_id, "completed", [done_message], usage)},
    ]  # fmt: skip
    return [{**event, "sequence_number": number} for number, event in enumerate(events)]


def function_call_events(body: Json, name: str, arguments: str, number: int) -> list[Json]:
    """The Responses events of one function call, numbered from 0."""
    response_id, item_id = f"resp_up{uuid.uuid4().hex}", f"fc_up{uuid.uuid4().hex}"
    started = response_snapshot(body, response_id, "in_progress", [], None)
    call: Json = {"type": "function_call", "id": item_id, "call_id": f"call_{number}", "name": name}
    call.update(arguments="", status="in_progress")
    done = {**call, "arguments": arguments, "status": "completed"}
    where = {"item_id": item_id, "output_index": 0}
    usage = responses_usage({}, conversation(body.get("input")), 1)
    events: list[Json] = [
        {"type": "response.created", "response": started},
        {"type": "response.in_progress", "response": started},
        {"type": "response.output_item.added", "output_index": 0, "item": call},
        {"type": "response.function_call_arguments.delta", **where, "delta": arguments},
        {"type": "response.function_call_arguments.done", **where, "arguments": arguments},
        {"type": "response.output_item.done", "output_index": 0, "item": done},
        {"type": "response.completed",
         "response": response_snapshot(body, response_id, "completed", [done], usage)},
    ]  # fmt: skip
    return [{**event, "sequence_number": index} for index, event in enumerate(events)]


def encode(data: object) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()
