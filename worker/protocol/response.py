"""Building Response objects (PROTOCOL.md §1) from a validated request and the state of its run.

Every field the Open Responses schema requires is present, nullable ones as `null`
(shared/openresponses-openapi.README.md), and the request's parameters are echoed.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from worker.protocol.conversations import conversation_id
from worker.protocol.request import CreateRequest


class Status(StrEnum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    INCOMPLETE = "incomplete"
    CANCELLED = "cancelled"


LIVE = (Status.QUEUED, Status.IN_PROGRESS)
TERMINAL = (Status.COMPLETED, Status.FAILED, Status.INCOMPLETE, Status.CANCELLED)
TERMINAL_EVENTS = frozenset({"response.completed", "response.failed", "response.incomplete"})
# The ends after which a response's input and output join its conversation (DESIGN.md §11): a
# turn that happened; a failed or cancelled one leaves the conversation as it was, to be retried.
APPENDED = frozenset({Status.COMPLETED, Status.INCOMPLETE})


def build_response(
    request: CreateRequest, response_id: str, created_at: int, status: Status
) -> dict[str, Any]:
    """The Response as it stands before any output: echoes the request (PROTOCOL.md §1.2)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": str(status),
        "background": request.is_background,
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": request.max_tool_calls,
        "model": request.model,
        "output": [],  # PROTOCOL.md §0.6: always a list
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "conversation": None
        if request.conversation is None
        else {"id": conversation_id(request.conversation)},
        "prompt_cache_key": request.prompt_cache_key,
        "reasoning": request.reasoning,
        "safety_identifier": request.safety_identifier,
        "service_tier": request.service_tier or "default",
        "store": request.is_stored,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "text": _echo_text(request.text or {}),
        "tool_choice": "auto" if request.tool_choice is None else request.tool_choice,
        "tools": [_echo_tool(tool) for tool in request.tools or []],
        "top_logprobs": request.top_logprobs or 0,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "presence_penalty": _number(request, "presence_penalty", 0.0),
        "frequency_penalty": _number(request, "frequency_penalty", 0.0),
        "truncation": request.truncation or "disabled",
        "usage": None,
        "user": request.user,
        "metadata": request.metadata or {},
    }


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as echoed: `description`, `parameters`, `strict` present, null when not given."""
    if tool.get("type") != "function":
        return tool
    return {"description": None, "parameters": None, "strict": None, **tool}


def _echo_text(text: dict[str, Any]) -> dict[str, Any]:
    """`text` as echoed: the default format is `text`; a json_schema format has its `description`
    (null when not given) and `strict` (false when not given, OpenAI's default)."""
    echoed = {**text, "format": text.get("format") or {"type": "text"}}
    if echoed["format"].get("type") == "json_schema":
        echoed["format"] = {"description": None, **echoed["format"]}
        echoed["format"]["strict"] = bool(echoed["format"].get("strict"))
    return echoed


def _number(request: CreateRequest, name: str, default: float) -> float:
    value = (request.model_extra or {}).get(name)
    return value if isinstance(value, int | float) and not isinstance(value, bool) else default


def with_status(response: dict[str, Any], status: Status) -> dict[str, Any]:
    """A copy of `response` in another status."""
    return {**response, "status": str(status)}


def finished(
    response: dict[str, Any],
    status: Status,
    completed_at: int,
    **fields: Any,
) -> dict[str, Any]:
    """A copy of `response` in a terminal state; `completed_at` only for `completed` (PROTOCOL.md §7)."""
    done = {**response, "status": str(status), **fields}
    done["completed_at"] = completed_at if status == Status.COMPLETED else None
    return done


# A failed Response's `error.type` per `error.code`, where it is not `server_error`: as OpenAI types
# its HTTP errors of that code.
_ERROR_TYPES = {"model_not_found": "invalid_request_error", "rate_limit_exceeded": "requests"}


def failed(
    response: dict[str, Any],
    message: str,
    completed_at: int,
    code: str = "server_error",
    output: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A copy of `response` as `failed`, with a `ResponseError` (PROTOCOL.md §1.3): `code`,
    `message`, and its `type` (the Vercel AI SDK reads a failure without one as unparseable).

    `output` is what the response had streamed before it failed, its open items ended `incomplete`.
    """
    error = {"code": code, "message": message, "type": _ERROR_TYPES.get(code, "server_error")}
    return finished(response, Status.FAILED, completed_at, error=error, output=output or [])
