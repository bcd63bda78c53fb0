"""Chat Completions stream chunks => Responses stream events (DESIGN.md §6, "Stream").

Owns reading chunks: which delta means which output, when the stream ends and how (status,
`incomplete_details`, usage). How outputs are told as events (item and part boundaries, ids,
`.added`/`.done` pairs, PROTOCOL.md §0.4, §4.1) is `worker.translation.output`'s.

Events come out as on the wire, without `sequence_number` and without lifecycle events
(`response.created` ... `response.completed`): both belong to the caller. Pure: no I/O.

Rules:
- `delta.reasoning_content` / `delta.reasoning` => `reasoning` item, `reasoning_text` part,
  `response.reasoning_text.delta`
- `delta.content` => `message` item, `output_text` part, `response.output_text.delta` (with the
  chunk's `logprobs.content` when logprobs were asked for, else `[]`; each token's `top_logprobs`
  cut to the number asked for: llama-cpp-python adds the sampled token as one more)
- `delta.refusal` => `message` item, `refusal` part, `response.refusal.delta`
- `delta.tool_calls[i]` => `function_call` item per upstream `index` (a new `id` at a known index
  starts another call), `response.function_call_arguments.delta`; a call of a tool the request
  offered under another chat name (`chat_tools.CallShape`: a custom tool, or one in a namespace)
  => that tool's item: `custom_tool_call` with its `input`, or a call with its own name and `namespace`
- empty, role-only or null deltas => nothing
- `finish_reason` `length` => incomplete (`max_output_tokens`), `content_filter` => incomplete
  (`content_filter`), anything else => completed; items still open at the end are closed with
  the outcome's status. A stream with no `finish_reason` never gets here: the upstream call refuses
  it (`worker.runner.upstream.CHAT_STREAM`)
- a function call whose arguments are not JSON when the stream ends otherwise `completed`
  (llama-cpp-python says `tool_calls` when `max_tokens` cut the arguments short) => incomplete
  (`max_output_tokens`) if the request set `max_output_tokens` and the usage does not show it
  unreached; else a failure naming the call: never a `completed` call a client cannot parse
- `usage` on any chunk (the last one wins) => Responses usage (PROTOCOL.md §1.4)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from worker.errors import UpstreamStreamError
from worker.translation import output
from worker.translation.chat_tools import CallShape
from worker.translation.output import EventBody, Output

# PROTOCOL.md §1.2: `incomplete_details.reason` per chat `finish_reason` that ends a response early.
_INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}


@dataclass(frozen=True)
class Outcome:
    """How a response ended: what the terminal lifecycle event and the stored record carry."""

    status: Literal["completed", "incomplete"]
    incomplete_details: dict[str, str] | None
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


@dataclass
class ChatStream:
    """The state of one translated stream; make it with `start_stream`."""

    include_logprobs: bool = False
    top_logprobs: int = 0
    max_output_tokens: int | None = None
    call_shapes: dict[str, CallShape] = field(default_factory=dict)  # chat tool name => its item
    output: Output = field(default_factory=Output)
    call_ids: dict[int, str | None] = field(default_factory=dict)  # upstream tool call id per index
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None


def start_stream(
    *,
    include_logprobs: bool = False,
    top_logprobs: int = 0,
    max_output_tokens: int | None = None,
    call_shapes: dict[str, CallShape] | None = None,
    output: Output | None = None,
) -> ChatStream:
    """A fresh stream; `include_logprobs` puts the upstream's token logprobs on text events, with at
    most `top_logprobs` candidates each; `max_output_tokens` is the request's; `call_shapes` says
    which item a call of each offered chat tool is (`chat_tools.call_shapes`); `output` is the
    response's output so far, when this stream is one turn of a tool loop (DESIGN.md §10)."""
    return ChatStream(
        include_logprobs=include_logprobs,
        top_logprobs=top_logprobs,
        max_output_tokens=max_output_tokens,
        call_shapes=call_shapes or {},
        output=output if output is not None else Output(),
    )


def translate_chunk(state: ChatStream, chunk: dict[str, Any]) -> list[EventBody]:
    """The events one `chat.completion.chunk` adds (often none)."""
    if chunk.get("usage"):
        state.usage = responses_usage(chunk["usage"])
    choices = chunk.get("choices") or []
    if not choices:
        return []
    # respool never asks for n > 1, so the first choice is the only one.
    choice = choices[0]
    delta = choice.get("delta") or {}
    # Each kind of delta only where the chunk has one (a token's chunk has one kind).
    events = _on_reasoning(state, delta) if "reasoning_content" in delta or "reasoning" in delta else []
    if delta.get("content"):
        events += _on_content(state, delta, choice.get("logprobs"))
    if delta.get("refusal"):
        events += output.append_text(state.output, "message", "refusal", delta["refusal"])
    for tool_call in delta.get("tool_calls") or ():
        events += _on_tool_call(state, tool_call)
    if choice.get("finish_reason"):
        state.finish_reason = choice["finish_reason"]
    return events


def finish_stream(state: ChatStream) -> tuple[list[EventBody], Outcome]:
    """The `.done` events of every item still open, and the outcome."""
    reason = _INCOMPLETE_REASONS.get(state.finish_reason or "")
    if reason is None:
        reason = _cut_call_reason(state)
    status: Literal["completed", "incomplete"] = "incomplete" if reason else "completed"
    events = output.close_open(state.output, status)
    outcome = Outcome(
        status=status,
        incomplete_details={"reason": reason} if reason else None,
        output=output.output_items(state.output),
        usage=state.usage,
    )
    return events, outcome


def _cut_call_reason(state: ChatStream) -> str | None:
    """`max_output_tokens` if a call's arguments are not JSON because the token limit cut them; None
    if every call's are. Raises if they are not JSON for another reason (rules above)."""
    malformed = next((item for item in state.output.items if _has_malformed_arguments(item)), None)
    if malformed is None:
        return None
    limit, used = state.max_output_tokens, (state.usage or {}).get("output_tokens")
    if limit is not None and (state.usage is None or int(used or 0) >= limit):
        return "max_output_tokens"
    arguments = "".join(malformed.arguments)
    raise UpstreamStreamError(
        f"The model ended its call of '{malformed.fields['name']}' with arguments that are not valid "
        f"JSON: {arguments[:200]!r}."
    )


def _has_malformed_arguments(item: output.Item) -> bool:
    arguments = "".join(item.arguments)
    if item.type not in output.CALLS or not arguments.strip():  # no arguments at all: nothing cut
        return False
    try:
        orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return True
    return False


# --- one function per kind of delta -------------------------------------------------------------


def _on_reasoning(state: ChatStream, delta: dict[str, Any]) -> list[EventBody]:
    # llama.cpp and vLLM before its rename send `reasoning_content`, vLLM after it and Ollama
    # `reasoning`; vLLM releases in between sent both with the same text (vllm-project/vllm#27752),
    # so one is read, never both.
    text = delta.get("reasoning_content") or delta.get("reasoning")
    return output.append_text(state.output, "reasoning", "reasoning_text", text)


def _on_content(state: ChatStream, delta: dict[str, Any], logprobs: dict[str, Any] | None) -> list[EventBody]:
    if not state.include_logprobs:
        return output.append_text(state.output, "message", "output_text", delta.get("content"))
    tokens = (logprobs or {}).get("content") or []
    return output.append_text(
        state.output,
        "message",
        "output_text",
        delta.get("content"),
        [_logprob(token, state.top_logprobs) for token in tokens],
    )


def _on_tool_call(state: ChatStream, tool_call: dict[str, Any]) -> list[EventBody]:
    index = tool_call.get("index") or 0
    function = tool_call.get("function") or {}
    name, arguments, call_id = function.get("name"), function.get("arguments"), tool_call.get("id")
    item = output.call(state.output, index)
    events: list[EventBody] = []
    is_new_call = call_id and state.call_ids.get(index) and call_id != state.call_ids[index]
    if item is None or is_new_call:
        if not (call_id or name):
            return _orphan_arguments(index, arguments)
        shape = state.call_shapes.get(name or "")
        fields = None if shape is None else {"namespace": shape.namespace, "server_label": shape.server_label}
        item_type = shape.item_type if shape is not None else "function_call"
        called = shape.name if shape is not None else name
        events = output.open_call(state.output, index, call_id, called, fields, item_type=item_type)
        state.call_ids[index] = call_id
        item = output.call(state.output, index)
        assert item is not None
    if name and item.body is None and not item.fields.get("name"):
        shape = state.call_shapes.get(name)
        item.fields["name"] = shape.name if shape is not None else name
        if shape is not None and shape.namespace:
            item.fields["namespace"] = shape.namespace
    return events + output.append_arguments(item, arguments)


def _orphan_arguments(index: int, arguments: str | None) -> list[EventBody]:
    """Arguments for a call that never started or has ended: nothing if empty, else a failure."""
    if not arguments:
        return []
    raise UpstreamStreamError(f"The upstream streamed arguments for tool call {index} outside of that call.")


# --- shapes -------------------------------------------------------------------------------------


def _logprob(token: dict[str, Any], top_logprobs: int) -> dict[str, Any]:
    """A chat token logprob => a Responses one (PROTOCOL.md §1.5, `logprobs`), with at most
    `top_logprobs` candidates."""
    top = [_top_logprob(candidate) for candidate in (token.get("top_logprobs") or [])[:top_logprobs]]
    return {**_top_logprob(token), "top_logprobs": top}


def _top_logprob(token: dict[str, Any]) -> dict[str, Any]:
    text = str(token.get("token") or "")
    # `bytes` may be null upstream (OpenAI documents it); the Responses shape requires the list.
    return {
        "token": text,
        "logprob": token.get("logprob"),
        "bytes": token.get("bytes") or list(text.encode()),
    }


def responses_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Chat usage => Responses usage (PROTOCOL.md §1.4): every int present, 0 where unreported."""
    input_tokens = int(usage.get("prompt_tokens") or 0)
    output_tokens = int(usage.get("completion_tokens") or 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": int(cached or 0), "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": int(reasoning or 0)},
        "total_tokens": int(usage.get("total_tokens") or input_tokens + output_tokens),
    }


def add_usage(total: dict[str, Any] | None, more: dict[str, Any] | None) -> dict[str, Any] | None:
    """Usage over several upstream calls (a tool loop's turns, a compaction): every count summed."""
    if more is None:
        return total
    if total is None:
        return dict(more)
    summed: dict[str, Any] = {}
    for key, value in more.items():
        if isinstance(value, dict):
            summed[key] = {k: int(total.get(key, {}).get(k, 0)) + int(v) for k, v in value.items()}
        else:
            summed[key] = int(total.get(key) or 0) + int(value or 0)
    return summed
