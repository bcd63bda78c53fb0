"""The service layer the API calls (DESIGN.md §2): create, retrieve, follow, cancel, delete, list.

It owns every transaction and enqueues only after the commit (STYLE.md boundary 4). Each method
takes the caller's `owner`; a response of another owner is "not found", on every path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

import httpx2
import orjson
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from worker import logs, token_count
from worker.connections import blocking_client, connect, sync_client
from worker.errors import (
    ConversationNotFoundError,
    InvalidRequestError,
    OutboundRefusedError,
    OverloadedError,
    ResponseNotFoundError,
    UnavailableAfterCommitError,
    UpstreamFailedError,
)
from worker.events.stream import (
    Event,
    encode,
    last_event,
    read_events,
)
from worker.ids import new_id
from worker.keys import cancel_key, lease_key, response_keys
from worker.outages import is_postgres_outage, is_redis_outage
from worker.outbound import OutboundPolicy
from worker.postgres import conversations, direct, store
from worker.postgres.direct import DirectPool
from worker.postgres.keys import compaction_sealer
from worker.protocol import compaction, tools
from worker.protocol.compaction import Sealer
from worker.protocol.conversations import conversation_id
from worker.protocol.items import check_tool_outputs, normalize_input, page
from worker.protocol.request import CreateRequest, parse_create_request
from worker.protocol.response import LIVE, TERMINAL, Status, build_response, with_status
from worker.queue import TICKET_MAX_BYTES, ResponseQueue, delivery_queue
from worker.routing import Route, Routes, load_routes
from worker.service import chains
from worker.service.cancellation import CANCEL_FLAG_SECONDS, Cancellation
from worker.service.conversations import ConversationService
from worker.service.quota import Quotas, StreamSlot
from worker.service.tail_outage import TailLostError
from worker.service.tailer import TAILER_BLOCK_MS, Passthrough, Tailer
from worker.settings import Settings
from worker.translation import chat_request, native
from worker.webhooks import Notifier

log = logging.getLogger("respool.service")

# How long `/readyz` gives Postgres to answer (a connect included): its answer, a 503 if Postgres
# hangs, is out within 2 s, a probe's usual timeout.
READY_SECONDS = 1.5

# What `POST /responses/compact` takes of its body (the SDK's `ResponseCompactParams` that matter here).
_COMPACT_PARAMS = ("model", "input", "instructions", "previous_response_id")


@dataclass(frozen=True)
class Stream:
    """An event stream to relay: the events after `after`, and the slot it holds until it ends
    (None while streams are unlimited); `Quotas.close_stream` gives the slot back."""

    events: AsyncIterator[Event | None]
    after: int
    slot: StreamSlot | None
    passthrough: Passthrough | None = None  # where the relay may write live events (`Passthrough`)


@dataclass(frozen=True)
class Created:
    """What a create produced: the Response now, and for `stream`/foreground how to follow it."""

    response: dict[str, Any]
    request: CreateRequest
    stream: Stream | None = None


class ResponseService:
    """One per API process: its connections, the routing table and the tailer."""

    def __init__(
        self, settings: Settings, engine: AsyncEngine, direct: DirectPool, redis: Redis, sync_redis: SyncRedis
    ) -> None:
        self.settings = settings
        self.outbound = OutboundPolicy.parse(settings.outbound_allowlist)
        self.engine = engine
        self.autocommit = store.single_statements(engine)  # for one-statement work
        self.direct = direct  # the hot single statements (a create's insert, a poll's read)
        self.redis = redis
        self.queue = ResponseQueue(redis, settings.queue, settings.registry_seconds)
        self.sync_redis = sync_redis  # RQ's: it builds the deliveries' enqueue commands
        self.routes: Routes = load_routes(settings)
        # A finished response's terminal event is waited for past its writer's lease (see `follow`).
        finishing = settings.lease_seconds + 5
        self.tailer = Tailer(
            redis,
            blocking_client(settings.redis_url, TAILER_BLOCK_MS / 1000, settings.redis_timeout_seconds),
            block_ms=TAILER_BLOCK_MS,
            finishing_seconds=finishing,
            batch_seconds=settings.batch_ms / 1000,
            outage_seconds=settings.redis_outage_seconds,
            timeout_seconds=settings.redis_timeout_seconds,
        )
        self.notifier = Notifier(self.routes.webhooks, redis, delivery_queue(sync_redis, settings.queue))
        self.cancellation = Cancellation(settings, engine, self.autocommit, redis, self.queue, self.notifier)
        self.conversations = ConversationService(engine)
        self.http = httpx2.AsyncClient(trust_env=False)  # to upstreams' tokenizers
        self.quotas = Quotas(redis, settings)
        self._sealer: Sealer | None = None
        self._taking_back: set[asyncio.Task[bool]] = set()  # rows an insert's outage left behind

    @classmethod
    def open(cls, settings: Settings) -> ResponseService:
        engine, direct = store.open_pools(settings)
        timeout = settings.redis_timeout_seconds
        redis = connect(settings.redis_url, max_connections=256, timeout_seconds=timeout)
        sync_redis = sync_client(settings.redis_url, timeout)
        return cls(settings, engine, direct, redis, sync_redis)

    async def start(self) -> None:
        await self.tailer.start()
        self.quotas.start()

    async def close(self) -> None:
        await self.quotas.stop()
        await self.tailer.stop()
        await self.engine.dispose()
        await self.direct.close()
        await self.http.aclose()
        await self.queue.close()
        await self.redis.aclose()
        self.sync_redis.close()

    # Create ----------------------------------------------------------------------------------

    async def create(self, owner: str, body: object) -> Created:
        """Validate, record and enqueue a response (DESIGN.md §2.1); nothing is written on a 400."""
        request = parse_create_request(body)
        assert request.model is not None and request.input is not None
        if compaction.COMPACT in (request.model_extra or {}):
            raise InvalidRequestError(f"Unknown parameter: '{compaction.COMPACT}'.", param=compaction.COMPACT)
        route = self.routes.resolve(request.model)
        own_items = self._own_items(request)
        await self._check_queue_depth()
        # A stream takes its slot before anything is recorded: refused, it is safe to retry.
        slot = await self.quotas.open_stream(owner) if request.is_stream else None
        try:
            response = await self._record(owner, request, route, own_items)
        except BaseException:
            await self.quotas.close_stream(slot)
            raise
        if not request.is_stream:
            return Created(response, request)
        through = Passthrough()
        events = self.tailer.follow(
            response["id"], -1, self.settings.sse_heartbeat_seconds, is_new=True, passthrough=through
        )
        return Created(response, request, Stream(events, -1, slot, through))

    def _own_items(self, request: CreateRequest) -> list[dict[str, Any]]:
        """The request's input as items, at most RESPOOL_MAX_INPUT_ITEMS of them."""
        assert request.input is not None
        own_items = normalize_input(request.input)
        if len(own_items) > self.settings.max_input_items:
            raise InvalidRequestError(
                f"'input' has {len(own_items):,} items; this server accepts at most "
                f"{self.settings.max_input_items:,} in one request (RESPOOL_MAX_INPUT_ITEMS).",
                param="input",
            )
        return own_items

    async def _record(
        self, owner: str, request: CreateRequest, route: Route, own_items: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """Record the response and enqueue it; its Response as created.

        What the upstream could not be sent is refused before any I/O (`_check_translatable`). A
        Redis outage refuses the create safely (the SDK retries it): the row its enqueue could not
        follow is taken back (`_enqueue_failed`), so nothing is left recorded; no round trip asks
        Redis first.
        """
        response_id = new_id("resp")
        logs.RESPONSE_ID.set(response_id)
        request, secrets = self._tool_secrets(request)
        response = build_response(request, response_id, int(time.time()), Status.QUEUED)
        self._leave_out_unavailable(route, request, response)
        sealer = await self._sealer_for(own_items)
        compaction.check_input(own_items, sealer, owner, native=route.is_native)
        _check_translatable(route, request, own_items, sealer, owner)
        # In autocommit: the history read, then one insert (store.insert_response), one round trip each.
        async with self.direct.connection() as conn:
            history = await chains.history(
                conn, owner, request.previous_response_id, self.settings.max_chain_depth
            )
            on = None if request.conversation is None else conversation_id(request.conversation)
            if on is not None:  # DESIGN.md §11: its items come before the input
                async with self.autocommit.connect() as reading:
                    history = await self._conversation_history(reading, owner, on, route, request)
            conversation = history.items + own_items
            check_tool_outputs(conversation, len(history.items))
            # Its items were checked for the kind of upstream its model had; another kind checks them.
            if history.items and self.routes.native_for(history.model) != route.is_native:
                sealer = await self._sealer_for(history.items)
                _check_translatable(route, request, history.items, sealer, owner)
            row = store.new_row(owner, request, response, conversation, history.depth, on)
            await self._insert_and_enqueue(conn, owner, request, row, own_items, secrets)
        return response

    async def _insert_and_enqueue(
        self,
        conn: direct.Connection,
        owner: str,
        request: CreateRequest,
        row: dict[str, Any],
        own_items: list[dict[str, Any]],
        secrets: bytes | None,
    ) -> None:
        """Insert the row and queue the response (DESIGN.md §2.1).

        With a ticket (the row, for the worker: `store.ticket`) the response is queued first and
        its row inserted while a worker takes it: the worker calls the upstream without reading the
        row, and waits for it only to claim it (attempt._run_ahead). Should the insert fail, the
        response is taken back out of the queue (`_unqueue`). Without a ticket the worker reads the
        row: it is inserted first. A background response's row is inserted first too: nobody waits
        on its worker's first events, and its worker, which starts it told (its take appends its
        `in_progress`, `queue.ResponseQueue.take_started`), could end a short answer before the row
        was there: its end then cost two statements more and a wait (`_when_the_row_is_there`).
        """
        response = row["response"]
        ticket = store.ticket(row, TICKET_MAX_BYTES)
        if ticket is None or request.is_background:
            await store.insert_response(conn, row, len(own_items))
            await self._enqueue(owner, request, response, secrets, ticket)
            return
        enqueuing = asyncio.ensure_future(self._queue(request, response, secrets, ticket))
        await asyncio.sleep(0)  # the enqueue's script goes out before the insert is even built
        try:
            await store.insert_response(conn, row, len(own_items))
        except Exception:
            await self._unqueue(response["id"], enqueuing)
            raise
        try:
            await enqueuing
        except RedisError as exc:
            await self._enqueue_failed(owner, response, exc)

    async def _unqueue(self, response_id: str, enqueuing: asyncio.Future[None]) -> None:
        """Take a response whose row could not be inserted out of the queue, with its keys; a worker
        that took it already is stopped by the cancel flag (its end finds no row: it records
        nothing). A row an outage may have committed unseen is deleted."""
        try:
            await enqueuing
            if await self.queue.remove_queued(response_id):
                await self.redis.delete(*response_keys(response_id))
            else:
                await self.redis.set(cancel_key(response_id), "1", ex=CANCEL_FLAG_SECONDS)
        except Exception as exc:  # Redis is away too: nothing queued, or a worker finds no row
            log.warning("response %s: not taken out of the queue (%s)", response_id, type(exc).__name__)
        # In the background: the insert met an outage, and a Postgres that hangs would hold the
        # client's 503 for a second statement's deadline.
        taking_back = asyncio.get_running_loop().create_task(self._take_back(response_id))
        self._taking_back.add(taking_back)
        taking_back.add_done_callback(self._taken_back)

    async def _conversation_history(
        self, conn: AsyncConnection, owner: str, on: str, route: Route, request: CreateRequest
    ) -> chains.History:
        """A conversation's items, as the turns a response on it runs after (checked for its model's
        upstream: they were added through the items routes, which no model checked); a 404 naming
        `conversation` if the owner has none such."""
        if await conversations.get(conn, on, owner) is None:
            raise ConversationNotFoundError(on, param="conversation")
        items = await conversations.all_items(conn, on)
        if len(items) > self.settings.max_input_items:
            raise InvalidRequestError(
                f"Conversation '{on}' holds {len(items):,} items; this server runs at most "
                f"{self.settings.max_input_items:,} in one request (RESPOOL_MAX_INPUT_ITEMS). Start a "
                "new conversation, passing what matters as input.",
                param="conversation",
            )
        _check_translatable(route, request, items, await self._sealer_for(items), owner)
        return chains.History(items, 0, None)

    def _tool_secrets(self, request: CreateRequest) -> tuple[CreateRequest, bytes | None]:
        """The request with its `mcp` tools checked (a 400 names what is wrong; a URL that names a
        blocked address is refused here, before any I/O) and their secrets taken out; the secrets."""
        if not request.tools:
            return request, None
        tools.check_types(request.tools)
        tools.check_mcp(request.tools, frozenset(self.routes.mcp_servers))
        for index, tool in tools.mcp_tools(request.tools):
            if tool.get("server_url") is not None:
                try:
                    self.outbound.check_url(str(tool["server_url"]))
                except OutboundRefusedError as exc:
                    raise InvalidRequestError(exc.message, param=f"tools[{index}].server_url") from exc
        clean, secrets = tools.split_secrets(request.tools)
        if not secrets:
            return request, None
        return request.model_copy(update={"tools": clean}), orjson.dumps(secrets)

    def _leave_out_unavailable(self, route: Route, request: CreateRequest, response: dict[str, Any]) -> None:
        """The server-side tools this deployment cannot run (a chat route's; a Responses upstream runs
        its own): refused, or left out and named on the Response (`RESPOOL_UNAVAILABLE_TOOLS`)."""
        if route.is_native:
            return
        # The server-side tool types the worker runs (DESIGN.md §10); the rest are unavailable.
        runnable = tools.RUN_BY_RESPOOL | (
            tools.WEB_SEARCH_TYPES if self.settings.web_search_backend else set()
        )
        tools.check_tool_choice(request.tools or [], request.tool_choice, runnable)
        if not request.tools:
            return
        if self.settings.unavailable_tools == "reject":
            tools.refuse_unavailable(request.tools, runnable)
        left_out = tools.unavailable(request.tools, runnable)
        if left_out:
            response["unavailable_tools"] = [tools.unavailable_note(tool) for _, tool in left_out]
            log.info(
                "response %s: left out tools this server cannot run: %s",
                response["id"],
                ", ".join(str(tool.get("type")) for _, tool in left_out),
            )

    async def _sealer_for(self, items: list[dict[str, Any]]) -> Sealer | None:
        """The compaction sealer if `items` hold compaction items (it is loaded on first use)."""
        return await self.sealer() if compaction.has_compaction(items) else None

    async def sealer(self) -> Sealer:
        if self._sealer is None:
            self._sealer = await compaction_sealer(self.engine, self.settings.compaction_keys)
        return self._sealer

    async def queue_depth(self) -> int:
        """How many responses wait in the queue for a worker."""
        return await self.queue.depth()

    async def _check_queue_depth(self) -> None:
        """Refuse new work while the queue is over its limit, before anything is recorded."""
        limit = self.settings.max_queue_depth
        if limit <= 0:
            return
        depth = await self.queue_depth()
        if depth >= limit:
            raise OverloadedError(
                f"respool has {depth} responses waiting, its limit (RESPOOL_MAX_QUEUE_DEPTH); retry shortly."
            )

    async def _enqueue(
        self,
        owner: str,
        request: CreateRequest,
        response: dict[str, Any],
        secrets: bytes | None,
        ticket: bytes | None,
    ) -> None:
        """Queue a recorded response; should Redis fail, `_enqueue_failed`."""
        try:
            await self._queue(request, response, secrets, ticket)
        except RedisError as exc:
            await self._enqueue_failed(owner, response, exc)

    async def _queue(
        self, request: CreateRequest, response: dict[str, Any], secrets: bytes | None, ticket: bytes | None
    ) -> None:
        """The response's first events and its place in the queue (queue.ResponseQueue.enqueue)."""
        created = response if request.is_background else with_status(response, Status.IN_PROGRESS)
        first = [encode({"type": "response.created", "response": created}, 0)]
        announce = b""
        if request.is_background:
            first.append(encode({"type": "response.queued", "response": response}, 1))
            if ticket is not None:  # appended by the take that starts it (`queue.take_started`)
                running = with_status(response, Status.IN_PROGRESS)
                announce = encode({"type": "response.in_progress", "response": running}, 2).data
        kept = None if secrets is None else (secrets, self.settings.tool_secrets_seconds)
        # A create that answers with the response's events or its end follows it from the first.
        is_relayed = request.is_stream or not request.is_background
        await self.queue.enqueue(
            response["id"], first, kept, ticket, is_relayed=is_relayed, announce=announce
        )

    async def _enqueue_failed(self, owner: str, response: dict[str, Any], exc: RedisError) -> NoReturn:
        """Whether the response reached the queue is unknown (a timeout may come after Redis ran
        it): its row is taken back, so one Redis did queue finds none and runs nowhere, and the
        SDK's retry creates the response afresh. Should Postgres not let it go, the row is failed
        (or the sweep fails it), and the SDK must not retry."""
        log.error("response %s: enqueue failed: %s", response["id"], exc)
        if await self._take_back(response["id"]):
            raise exc
        await self._fail_unqueued(owner, response)
        raise UnavailableAfterCommitError(
            f"The queue is unavailable: response '{response['id']}' was recorded but could not be "
            "queued, and has been marked failed. Retry the request shortly."
        ) from exc

    def _taken_back(self, task: asyncio.Task[bool]) -> None:
        self._taking_back.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("response %s: its take-back failed", logs.RESPONSE_ID.get(), exc_info=task.exception())

    async def _take_back(self, response_id: str) -> bool:
        """Delete a row whose enqueue failed (and its input items); whether it is gone."""
        try:
            async with self.autocommit.connect() as conn:
                await store.delete_response(conn, response_id)
        except Exception as exc:
            if not is_postgres_outage(exc):
                raise
            log.error("response %s: could not take back the unqueued response", response_id)
            return False
        return True

    async def _fail_unqueued(self, owner: str, response: dict[str, Any]) -> None:
        try:
            delivery_ids: list[str] = []
            async with self.engine.begin() as conn:
                won = await store.mark_failed(conn, response["id"], {**response, "status": "failed"})
                if won:  # a background one's owner is told (the sweep queues it: Redis is away)
                    delivery_ids = await self.notifier.record(conn, response["id"], owner, Status.FAILED)
            await self.notifier.send(delivery_ids)
        except Exception as exc:
            if not is_postgres_outage(exc):
                raise
            # Postgres is gone too: the workers' sweep ends the row later.
            log.error("response %s: could not mark the unqueued response failed", response["id"])

    # Read ------------------------------------------------------------------------------------

    async def input_tokens(self, owner: str, body: object) -> tuple[dict[str, Any], str]:
        """`POST /responses/input_tokens`: how many tokens the input of a create with this body would
        be, counted as `token_count` says; and how it was counted."""
        request, route, items = await self._window(owner, body)
        plain = request.model_dump(exclude_unset=True)
        model = route.upstream_model or route.model
        if route.is_native:
            sent = native.to_responses_request(plain, items, model)
        else:
            sent = chat_request.to_chat_request(plain, items, model)
        counted = await token_count.count(self.http, route, sent)
        return {"object": "response.input_tokens", "input_tokens": counted.tokens}, counted.how

    async def compact(self, owner: str, body: object) -> dict[str, Any]:
        """`POST /responses/compact`: the window a create with this body would send, compacted (its
        user messages, then one compaction item; worker/protocol/compaction.py).

        It runs as a response of its own that is not stored (`compaction.COMPACT` marks its request):
        recorded and queued like any, so a worker (which holds the upstream's keys) makes it, on the
        upstream's own `/responses/compact` or with a summary, and a dead worker's is taken over.
        """
        given: object = body
        if isinstance(body, dict):
            given = {key: body[key] for key in _COMPACT_PARAMS if key in body}
            given.setdefault("input", [])
            given.update(store=False, stream=False, background=False)
            given[compaction.COMPACT] = True
        request = parse_create_request(given)
        assert request.model is not None and request.input is not None
        route = self.routes.resolve(request.model)
        own_items = self._own_items(request)
        await self._check_queue_depth()
        response = await self._record(owner, request, route, own_items)
        final = await self.wait(response["id"])
        if final.get("status") != "completed":
            error = final.get("error") or {}
            raise UpstreamFailedError(
                str(error.get("message") or f"The compaction ended {final.get('status')}.")
            )
        return {
            "id": final["id"],
            "object": "response.compaction",
            "created_at": final["created_at"],
            "output": final["output"],
            "usage": final.get("usage") or native.usage_of({}),
        }

    async def _window(self, owner: str, body: object) -> tuple[CreateRequest, Route, list[dict[str, Any]]]:
        """The request a body without `input` still makes (for counting and compacting), its route,
        and the items a create with it would send the model (earlier turns first, expanded)."""
        given = dict(body) if isinstance(body, dict) else body
        if isinstance(given, dict):
            given.setdefault("input", [])
        request = parse_create_request(given)
        assert request.model is not None and request.input is not None
        route = self.routes.resolve(request.model)
        own_items = normalize_input(request.input)
        async with self.autocommit.connect() as conn:
            history = await chains.history(
                conn, owner, request.previous_response_id, self.settings.max_chain_depth
            )
            if request.conversation is not None:
                on = conversation_id(request.conversation)
                history = await self._conversation_history(conn, owner, on, route, request)
        items = history.items + own_items
        sealer = await self._sealer_for(items)
        compaction.check_input(own_items, sealer, owner, native=route.is_native)
        items = compaction.expand(items, sealer, owner)
        _check_translatable(route, request, items)
        return request, route, items

    async def retrieve(self, owner: str, response_id: str) -> dict[str, Any]:
        """The Response as it stands (PROTOCOL.md §6.3 polling). A background response's row says
        `queued` until it ends (its worker claims it in the statement that records its end,
        attempt._run_ahead): while a worker holds its lease, it is `in_progress` (PROTOCOL.md §7,
        in progress is a worker's lease). Should Redis not answer, the row's word is told."""
        stored = await self._stored(owner, response_id)
        if stored.status is Status.QUEUED:
            with contextlib.suppress(RedisError):
                if await self.redis.exists(lease_key(response_id)):
                    return with_status(stored.response, Status.IN_PROGRESS)
        return stored.response

    async def replay(self, owner: str, response_id: str, after: int) -> Stream:
        """The response's events after `after`, to relay (PROTOCOL.md §6.3): raises unless it
        exists for `owner`, its events are still kept and `owner` may open one more stream."""
        final = await self.check_streamable(owner, response_id)
        slot = await self.quotas.open_stream(owner)
        through = Passthrough() if final is None else None
        events = self.follow(
            response_id, after, self.settings.sse_heartbeat_seconds, final=final, passthrough=through
        )
        return Stream(events, after, slot, through)

    async def check_streamable(self, owner: str, response_id: str) -> dict[str, Any] | None:
        """Raise unless the response exists for `owner` and its events are still kept; its final
        Response if it has finished (then its stream is replayed, not followed for long).

        Redis is asked even for a live response, so an outage is a 503 before the stream starts.
        """
        stored = await self._stored(owner, response_id)
        last = await last_event(self.redis, response_id)
        if stored.status not in TERMINAL:
            return None
        if last is None:
            raise InvalidRequestError(
                "The event stream of this response has expired; retrieve it without stream=true.",
                param="stream",
            )
        if not last.is_terminal:
            await self.cancellation.end_stream(response_id, stored.response)
        return stored.response

    def follow(
        self,
        response_id: str,
        after: int = -1,
        idle_seconds: float | None = None,
        *,
        final: dict[str, Any] | None = None,
        passthrough: Passthrough | None = None,
    ) -> AsyncIterator[Event | None]:
        """The response's events after `after`, up to its terminal event (PROTOCOL.md §6.3); of a
        finished response (`final`) what is stored, an `after` past its end being an empty stream.
        A live one's are the tailer's own (no layer between them and the relay).

        Raises Redis's outage if Redis stays unreachable past RESPOOL_REDIS_OUTAGE_SECONDS meanwhile
        (a shorter outage only pauses it), or comes back without the stream: the relay's boundary
        says so to its client, who resumes after the last event it got, once Redis is back.
        """
        if final is not None:
            events = self.tailer.follow(response_id, after, idle_seconds, True)
            return self._follow_finished(events, response_id, after, final)
        return self.tailer.follow(response_id, after, idle_seconds, passthrough=passthrough)

    async def _follow_finished(
        self, events: AsyncGenerator[Event | None], response_id: str, after: int, final: dict[str, Any]
    ) -> AsyncIterator[Event | None]:
        """Postgres commits a response's end before its writer appends the terminal event (DESIGN.md
        §2.3). If that event does not come while the relay waits, the writer died in between: the
        stream is ended from Postgres here (its lease has expired by then) and that end relayed.

        A stream that has its terminal event (`after` was past it) or is gone (it expired while the
        relay started) is left as it is: ending it again would restart its retention clock at each
        such replay, or bring an expired stream back as its terminal event alone."""
        position, is_ended = after, False
        async with contextlib.aclosing(events):
            async for item in events:
                if item is not None:
                    position, is_ended = item.sequence_number, item.is_terminal
                yield item
            if not is_ended and position >= 0:
                newest = await last_event(self.redis, response_id)
                if newest is None or newest.is_terminal:
                    return
                await self.cancellation.end_stream(response_id, final)
                for event in await read_events(self.redis, response_id, position):
                    yield event

    async def wait(self, response_id: str) -> dict[str, Any]:
        """Hold a foreground request, just created here, until its terminal event, and return its
        Response. It waits through a Redis outage as the tailer does (RESPOOL_REDIS_OUTAGE_SECONDS)."""
        try:
            terminal = await self.tailer.terminal(response_id, is_new=True)
        except Exception as exc:
            if not is_redis_outage(exc):
                raise
            why = f" {exc}" if isinstance(exc, TailLostError) else ""
            raise UnavailableAfterCommitError(
                f"Response '{response_id}' was accepted, but its events became unavailable while "
                f"waiting for it.{why} Retrieve it by id shortly."
            ) from exc
        if terminal is None:
            raise UnavailableAfterCommitError(
                f"The event stream of response '{response_id}' ended without a terminal event; retrieve it by id."
            )
        response: dict[str, Any] = terminal.payload()["response"]
        return response

    async def input_items(
        self, owner: str, response_id: str, after: str | None, limit: int, order: Literal["asc", "desc"]
    ) -> dict[str, Any]:
        """A page of the response's input items (PROTOCOL.md §5.1)."""
        await self._stored(owner, response_id)
        async with self.engine.connect() as conn:
            items, has_more = await store.list_input_items(
                conn, response_id, after=after, limit=limit, order=order
            )
        return page(items, has_more=has_more)

    def models(self) -> list[dict[str, Any]]:
        """`GET /v1/models`: every routed model."""
        return [
            {"id": route.model, "object": "model", "created": 0, "owned_by": "respool"}
            for route in self.routes.listed()
        ]

    # Cancel and delete -----------------------------------------------------------------------

    async def cancel(self, owner: str, response_id: str) -> dict[str, Any]:
        """Cancel a background response (PROTOCOL.md §7 matrix); idempotent."""
        stored = await self._stored(owner, response_id)
        if not stored.background:
            raise InvalidRequestError("Cannot cancel a synchronous response.", param="response_id")
        cancelled = await self.cancellation.cancel_live(owner, response_id)
        if cancelled is None:  # already terminal, or it just finished
            stored = await self._stored(owner, response_id)
            if stored.status is not Status.CANCELLED:
                raise InvalidRequestError(f"Cannot cancel a {stored.status} response.", param="response_id")
            await self.cancellation.finish(response_id, stored.response)
            return stored.response
        return cancelled

    async def abandon(self, owner: str, response_id: str) -> None:
        """The client of a foreground response went away: cancel it, so it stops costing GPU time
        (DESIGN.md §2, `RESPOOL_CANCEL_ON_DISCONNECT`). A no-op once it has ended."""
        if self.settings.cancel_on_disconnect:
            await self.cancellation.cancel_live(owner, response_id)

    async def delete(self, owner: str, response_id: str) -> dict[str, Any]:
        """Delete a response, its input items and its events; a live background one is cancelled first."""
        stored = await self._stored(owner, response_id)
        if stored.status in LIVE:
            if not stored.background:
                raise InvalidRequestError(
                    "Cannot delete a synchronous response while it is in progress.", param="response_id"
                )
            await self.cancel(owner, response_id)
        # Redis first: if it is down, nothing is deleted yet and the SDK's retry finds the row.
        # Deleting the lease fences out a worker still running it: it can write nothing more.
        await self.redis.delete(*response_keys(response_id))
        await self.queue.forget(response_id)
        async with self.engine.begin() as conn:
            await store.delete_response(conn, response_id, owner)
        return {"id": response_id, "object": "response", "deleted": True}

    async def check_ready(self) -> None:
        """Raise an outage unless Redis and Postgres both answer (`/readyz`), Postgres within
        READY_SECONDS: a probe's own timeout is short, and a hung Postgres must read as not ready."""
        await self.redis.ping()
        await self.direct.ping(READY_SECONDS)

    async def _stored(self, owner: str, response_id: str) -> store.View:
        """The response as its owner sees it (its request and input left unread: `store.get_view`);
        a 404 if the owner has no such response stored."""
        logs.RESPONSE_ID.set(response_id)
        async with self.direct.connection() as conn:
            stored = await store.get_view(conn, response_id, owner)
        if stored is None:
            raise ResponseNotFoundError(response_id)
        return stored


def _check_translatable(
    route: Route,
    request: CreateRequest,
    items: list[dict[str, Any]],
    sealer: Sealer | None = None,
    owner: str = "",
) -> None:
    """Reject at create what the upstream cannot be sent (a 400 naming `param`), not later in a
    worker: the items as the model will be sent them (compaction items expanded)."""
    if not route.is_native:
        chat_request.check(request.model_dump(exclude_unset=True), compaction.expand(items, sealer, owner))
