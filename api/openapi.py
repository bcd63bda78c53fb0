"""respool's OpenAPI document (`/openapi.json`): the real request and response shapes of every route.

Answers are typed with the `openai` SDK's own models, which PROTOCOL.md follows (`Response`,
`ResponseItemList`, `Model`); the few answers the SDK leaves untyped (the error envelope of §5.6, a
deletion, the model list) are described here. The create body is `CreateRequest`'s schema: the route
parses the body itself so that every problem is a 400 naming its `param` (§5.6), so FastAPI does not
see it. FastAPI's 422 entries are dropped (respool answers 400) and every answer documents the
`x-request-id` it carries (§5.4). Schema-driven fuzzing (tests/api/test_fuzz.py) holds the service to
this document.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from openai.types import Model
from openai.types.conversations import Conversation, ConversationDeletedResource, ConversationItem
from openai.types.conversations import ConversationItemList as _SdkConversationItemList
from openai.types.responses import CompactedResponse, InputTokenCountResponse, Response, ResponseStreamEvent
from openai.types.responses.response_item_list import ResponseItemList
from pydantic import BaseModel, TypeAdapter

from worker.protocol.request import METADATA_SCHEMA, CreateRequest

_SCHEMAS = "#/components/schemas/"
_RETRY_AFTER = {
    "retry-after": {
        "description": "Seconds to wait before trying again (the SDK honours it).",
        "required": True,
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }
}
_REQUEST_ID = {
    "description": "This request's id, for support and logs (the SDK's `request_id`).",
    "required": True,
    "schema": {"type": "string", "pattern": "^req_[0-9a-f]{32}$"},
}
# One server-sent event as OpenAPI 3.1 tools read a `text/event-stream` schema: its `event:` and its
# `data:`, which is one stream event as JSON (PROTOCOL.md §4, §5.3: no `id:` lines).
_SSE_EVENT = {
    "type": "object",
    "required": ["event", "data"],
    "additionalProperties": False,
    "properties": {
        "event": {"type": "string", "description": "The `type` of the event in `data`."},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {"$ref": f"{_SCHEMAS}ResponseStreamEvent"},
        },
    },
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorEnvelope(BaseModel):
    """Every error, whatever its status (PROTOCOL.md §5.6)."""

    error: ErrorDetail


class InputItemList(ResponseItemList):
    """A page of input items; an empty page has no first or last id (null)."""

    first_id: str | None  # type: ignore[assignment]
    last_id: str | None  # type: ignore[assignment]


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class ConversationItemList(_SdkConversationItemList):
    """A page of a conversation's items; an empty page has no first or last id (null)."""

    first_id: str | None  # type: ignore[assignment]
    last_id: str | None  # type: ignore[assignment]


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class Status(BaseModel):
    status: Literal["ok"]


# Every shape an answer can take, named as in `components/schemas`; their schemas are generated
# together (`TypeAdapter.json_schemas`), so models they share are defined once, under one name.
_SHAPES: dict[str, TypeAdapter[Any]] = {
    "Response": TypeAdapter(Response),
    "ResponseStreamEvent": TypeAdapter(ResponseStreamEvent),
    "InputItemList": TypeAdapter(InputItemList),
    "ResponseDeleted": TypeAdapter(ResponseDeleted),
    "ModelList": TypeAdapter(ModelList),
    "InputTokenCount": TypeAdapter(InputTokenCountResponse),
    "CompactedResponse": TypeAdapter(CompactedResponse),
    "Conversation": TypeAdapter(Conversation),
    "ConversationDeleted": TypeAdapter(ConversationDeletedResource),
    "ConversationItem": TypeAdapter(ConversationItem),
    "ConversationItemList": TypeAdapter(ConversationItemList),
    "ErrorEnvelope": TypeAdapter(ErrorEnvelope),
    "Status": TypeAdapter(Status),
}


def _json(shape: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"{_SCHEMAS}{shape}"}}}


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "description": description,
        "content": _json("ErrorEnvelope"),
        **({"headers": headers} if headers else {}),
    }


_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _error("The request is invalid; `param` names what is wrong."),
    401: _error("The API key is missing or wrong."),
    404: _error("No such response, conversation or item for this key (or no such model)."),
    429: _error("Too many requests: come back after `retry-after` seconds.", _RETRY_AFTER),
    503: _error("Redis or Postgres is unreachable: come back after `retry-after` seconds.", _RETRY_AFTER),
}


def answers(shape: str, *, stream: bool = False, body: bool = False) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=`: its success answer (JSON `shape`, or SSE with `stream`) and its errors
    (408 and 413 too where it takes a `body`)."""
    content = _json(shape) | ({"text/event-stream": {"schema": _SSE_EVENT}} if stream else {})
    success: dict[int | str, dict[str, Any]] = {200: {"description": "Success", "content": content}}
    body_errors: dict[int | str, dict[str, Any]] = {
        408: _error("The body did not arrive within `RESPOOL_BODY_TIMEOUT_SECONDS`."),
        413: _error("The body is larger than `RESPOOL_MAX_BODY_BYTES`."),
    }
    return {**success, **_ERRORS, **(body_errors if body else {})}


READY: dict[int | str, dict[str, Any]] = {
    200: {"description": "Success", "content": _json("Status")},
    503: _ERRORS[503],
}


def _links(parameter: str, operations: dict[str, str]) -> dict[str, Any]:
    """Links from a created object's `id` to the operations that take it as `parameter`."""
    return {
        name: {"operationId": operation, "parameters": {parameter: "$response.body#/id"}}
        for name, operation in operations.items()
    }


# What a client does next with a created response or conversation, for tools that follow links
# (schemathesis' stateful phase reaches the routes that take an id through them).
_LINKS = _links(
    "response_id",
    {
        "RetrieveResponse": "retrieveResponse",
        "CancelResponse": "cancelResponse",
        "DeleteResponse": "deleteResponse",
        "ListInputItems": "listInputItems",
    },
)
_CONVERSATION_LINKS = _links(
    "conversation_id",
    {
        "RetrieveConversation": "retrieveConversation",
        "UpdateConversation": "updateConversation",
        "DeleteConversation": "deleteConversation",
        "ListConversationItems": "listConversationItems",
        "CreateConversationItems": "createConversationItems",
    },
)


def _create_body(required: tuple[str, ...]) -> dict[str, Any]:
    """A create-shaped body: `model` and `input` are optional in `CreateRequest` only so that their
    absence is a 400 naming them (PROTOCOL.md §5.6); on the wire those in `required` are required
    (both for a create; `model` for an input token count)."""
    schema = CreateRequest.model_json_schema(mode="validation")
    for name in required:
        schema["properties"][name]["anyOf"] = [
            option for option in schema["properties"][name]["anyOf"] if option.get("type") != "null"
        ]
    schema["required"] = list(required)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


CREATE_BODY = _create_body(("model", "input"))
INPUT_TOKENS_BODY = _create_body(("model",))
COMPACT_BODY = _create_body(("model",))

# The Conversations API's request bodies (the SDK's params types; worker/protocol/conversations.py
# enforces them).
_ITEMS = {"type": "array", "maxItems": 20, "items": {"type": "object"}}
_METADATA = {"anyOf": [{"type": "object", **METADATA_SCHEMA}, {"type": "null"}]}
_BODIES: dict[str, dict[str, Any]] = {
    "ConversationCreate": {
        "type": "object",
        "properties": {"items": {"anyOf": [_ITEMS, {"type": "null"}]}, "metadata": _METADATA},
    },
    "ConversationUpdate": {"type": "object", "properties": {"metadata": _METADATA}, "required": ["metadata"]},
    "ConversationItemsCreate": {
        "type": "object",
        "properties": {"items": {**_ITEMS, "minItems": 1}},
        "required": ["items"],
    },
}


def body(name: str) -> dict[str, Any]:
    """A route's `openapi_extra` for a JSON body of the shape `name` (the route reads it itself)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": _BODIES[name]}}}}


def install(app: FastAPI, *, secured: bool) -> None:
    """Serve the finished document; `secured`: every `/v1` route needs a bearer key."""

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _finish(
                get_openapi(title=app.title, version=_version(), routes=app.routes), secured
            )
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]


def _finish(document: dict[str, Any], secured: bool) -> dict[str, Any]:
    for path, operations in document["paths"].items():
        for operation in operations.values():
            operation["responses"].pop("422", None)  # respool answers 400 (api/errors.py)
            for answer in operation["responses"].values():
                answer.setdefault("headers", {})["x-request-id"] = _REQUEST_ID
            if secured and path.startswith("/v1/"):
                operation["security"] = [{"bearer": []}]
            if operation.get("operationId") == "createResponse":
                operation["responses"]["200"]["links"] = _LINKS
            if operation.get("operationId") == "createConversation":
                operation["responses"]["200"]["links"] = _CONVERSATION_LINKS
    components = document.setdefault("components", {})
    components["schemas"] = _shape_schemas()  # FastAPI's own (its 422 shapes) are not answered
    if secured:
        components["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "A key of RESPOOL_API_KEYS."}
        }
    return document


def _shape_schemas() -> dict[str, Any]:
    named, definitions = TypeAdapter.json_schemas(
        [(name, "serialization", adapter) for name, adapter in _SHAPES.items()],
        ref_template=_SCHEMAS + "{model}",
    )
    schemas: dict[str, Any] = dict(definitions.get("$defs", {}))
    for (name, _mode), schema in named.items():
        if schema != {"$ref": _SCHEMAS + name}:  # a union, or a model pydantic names otherwise
            if name in schemas:
                raise ValueError(f"two shapes are named {name!r} in the OpenAPI document")
            schemas[name] = schema
    return schemas


def _version() -> str:
    try:
        return metadata.version("respool")
    except metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "0"
