"""The routes (PROTOCOL.md §5): each parses, makes one call into the service, and returns."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Depends, Path, Query, Request, WebSocket
from starlette.convertors import StringConvertor, register_url_convertor
from starlette.responses import Response

from api import openapi
from api.auth import owner
from api.encoding import JSONAnswer
from api.errors import committed_error_response
from api.sse import sse_response, until_disconnected
from worker.errors import InvalidRequestError, WebSocketNotSupportedError
from worker.protocol.conversations import CONVERSATION_ID_PATTERN, ITEM_ID_PATTERN
from worker.protocol.request import RESPONSE_ID_PATTERN, check_no_nul
from worker.service.conversations import ConversationService
from worker.service.responses import ResponseService, Stream

Owner = Annotated[str, Depends(owner)]
# A response id of any other form is refused with 400 naming `response_id`, before any lookup.
ResponseId = Annotated[str, Path(pattern=RESPONSE_ID_PATTERN)]

# The largest cursor taken: any event's number is below it (JSON's safe integers; Redis ids are 64-bit).
MAX_SEQUENCE_NUMBER = 2**53 - 1


class _ResponseIdSegment(StringConvertor):
    """A path segment that may be a response id: any but OpenAI's own `/responses/compact` and
    `/responses/input_tokens`, routes of their own, never taken for ids."""

    regex = r"(?!(?:compact|input_tokens)(?:/|$))[^/]+"


register_url_convertor("response_id", _ResponseIdSegment())


def _service(request: Request) -> ResponseService:
    service: ResponseService = request.app.state.service
    return service


async def count_request(request: Request, owner: Owner) -> None:
    """Every /v1 request counts against its owner's rate (`RESPOOL_RATE_LIMIT_PER_MINUTE`), before
    its body is read."""
    await _service(request).quotas.check_rate(owner)


router = APIRouter(prefix="/v1", dependencies=[Depends(count_request)])


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidRequestError(
            "We could not parse the JSON body of your request: it is not valid JSON (UTF-8).", param=None
        ) from None
    if b"\\u0000" in raw:  # JSON can only spell NUL escaped; most bodies skip the walk
        check_no_nul(body)
    return body


@router.post(
    "/responses",
    operation_id="createResponse",
    responses=openapi.answers("Response", stream=True, body=True),
    openapi_extra=openapi.CREATE_BODY,
)
async def create_response(request: Request, owner: Owner) -> Response:
    """Create a response: JSON for background or foreground, SSE when `stream` (PROTOCOL.md §0.7)."""
    service = _service(request)
    created = await service.create(owner, await _json_body(request))
    response_id = created.response["id"]
    is_foreground = not created.request.is_background
    if created.stream is not None:
        return _relay(
            service, created.stream, _abandon(service, owner, response_id) if is_foreground else None
        )
    if not is_foreground:
        return JSONAnswer(created.response)
    try:
        final = await until_disconnected(request, service.wait(response_id))
    except Exception as exc:  # the job is committed: whatever failed, the client must not retry
        return committed_error_response(exc, service.settings.retry_after_seconds)
    if final is None:  # the client went away: nobody is left to answer
        await service.abandon(owner, response_id)
        return Response(status_code=499)
    return JSONAnswer(final)


def _abandon(service: ResponseService, owner: str, response_id: str) -> Callable[[], Awaitable[None]]:
    return lambda: service.abandon(owner, response_id)


def _relay(
    service: ResponseService, stream: Stream, on_disconnect: Callable[[], Awaitable[None]] | None = None
) -> Response:
    """The SSE response for `stream`; its slot is given back however it ends."""
    return sse_response(
        stream.events,
        stream.after,
        write_timeout_seconds=service.settings.sse_write_timeout_seconds,
        on_disconnect=on_disconnect,
        on_close=None if stream.slot is None else lambda: service.quotas.close_stream(stream.slot),
        passthrough=stream.passthrough,
    )


@router.post(
    "/responses/input_tokens",
    operation_id="countInputTokens",
    responses=openapi.answers("InputTokenCount", body=True),
    openapi_extra=openapi.INPUT_TOKENS_BODY,
)
async def count_input_tokens(request: Request, owner: Owner) -> Response:
    """How many tokens a create's input would be (the upstream's tokenizer, else an estimate: the
    `x-respool-token-count` header says which)."""
    counted, how = await _service(request).input_tokens(owner, await _json_body(request))
    return JSONAnswer(counted, headers={"x-respool-token-count": how})


@router.post(
    "/responses/compact",
    operation_id="compactResponse",
    responses=openapi.answers("CompactedResponse", body=True),
    openapi_extra=openapi.COMPACT_BODY,
)
async def compact_response(request: Request, owner: Owner) -> Response:
    """The window a create with this body would send, compacted: its user messages, then one
    `compaction` item that stands for the rest (sealed by respool, or the upstream's own)."""
    return JSONAnswer(await _service(request).compact(owner, await _json_body(request)))


@router.get(
    "/responses/{response_id:response_id}",
    operation_id="retrieveResponse",
    responses=openapi.answers("Response", stream=True),
)
async def retrieve_response(
    request: Request,
    response_id: ResponseId,
    owner: Owner,
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=0, le=MAX_SEQUENCE_NUMBER)] = None,
) -> Response:
    """Poll a response, or replay its events after `starting_after` and follow them (PROTOCOL.md §6.3)."""
    service = _service(request)
    if not stream:
        return JSONAnswer(await service.retrieve(owner, response_id))
    after = -1 if starting_after is None else starting_after
    return _relay(service, await service.replay(owner, response_id, after))


@router.post(
    "/responses/{response_id:response_id}/cancel",
    operation_id="cancelResponse",
    responses=openapi.answers("Response"),
)
async def cancel_response(request: Request, response_id: ResponseId, owner: Owner) -> Response:
    """Cancel a background response; the body (empty, PROTOCOL.md §0.10) is not read."""
    return JSONAnswer(await _service(request).cancel(owner, response_id))


@router.delete(
    "/responses/{response_id:response_id}",
    operation_id="deleteResponse",
    responses=openapi.answers("ResponseDeleted"),
)
async def delete_response(request: Request, response_id: ResponseId, owner: Owner) -> Response:
    return JSONAnswer(await _service(request).delete(owner, response_id))


@router.get(
    "/responses/{response_id:response_id}/input_items",
    operation_id="listInputItems",
    responses=openapi.answers("InputItemList"),
)
async def list_input_items(
    request: Request,
    response_id: ResponseId,
    owner: Owner,
    after: Annotated[str | None, Query(max_length=128, pattern=r"^[^\x00]*$")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> Response:
    """A page of the response's input items, newest first by default (PROTOCOL.md §5)."""
    page = await _service(request).input_items(owner, response_id, after, limit, order)
    return JSONAnswer(page)


# Conversations (PROTOCOL.md §8) ------------------------------------------------------------------

ConversationId = Annotated[str, Path(pattern=CONVERSATION_ID_PATTERN)]
ItemId = Annotated[str, Path(pattern=ITEM_ID_PATTERN)]


def _conversations(request: Request) -> ConversationService:
    return _service(request).conversations


@router.post(
    "/conversations",
    operation_id="createConversation",
    responses=openapi.answers("Conversation", body=True),
    openapi_extra=openapi.body("ConversationCreate"),
)
async def create_conversation(request: Request, owner: Owner) -> Response:
    return JSONAnswer(await _conversations(request).create(owner, await _json_body(request)))


@router.get(
    "/conversations/{conversation_id}",
    operation_id="retrieveConversation",
    responses=openapi.answers("Conversation"),
)
async def retrieve_conversation(request: Request, conversation_id: ConversationId, owner: Owner) -> Response:
    return JSONAnswer(await _conversations(request).retrieve(owner, conversation_id))


@router.post(
    "/conversations/{conversation_id}",
    operation_id="updateConversation",
    responses=openapi.answers("Conversation", body=True),
    openapi_extra=openapi.body("ConversationUpdate"),
)
async def update_conversation(request: Request, conversation_id: ConversationId, owner: Owner) -> Response:
    body = await _json_body(request)
    return JSONAnswer(await _conversations(request).update(owner, conversation_id, body))


@router.delete(
    "/conversations/{conversation_id}",
    operation_id="deleteConversation",
    responses=openapi.answers("ConversationDeleted"),
)
async def delete_conversation(request: Request, conversation_id: ConversationId, owner: Owner) -> Response:
    return JSONAnswer(await _conversations(request).delete(owner, conversation_id))


@router.post(
    "/conversations/{conversation_id}/items",
    operation_id="createConversationItems",
    responses=openapi.answers("ConversationItemList", body=True),
    openapi_extra=openapi.body("ConversationItemsCreate"),
)
async def create_conversation_items(
    request: Request,
    conversation_id: ConversationId,
    owner: Owner,
    include: Annotated[list[str] | None, Query(alias="include[]")] = None,
) -> Response:
    body = await _json_body(request)
    return JSONAnswer(await _conversations(request).add_items(owner, conversation_id, body))


@router.get(
    "/conversations/{conversation_id}/items",
    operation_id="listConversationItems",
    responses=openapi.answers("ConversationItemList"),
)
async def list_conversation_items(
    request: Request,
    conversation_id: ConversationId,
    owner: Owner,
    after: Annotated[str | None, Query(max_length=128, pattern=r"^[^\x00]*$")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    include: Annotated[list[str] | None, Query(alias="include[]")] = None,
) -> Response:
    """A page of the conversation's items, newest first by default."""
    page = await _conversations(request).list_items(owner, conversation_id, after, limit, order)
    return JSONAnswer(page)


@router.get(
    "/conversations/{conversation_id}/items/{item_id}",
    operation_id="retrieveConversationItem",
    responses=openapi.answers("ConversationItem"),
)
async def retrieve_conversation_item(
    request: Request,
    conversation_id: ConversationId,
    item_id: ItemId,
    owner: Owner,
    include: Annotated[list[str] | None, Query(alias="include[]")] = None,
) -> Response:
    return JSONAnswer(await _conversations(request).get_item(owner, conversation_id, item_id))


@router.delete(
    "/conversations/{conversation_id}/items/{item_id}",
    operation_id="deleteConversationItem",
    responses=openapi.answers("Conversation"),
)
async def delete_conversation_item(
    request: Request, conversation_id: ConversationId, item_id: ItemId, owner: Owner
) -> Response:
    """Delete one item; the answer is the Conversation (as the SDK has it)."""
    return JSONAnswer(await _conversations(request).delete_item(owner, conversation_id, item_id))


# WebSocket routes: the HTTP routes' dependencies take a `Request`, which a WebSocket scope is not.
websockets = APIRouter(prefix="/v1")


@websockets.websocket("/responses")
async def refuse_websocket(websocket: WebSocket) -> None:
    """The Responses API over WebSocket is not served: refused with 426 and an OpenAI-shaped error
    (README: Clients). Codex CLI falls back to HTTP at once, for the rest of its session, on a 426
    alone: any other refusal it retries five times first, and a bare 403 told nobody why."""
    error = WebSocketNotSupportedError()
    await websocket.send_denial_response(JSONAnswer(error.to_body(), status_code=error.status))


@router.get("/models", operation_id="listModels", responses=openapi.answers("ModelList"))
async def list_models(request: Request, owner: Owner) -> Response:
    return JSONAnswer({"object": "list", "data": _service(request).models()})
