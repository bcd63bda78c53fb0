"""Validating a create request (`POST /v1/responses` body, PROTOCOL.md §2) into a typed record.

Pydantic sits at this wire edge only; every failure becomes an `InvalidRequestError` naming its `param`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from openai.types.responses.service_tier import ServiceTier
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from worker.errors import (
    InvalidRequestError,
    MissingParameterError,
    UnsupportedParameterError,
)

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512

# The metadata limits as JSON Schema, for respool's OpenAPI document (the validator below enforces them).
METADATA_SCHEMA: dict[str, Any] = {
    "maxProperties": MAX_METADATA_PAIRS,
    "propertyNames": {"maxLength": MAX_METADATA_KEY},
    "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE},
}
Probability = Annotated[float, Field(ge=0, le=1)]
# A response id as respool mints them (worker/ids.py) or OpenAI does: `resp_` and up to 59 more
# characters (the column holds 64). Any other form is refused (400) before it reaches a lookup.
RESPONSE_ID_PATTERN = r"^resp_[A-Za-z0-9_-]{1,59}$"
ResponseId = Annotated[str, Field(pattern=RESPONSE_ID_PATTERN)]


class ContextManagement(BaseModel):
    """One `context_management` entry: compaction past `compact_threshold` input tokens."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["compaction"]
    compact_threshold: Annotated[int, Field(ge=1)] | None = None


class CreateRequest(BaseModel):
    """The create body. Unknown keys are kept (and ignored), PROTOCOL.md §10 "accepts unknown keys"."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    background: bool | None = None
    store: bool | None = None
    previous_response_id: ResponseId | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    include: list[str] | None = None
    metadata: Annotated[dict[str, str] | None, Field(json_schema_extra=METADATA_SCHEMA)] = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Probability | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: ServiceTier = None
    user: str | None = None
    safety_identifier: Annotated[str, Field(max_length=128)] | None = None
    prompt_cache_key: str | None = None
    context_management: list[ContextManagement] | None = None

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(value)

    @property
    def is_background(self) -> bool:
        return bool(self.background)

    @property
    def is_stored(self) -> bool:
        """`store` defaults to true (PROTOCOL.md §2)."""
        return self.store is not False

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)


def check_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """`metadata` within OpenAI's limits (16 pairs, keys of 64 characters, values of 512); else
    `ValueError` saying which."""
    if value is None:
        return value
    if len(value) > MAX_METADATA_PAIRS:
        raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs are allowed")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY:
            raise ValueError(f"keys are at most {MAX_METADATA_KEY} characters")
        if len(item) > MAX_METADATA_VALUE:
            raise ValueError(f"values are at most {MAX_METADATA_VALUE} characters")
    return value


def check_no_nul(body: object, path: list[str | int] | None = None) -> None:
    """Refuse a NUL character (U+0000) in any string or key of `body` with a 400 naming where: no
    Postgres text or jsonb value can hold one, so it could not be recorded."""
    path = path or []
    if isinstance(body, str):
        if "\x00" in body:
            raise InvalidRequestError(
                "Strings cannot contain the NUL character (\\u0000).", param=_param_path(path) or None
            )
    elif isinstance(body, dict):
        for key, value in body.items():
            check_no_nul(key, path)
            check_no_nul(value, [*path, key])
    elif isinstance(body, list):
        for index, value in enumerate(body):
            check_no_nul(value, [*path, index])


def parse_create_request(body: object) -> CreateRequest:
    """Validate a decoded JSON body; raise `InvalidRequestError` (with `param`) on the first problem."""
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.", param=None)
    try:
        request = CreateRequest.model_validate(body)
    except ValidationError as exc:
        raise _to_invalid_request(exc) from None
    _check_combinations(request)
    return request


def _to_invalid_request(exc: ValidationError) -> InvalidRequestError:
    error = exc.errors()[0]
    # The param is the field, without the union-member names pydantic adds to the location.
    path = [part for part in error["loc"] if isinstance(part, int) or not _is_type_tag(part)]
    param = _param_path(path)
    return InvalidRequestError(f"Invalid value for '{param}': {error['msg']}.", param=param)


def _is_type_tag(part: str | int) -> bool:
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "list", "dict"})


def _param_path(path: list[str | int]) -> str:
    param = ""
    for part in path:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    return param


def _check_combinations(request: CreateRequest) -> None:
    if request.model is None:
        raise MissingParameterError("model")
    if request.input is None:
        raise MissingParameterError("input")
    if request.background and request.store is False:
        # PROTOCOL.md §7: "Background sampling requires store=true".
        raise UnsupportedParameterError(
            "Background responses must be stored: 'background' requires 'store' to be true.",
            param="background",
        )
    if request.conversation is not None and request.previous_response_id is not None:
        raise InvalidRequestError(
            "'previous_response_id' cannot be used together with 'conversation'.",
            param="previous_response_id",
        )
    if request.prompt is not None:
        raise UnsupportedParameterError("Prompt templates are not supported by this server.", param="prompt")
