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
  `text.format` is checked without its `schema`;
- the schema knows function tools only, and the items and events of messages, function calls,
  reasoning and compaction: tools of other types (`custom`, `namespace`, `mcp`, `web_search`, ...),
  a `tool_choice` naming one, items of other types (`custom_tool_call`, `mcp_call`, ...) and
  events the schema has no type for (`response.mcp_call.completed`, `response.compaction.compacting`,
  ...) are checked by the SDK's
  types alone (`tests/support/validating.py` checks every answer against both).
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


# What the SDK has and the schema does not (module docstring): checked by the SDK's types alone.
_SDK_ONLY_EVENT_PREFIXES = (
    "response.compaction.",
    "response.custom_tool_call_input.",
    "response.mcp_",
    "response.web_search_call.",
)
_SCHEMA_TOOLS = {"function"}
_SCHEMA_ITEMS = {"message", "function_call", "function_call_output", "reasoning", "compaction"}


def validate_event(event: dict[str, Any]) -> None:
    """Raise `jsonschema.ValidationError` unless `event` (with `sequence_number`) is a valid stream event."""
    kind = str(event.get("type"))
    if kind.startswith(_SDK_ONLY_EVENT_PREFIXES):
        return
    item = event.get("item")
    if isinstance(item, dict) and item.get("type") not in _SCHEMA_ITEMS:
        return
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
    if isinstance(event.get("response"), dict):
        event = {**event, "response": _bridge_response(event["response"])}
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
    bridged = copy.deepcopy(response)
    text_format = (bridged.get("text") or {}).get("format") or {}
    if text_format.get("type") == "json_schema":
        bridged["text"]["format"]["schema"] = None
    bridged["tools"] = [tool for tool in bridged.get("tools") or [] if tool.get("type") in _SCHEMA_TOOLS]
    choice = bridged.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") not in ("function", "allowed_tools"):
        bridged["tool_choice"] = "auto"
    if isinstance(bridged.get("output"), list):
        bridged["output"] = [item for item in bridged["output"] if item.get("type") in _SCHEMA_ITEMS]
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
