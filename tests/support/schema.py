"""Validation of respool's wire output against the Open Responses OpenAPI document.

The document (tests/support/openresponses/openapi.json, a verbatim copy of
shared/openresponses-openapi.json kept in the repository, or the file `RESPOOL_OPENRESPONSES_SCHEMA`
names) is loaded whole as the root, so its `#/components/schemas/...` refs resolve. Where it
differs from the `openai` SDK, which PROTOCOL.md follows, the difference is bridged here for
validation only (see the README next to the document):
- raw reasoning events are `response.reasoning_text.delta/.done` in the SDK and
  `response.reasoning.delta/.done` in the schema (same fields);
- the `error` event is flat in the SDK (PROTOCOL.md §4.2) and nested in the schema;
- `JsonSchemaResponseFormat.schema` is typed `null` in the schema, so an echoed json_schema
  `text.format` is checked without its `schema`.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

_ROOT = "urn:openresponses"
_DEFAULT_PATH = Path(__file__).resolve().parent / "openresponses" / "openapi.json"
_STREAM_SCHEMA = ("paths", "/responses", "post", "responses", "200", "content", "text/event-stream", "schema")
_SDK_TO_SCHEMA_TYPES = {
    "response.reasoning_text.delta": "response.reasoning.delta",
    "response.reasoning_text.done": "response.reasoning.done",
}


def validate_event(event: dict[str, Any]) -> None:
    """Raise `jsonschema.ValidationError` unless `event` (with `sequence_number`) is a valid stream event."""
    wire = _bridge_event(event)
    schema_ref = _event_schemas().get(wire.get("type"))
    if schema_ref is None:
        raise ValueError(f"the Open Responses schema has no stream event of type {event.get('type')!r}")
    _validator(schema_ref).validate(wire)


def validate_response(response: dict[str, Any]) -> None:
    """Raise `jsonschema.ValidationError` unless `response` is a valid `ResponseResource`."""
    _validator("#/components/schemas/ResponseResource").validate(_bridge_response(response))


def _bridge_event(event: dict[str, Any]) -> dict[str, Any]:
    kind = event.get("type")
    if kind == "error" and "error" not in event:
        payload = {
            "type": "error",
            "code": event.get("code"),
            "message": event.get("message"),
            "param": event.get("param"),
        }
        return {"type": "error", "sequence_number": event.get("sequence_number"), "error": payload}
    return {**event, "type": _SDK_TO_SCHEMA_TYPES.get(str(kind), kind)}


def _bridge_response(response: dict[str, Any]) -> dict[str, Any]:
    text_format = (response.get("text") or {}).get("format") or {}
    if text_format.get("type") != "json_schema":
        return response
    bridged = copy.deepcopy(response)
    bridged["text"]["format"]["schema"] = None
    return bridged


@functools.cache
def _document() -> dict[str, Any]:
    path = Path(os.environ.get("RESPOOL_OPENRESPONSES_SCHEMA", _DEFAULT_PATH))
    document: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return document


@functools.cache
def _registry() -> Registry[Any]:
    resource = Resource.from_contents(_document(), default_specification=DRAFT202012)
    return Registry().with_resource(_ROOT, resource)


@functools.cache
def _event_schemas() -> dict[str, str]:
    """Stream event type => the ref of its schema, from the `oneOf` under the SSE response."""
    node: Any = _document()
    for key in _STREAM_SCHEMA:
        node = node[key]
    schemas = {}
    for option in node["oneOf"]:
        name = option["$ref"].rsplit("/", 1)[-1]
        for kind in _document()["components"]["schemas"][name]["properties"]["type"]["enum"]:
            schemas[kind] = option["$ref"]
    return schemas


@functools.cache
def _validator(ref: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"{_ROOT}{ref}"}, registry=_registry())
