"""Responses create request => Chat Completions request body (DESIGN.md §6, "Request").

Owns every decision about what of a Responses request reaches a Chat Completions upstream (vLLM,
Ollama, llama.cpp, OpenAI): what is translated, what is respool's own business and stays behind,
and what nobody can honour and is refused with a 400 naming its `param` (STYLE.md §11). The rules
are listed in `to_chat_request`'s docstring. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from worker.errors import MissingParameterError, UnsupportedParameterError
from worker.translation.chat_messages import check_items, present, to_chat_messages
from worker.translation.chat_tools import ServerTool, call_shapes, tool_params

LOGPROBS_INCLUDE = "message.output_text.logprobs"

# Keys whose translation needs no more than a rename: Responses name => Chat Completions name.
_RENAMED = (
    # vLLM, Ollama and llama.cpp all read `max_tokens`; Ollama reads nothing else (its
    # ChatCompletionRequest has no `max_completion_tokens`), and OpenAI still accepts it for
    # non-reasoning models.
    ("max_output_tokens", "max_tokens"),
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
)

# Parameters that change what the model sees or says and that nobody here can honour. Every other
# key is translated, respool's own business, or unknown and ignored (PROTOCOL.md §10).
_REFUSED = {
    "prompt": "Prompt templates are not supported by this server.",
    "moderation": "Moderation is not supported by this server.",
}


def to_chat_request(
    request: dict[str, Any],
    input_items: list[dict[str, Any]],
    model: str,
    server_tools: tuple[ServerTool, ...] = (),
) -> dict[str, Any]:
    """The body for the upstream's `POST /v1/chat/completions`, always streamed with usage.

    `request` is the Responses create body as the client sent it (a stored one without its
    `input`, never read here), `input_items` the whole normalised conversation (earlier turns
    first), `model` the upstream's model name.

    Rules:
    - `instructions` and the conversation => `messages` (its rules: `chat_messages.to_chat_messages`)
    - `tools`, `tool_choice`, `parallel_tool_calls` => chat tools (their rules: `chat_tools.tool_params`)
    - `text.format` `json_schema` => `response_format{type: json_schema, json_schema{name,
      schema, strict, description}}`; `json_object` => `response_format{type: json_object}`;
      `text` => nothing; `text.verbosity` => `verbosity`
    - `max_output_tokens` => `max_tokens`; `temperature`, `top_p`, `*_penalty` => as is
    - `reasoning.effort` => `reasoning_effort`; `reasoning.summary` => nothing (open models stream
      raw reasoning, returned as `reasoning_text`, which is all a summary could be made from);
      `reasoning.mode` other than `standard` => 400
    - `include` has `message.output_text.logprobs` => `logprobs: true` and `top_logprobs: n`
      (when n > 0); without it `top_logprobs` => nothing, as OpenAI returns no logprobs either
    - `safety_identifier`, else `user` => `user`
    - `prompt`, `conversation`, `moderation` => 400 with that param
    - respool's own business => nothing: `metadata`, `store`, `background`, `previous_response_id`,
      `stream`, `stream_options`, `service_tier`, `prompt_cache_*`, `truncation` (`auto` cannot
      be applied without the model's context size; an over-long input fails upstream, as with
      `disabled`), `max_tool_calls` (it counts hosted tool calls, which are refused), `include`'s
      other entries
    - always `stream: true`, `stream_options{include_usage: true}`
    """
    _refuse_unhonourable(request)
    body: dict[str, Any] = {
        "model": model,
        "messages": to_chat_messages(request.get("instructions"), input_items),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(tool_params(request, server_tools))
    body.update({target: request[source] for source, target in _RENAMED if request.get(source) is not None})
    body.update(_reasoning_params(request.get("reasoning")))
    body.update(_text_params(request.get("text")))
    body.update(_logprob_params(request))
    user = request.get("safety_identifier") or request.get("user")
    if user:
        body["user"] = user
    return body


def check(request: dict[str, Any], items: list[dict[str, Any]]) -> None:
    """Raise the 400 that `to_chat_request` would raise for `request` with `items`, at create, so a
    worker never meets it; each rule is the one translation applies (it runs each item's and each
    parameter's), but no messages are assembled and nothing is kept."""
    _refuse_unhonourable(request)
    tool_params(request)
    _reasoning_params(request.get("reasoning"))
    _text_params(request.get("text"))
    check_items(items)


def includes_logprobs(request: dict[str, Any]) -> bool:
    """Whether the client asked for logprobs on output text (`include`, PROTOCOL.md §2)."""
    return LOGPROBS_INCLUDE in (request.get("include") or [])


def stream_options(request: dict[str, Any], server_tools: tuple[ServerTool, ...] = ()) -> dict[str, Any]:
    """What reading the upstream's stream needs to know of the request (`chat_stream.start_stream`)."""
    return {
        "include_logprobs": includes_logprobs(request),
        "top_logprobs": int(request.get("top_logprobs") or 0),
        "max_output_tokens": request.get("max_output_tokens"),
        "call_shapes": call_shapes(request, server_tools),
    }


def _refuse_unhonourable(request: dict[str, Any]) -> None:
    for key, message in _REFUSED.items():
        if request.get(key) is not None:
            raise UnsupportedParameterError(message, param=key)


def _reasoning_params(reasoning: dict[str, Any] | None) -> dict[str, Any]:
    if not reasoning:
        return {}
    if reasoning.get("mode") not in (None, "standard"):
        raise UnsupportedParameterError("Only the 'standard' mode is supported.", param="reasoning.mode")
    effort = reasoning.get("effort")
    return {"reasoning_effort": effort} if effort is not None else {}


def _text_params(text: dict[str, Any] | None) -> dict[str, Any]:
    if not text:
        return {}
    params = _response_format(text.get("format"))
    if text.get("verbosity") is not None:
        params["verbosity"] = text["verbosity"]
    return params


def _response_format(text_format: dict[str, Any] | None) -> dict[str, Any]:
    kind = (text_format or {}).get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind != "json_schema":
        raise UnsupportedParameterError(f"Text format '{kind}' is not supported.", param="text.format.type")
    assert text_format is not None  # kind came from it
    for key in ("name", "schema"):
        if text_format.get(key) is None:
            raise MissingParameterError(f"text.format.{key}")
    schema = present(text_format, "name", "schema", "strict", "description")
    return {"response_format": {"type": "json_schema", "json_schema": schema}}


def _logprob_params(request: dict[str, Any]) -> dict[str, Any]:
    if not includes_logprobs(request):
        return {}
    params: dict[str, Any] = {"logprobs": True}
    if request.get("top_logprobs"):
        params["top_logprobs"] = request["top_logprobs"]
    return params
