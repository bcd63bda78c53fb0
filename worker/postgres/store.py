"""The response store in Postgres (DESIGN.md §5). Functions take a connection; they never commit.

Every status change is one compare-and-set `UPDATE … WHERE status IN (…)`, here and nowhere else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, cast

import orjson
from psycopg.types.json import Jsonb
from sqlalchemy import ColumnElement, delete, func, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from worker.postgres import direct
from worker.postgres.models import LIVE_STATUSES, ConversationItemRow, InputItemRow, ResponseRow
from worker.protocol.request import CreateRequest
from worker.protocol.response import LIVE, Status
from worker.settings import Settings


def create_engine(
    database_url: str,
    connections: int,
    connect_timeout_seconds: int = 5,
    *,
    deadline_seconds: float | None = None,
    is_preparing: bool = True,
) -> AsyncEngine:
    """An async engine on psycopg 3 for `database_url` (a `postgresql://` URL is given the driver),
    holding up to `connections`, each kept once opened: a pool that opened more than it kept
    ("overflow") closed them again after a burst, and each one the next burst opened cost Postgres
    a process (a tenth of its CPU per token at 30 streams, each started at once).

    A checkout does not ping first (that was a round trip before every statement): after a Postgres
    restart, the first statement on a broken connection fails as unreachable, which invalidates
    every connection the pool holds, and callers retry (the worker) or answer 503 (the API). A
    connect gives up after `connect_timeout_seconds`, a statement after `deadline_seconds`, and so
    does a checkout that waits for a connection to come free. JSON goes through orjson. Its
    connections are `direct.Connection`s: `is_preparing` as there.
    """
    return create_async_engine(
        async_url(database_url),
        pool_size=connections,
        max_overflow=0,
        pool_timeout=30.0 if deadline_seconds is None else deadline_seconds,
        connect_args={
            "async_creator_fn": direct.connect,
            "connect_timeout": connect_timeout_seconds,
            "deadline_seconds": deadline_seconds,
            "is_preparing": is_preparing,
        },
        json_serializer=_dumps,
        json_deserializer=orjson.loads,
    )


def open_pools(settings: Settings) -> tuple[AsyncEngine, direct.DirectPool]:
    """A process's two ways to Postgres, its connections (`database_connections`) split between
    them (`direct.shares`): the engine, for transactions, and the direct pool, for the hot single
    statements; each statement bounded by `database_timeout_seconds`, none prepared behind a
    transaction pooler (`database_pooler`)."""
    for_engine, for_direct = direct.shares(settings.database_connections)
    connect_timeout, deadline = settings.database_connect_timeout_seconds, settings.database_timeout_seconds
    is_preparing = settings.database_pooler != "transaction"
    return (
        create_engine(
            settings.database_url,
            for_engine,
            connect_timeout,
            deadline_seconds=deadline,
            is_preparing=is_preparing,
        ),
        direct.DirectPool(
            settings.database_url,
            for_direct,
            connect_timeout_seconds=connect_timeout,
            wait_seconds=deadline,
            deadline_seconds=deadline,
            is_preparing=is_preparing,
        ),
    )


def single_statements(engine: AsyncEngine) -> AsyncEngine:
    """`engine`, each statement its own transaction (autocommit): for work that is one statement,
    such as every compare-and-set below, with no BEGIN and COMMIT round trips around it."""
    return engine.execution_options(isolation_level="AUTOCOMMIT")


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def async_url(database_url: str) -> str:
    """`postgresql://…` → `postgresql+psycopg://…`; a URL that names a driver is kept."""
    for prefix in ("postgresql://", "postgres://"):
        if database_url.startswith(prefix):
            return "postgresql+psycopg://" + database_url[len(prefix) :]
    return database_url


# A connection the hot statements run on: psycopg's own (`direct.DirectPool`) or an engine's.
type Connection = AsyncConnection | direct.Connection

# Where a live row stands in the sweep's order: (created_at, id).
type LivePosition = tuple[datetime, str]


@dataclass(frozen=True)
class StoredResponse:
    """What the API and the worker read of a response row."""

    id: str
    owner: str
    status: Status
    background: bool
    store: bool
    stream: bool
    request: dict[str, Any]  # the create body as sent, but its input (in `conversation`)
    conversation: list[dict[str, Any]]
    response: dict[str, Any]
    attempt: int
    chain_depth: int
    conversation_id: str | None = None  # the Conversation it appends its items to when it ends


_COLUMNS = (
    ResponseRow.id,
    ResponseRow.owner,
    ResponseRow.status,
    ResponseRow.background,
    ResponseRow.store,
    ResponseRow.stream,
    ResponseRow.request,
    ResponseRow.conversation,
    ResponseRow.response,
    ResponseRow.attempt,
    ResponseRow.chain_depth,
    ResponseRow.conversation_id,
)


# The hot statements, on psycopg directly or on libpq itself (worker/postgres/direct.py): SQL
# written once, here.
_NEW_ROW = (
    "id",
    "owner",
    "status",
    "model",
    "background",
    "store",
    "stream",
    "previous_response_id",
    "request",
    "conversation",
    "response",
    "chain_depth",
    "conversation_id",
)
_JSON_COLUMNS = frozenset({"request", "conversation", "response"})
_RETURNED = ", ".join(column.name for column in _COLUMNS)
# The row and its input items in one statement (a data-modifying CTE): in autocommit, one round trip.
# Its input items are the last of its conversation (after what it continues), taken from the
# conversation's own parameter: a long input is sent and parsed once, not twice (a create with
# ~300 KB of input: the API's CPU for the insert 1.0-1.1 -> 0.5-0.6 ms, its time 6.7-9.6 -> 4.7-5.2).
_INSERT = f"""
WITH created AS (
    INSERT INTO response ({", ".join(_NEW_ROW)})
    VALUES ({", ".join(f"%({name})s" for name in _NEW_ROW)})
    RETURNING id
)
INSERT INTO input_item (response_id, position, item_id, item)
SELECT created.id, items.ordinality - 1 - %(continued)s, items.value ->> 'id', items.value
FROM created JOIN jsonb_array_elements(%(conversation)s) WITH ORDINALITY AS items (value, ordinality) ON true
WHERE items.ordinality > %(continued)s
"""
_SELECT = f"SELECT {_RETURNED} FROM response WHERE id = %(rid)s"
_SELECT_OWNED = f"{_SELECT} AND owner = %(owned_by)s"
_SELECT_VIEW = (
    "SELECT store, status, background, response FROM response WHERE id = %(rid)s AND owner = %(owned_by)s"
)
_START_ATTEMPT = f"""
UPDATE response
SET status = '{Status.IN_PROGRESS}', attempt = %(new_attempt)s, started_at = now(),
    response = response || jsonb_build_object('status', '{Status.IN_PROGRESS}')
WHERE id = %(rid)s AND attempt < %(new_attempt)s AND status IN ({LIVE_STATUSES})
RETURNING {_RETURNED}
"""
# An attempt's end is fenced (DESIGN.md §2.3) on no later attempt having claimed the row, which is
# still live: `attempt <= n`, not `= n`, as a fresh response's first attempt does not claim its row
# before it ends (attempt._run_ahead): its end claims it, in the same statement.
_FENCED = f"id = %(rid)s AND attempt <= %(held_attempt)s AND status IN ({LIVE_STATUSES})"
_MARK_FINISHED = f"""
UPDATE response
SET status = %(new_status)s, response = %(new_response)s, error = %(new_error)s, completed_at = now(),
    attempt = %(held_attempt)s
WHERE {_FENCED}
"""
_DELETE_FINISHED = f"DELETE FROM response WHERE {_FENCED}"
# Several ends in one statement (`ends.GatheredEnds`): each row fenced as `_MARK_FINISHED` fences
# it, the rows that were ended returned; one round trip and one commit for all of them.
_MARK_ALL_FINISHED = f"""
UPDATE response
SET status = ended.status, response = ended.response, error = ended.error, completed_at = now(),
    attempt = ended.attempt
FROM jsonb_to_recordset(%(ended)s)
    AS ended (id text, attempt integer, status text, response jsonb, error jsonb)
WHERE response.id = ended.id AND response.attempt <= ended.attempt
    AND response.status IN ({LIVE_STATUSES})
RETURNING response.id
"""
_EXISTS = "SELECT EXISTS (SELECT 1 FROM response WHERE id = %(rid)s)"
# The same, for a direct connection (on libpq itself, `direct.run`).
_INSERTED = direct.Statement("insert", _INSERT)
_VIEWED = direct.Statement("view", _SELECT_VIEW)
_FINISHED = direct.Statement("finish", _MARK_FINISHED)
_DELETED = direct.Statement("delete_finished", _DELETE_FINISHED)
_ALL_FINISHED = direct.Statement("finish_all", _MARK_ALL_FINISHED)


async def driver(conn: Connection) -> direct.Connection:
    """The psycopg connection under `conn` (an engine's connection: its transaction, if any, is
    the statement's too)."""
    if isinstance(conn, AsyncConnection):
        raw = await conn.get_raw_connection()
        return cast(direct.Connection, raw.driver_connection)
    return conn


def _stored(row: tuple[Any, ...]) -> StoredResponse:
    stored = StoredResponse(*row)
    return dataclasses.replace(stored, status=Status(stored.status))


def new_row(
    owner: str,
    request: CreateRequest,
    response: dict[str, Any],
    conversation: list[dict[str, Any]],
    chain_depth: int,
    conversation_id: str | None = None,
) -> dict[str, Any]:
    """The columns of a new response row (`_NEW_ROW`), for `insert_response`."""
    # A foreground response runs as soon as a worker takes it, and says so from its first event
    # (`response.created`): its row, which its worker claims only as it ends, says so too.
    status = Status.QUEUED if request.is_background else Status.IN_PROGRESS
    return {
        "id": response["id"],
        "owner": owner,
        "status": status,
        "model": request.model,
        "background": request.is_background,
        "store": request.is_stored,
        "stream": request.is_stream,
        "previous_response_id": request.previous_response_id,
        # Its input is in `conversation` (after what it continues) and in its input items: kept a
        # third time here, a long history made a row's insert (and its ticket) half again as large.
        "request": request.model_dump(exclude_unset=True, exclude={"input"}),
        "conversation": conversation,
        "response": {**response, "status": status.value},
        "chain_depth": chain_depth,
        "conversation_id": conversation_id,
    }


async def insert_response(conn: Connection, row: dict[str, Any], input_count: int) -> None:
    """Insert a new response row and its input items, the last `input_count` items of its
    conversation (each has an `id`), in one statement."""
    if not 0 <= input_count <= len(row["conversation"]):
        raise ValueError(f"{input_count} input items of a conversation of {len(row['conversation'])}")
    values = {name: Jsonb(row[name]) if name in _JSON_COLUMNS else row[name] for name in _NEW_ROW}
    values["status"] = str(values["status"])
    continued = len(row["conversation"]) - input_count
    if isinstance(conn, AsyncConnection):
        await (await driver(conn)).execute(_INSERT, {**values, "continued": continued})
    else:
        await direct.run(conn, _INSERTED, {**values, "continued": continued})


async def get_response(conn: Connection, response_id: str, owner: str | None = None) -> StoredResponse | None:
    """The row `response_id`, if it exists (and belongs to `owner`, when one is given)."""
    if owner is None:
        cursor = await (await driver(conn)).execute(_SELECT, {"rid": response_id})
    else:
        cursor = await (await driver(conn)).execute(_SELECT_OWNED, {"rid": response_id, "owned_by": owner})
    row = await cursor.fetchone()
    return None if row is None else _stored(row)


@dataclass(frozen=True)
class View:
    """A stored response as the API's reads of one see it: no request, no input."""

    status: Status
    background: bool
    response: dict[str, Any]


async def get_view(conn: Connection, response_id: str, owner: str) -> View | None:
    """`response_id` as its owner sees it, if `owner` has it stored (`store` true): the API's read
    for a poll, a cancel, a delete, a replay, which leaves out the row's request and input (a long
    history is most of a row: a poll of a response with 300 KB of input read 1.6 ms of CPU and
    5.6 ms through them, 0.1 and 0.2 without)."""
    parameters = {"rid": response_id, "owned_by": owner}
    if isinstance(conn, AsyncConnection):
        cursor = await (await driver(conn)).execute(_SELECT_VIEW, parameters)
        row = await cursor.fetchone()
        if row is None or not row[0]:
            return None
        return View(Status(row[1]), row[2], row[3])
    result = await direct.run(conn, _VIEWED, parameters)
    if not result.ntuples or result.get_value(0, 0) != b"t":
        return None
    status, background, response = (result.get_value(0, column) for column in (1, 2, 3))
    assert status is not None and response is not None  # NOT NULL columns
    return View(Status(status.decode()), background == b"t", orjson.loads(response))


async def start_attempt(conn: Connection, response_id: str, attempt: int) -> StoredResponse | None:
    """Move a live row to `in_progress` under `attempt` and read it, in one statement; None if it
    is gone, terminal, or a later attempt owns it (then `get_response` tells which)."""
    cursor = await (await driver(conn)).execute(_START_ATTEMPT, {"rid": response_id, "new_attempt": attempt})
    row = await cursor.fetchone()
    return None if row is None else _stored(row)


# A ticket: a new row's columns that `StoredResponse` holds, for the worker that takes the
# response (queue.ResponseQueue.enqueue), so that it need not wait for Postgres to read them.
_TICKET_FIELDS = (
    "owner",
    "background",
    "store",
    "stream",
    "request",
    "conversation",
    "response",
    "chain_depth",
    "conversation_id",
)


def ticket(row: dict[str, Any], max_bytes: int) -> bytes | None:
    """A new row (`new_row`) as a ticket, if it takes at most `max_bytes`."""
    encoded = orjson.dumps({name: row[name] for name in _TICKET_FIELDS})
    return encoded if len(encoded) <= max_bytes else None


def from_ticket(response_id: str, encoded: bytes, attempt: int) -> StoredResponse:
    """The row a ticket tells, as its first attempt runs it (`in_progress`, under `attempt`): its
    end claims the row (attempt._run_ahead)."""
    fields = orjson.loads(encoded)
    response = {**fields.pop("response"), "status": Status.IN_PROGRESS.value}
    return StoredResponse(
        id=response_id, status=Status.IN_PROGRESS, response=response, attempt=attempt, **fields
    )


async def mark_finished(conn: Connection, response_id: str, attempt: int, response: dict[str, Any]) -> bool:
    """Record the final Response, fenced on `attempt` (DESIGN.md §2.3); False means another outcome won."""
    error = response.get("error")
    parameters = {
        "rid": response_id,
        "held_attempt": attempt,
        "new_status": str(response["status"]),
        "new_response": Jsonb(response),
        "new_error": None if error is None else Jsonb(error),
    }
    if isinstance(conn, AsyncConnection):
        cursor = await (await driver(conn)).execute(_MARK_FINISHED, parameters)
        return cursor.rowcount == 1
    return (await direct.run(conn, _FINISHED, parameters)).command_tuples == 1


async def mark_all_finished(conn: direct.Connection, ends: list[tuple[str, int, dict[str, Any]]]) -> set[str]:
    """Record several final Responses (`(id, attempt, response)` each) in one statement, each fenced
    on its attempt as `mark_finished` fences it; the ids of those recorded (another outcome won the
    rest). `conn` is a direct connection in autocommit: one commit for all of them."""
    ended = [
        {
            "id": rid,
            "attempt": attempt,
            "status": str(response["status"]),
            "response": response,
            "error": response.get("error"),
        }
        for rid, attempt, response in ends
    ]
    result = await direct.run(conn, _ALL_FINISHED, {"ended": Jsonb(ended)})
    return {bytes(result.get_value(row, 0) or b"").decode() for row in range(result.ntuples)}


async def response_exists(conn: Connection, response_id: str) -> bool:
    """Whether the response has a row (one its create is inserting has none yet)."""
    cursor = await (await driver(conn)).execute(_EXISTS, {"rid": response_id})
    row = await cursor.fetchone()
    return bool(row and row[0])


async def delete_finished(conn: Connection, response_id: str, attempt: int) -> bool:
    """Finish a `store: false` response by deleting it, fenced like `mark_finished`."""
    parameters = {"rid": response_id, "held_attempt": attempt}
    if isinstance(conn, AsyncConnection):
        cursor = await (await driver(conn)).execute(_DELETE_FINISHED, parameters)
        return cursor.rowcount == 1
    return (await direct.run(conn, _DELETED, parameters)).command_tuples == 1


async def mark_failed(conn: AsyncConnection, response_id: str, response: dict[str, Any]) -> bool:
    """Fail a live row whatever its attempt (a job that never ran, a sweep); False if already terminal."""
    result = await conn.execute(
        update(ResponseRow)
        .where(ResponseRow.id == response_id, ResponseRow.status.in_(LIVE))
        .values(status=Status.FAILED, response=response, error=response.get("error"), completed_at=func.now())
    )
    return result.rowcount == 1


async def mark_cancelled(conn: AsyncConnection, response_id: str, owner: str) -> dict[str, Any] | None:
    """Cancel a live row (cancel wins, PROTOCOL.md §7); the cancelled Response, or None.

    Which responses a client may cancel (background ones) is the service's rule; a foreground one
    is cancelled when its client goes away.
    """
    cancelled = ResponseRow.response.op("||")(func.jsonb_build_object("status", str(Status.CANCELLED)))
    result = await conn.execute(
        update(ResponseRow)
        .where(
            ResponseRow.id == response_id,
            ResponseRow.owner == owner,
            ResponseRow.status.in_(LIVE),
        )
        .values(status=Status.CANCELLED, response=cancelled, completed_at=func.now())
        .returning(ResponseRow.response)
    )
    row = result.one_or_none()
    return None if row is None else dict(row.response)


async def delete_response(conn: AsyncConnection, response_id: str, owner: str | None = None) -> bool:
    """Delete the row and (by cascade) its input items; False if there was none."""
    query = delete(ResponseRow).where(ResponseRow.id == response_id)
    if owner is not None:
        query = query.where(ResponseRow.owner == owner)
    return (await conn.execute(query)).rowcount == 1


async def list_input_items(
    conn: AsyncConnection,
    response_id: str,
    *,
    after: str | None,
    limit: int,
    order: Literal["asc", "desc"],
) -> tuple[list[dict[str, Any]], bool]:
    """A page of input items after the item `after` (cursor pagination), and whether more follow."""
    scope = InputItemRow.response_id == response_id
    return await page_of_items(conn, InputItemRow, scope, after=after, limit=limit, order=order)


async def page_of_items(
    conn: AsyncConnection,
    table: type[InputItemRow] | type[ConversationItemRow],
    scope: ColumnElement[bool],
    *,
    after: str | None,
    limit: int,
    order: Literal["asc", "desc"],
) -> tuple[list[dict[str, Any]], bool]:
    """A page of the items of `table` within `scope` (a response's, a conversation's), after the item
    `after`, in `position` order; and whether more follow."""
    query = select(table.item).where(scope)
    if after is not None:
        cursor = select(table.position).where(scope, table.item_id == after).scalar_subquery()
        query = query.where(table.position > cursor if order == "asc" else table.position < cursor)
    position = table.position.asc() if order == "asc" else table.position.desc()
    rows = (await conn.execute(query.order_by(position).limit(limit + 1))).scalars().all()
    return [dict(item) for item in rows[:limit]], len(rows) > limit


async def own_input_items(conn: AsyncConnection, response_id: str) -> list[dict[str, Any]]:
    """The response's own input items (not the earlier turns it ran on), in order."""
    query = (
        select(InputItemRow.item)
        .where(InputItemRow.response_id == response_id)
        .order_by(InputItemRow.position)
    )
    return [dict(item) for item in (await conn.execute(query)).scalars()]


async def live_response_ids(
    conn: AsyncConnection,
    status: Status,
    older_than_seconds: float,
    limit: int,
    after: LivePosition | None = None,
) -> list[LivePosition]:
    """Rows in live `status` created more than `older_than_seconds` ago (the sweep's view), as
    (created_at, id), oldest first, after `after`: the sweep pages through them."""
    assert status in LIVE
    cutoff = func.now() - func.make_interval(0, 0, 0, 0, 0, 0, older_than_seconds)
    query = select(ResponseRow.created_at, ResponseRow.id).where(
        ResponseRow.status == status, ResponseRow.created_at < cutoff
    )
    if after is not None:
        query = query.where(tuple_(ResponseRow.created_at, ResponseRow.id) > tuple_(*after))
    query = query.order_by(ResponseRow.created_at, ResponseRow.id).limit(limit)
    return [(row.created_at, row.id) for row in await conn.execute(query)]


async def delete_expired(conn: AsyncConnection, retention_days: float, limit: int) -> int:
    """Delete up to `limit` finished rows completed more than `retention_days` ago (DESIGN.md §2.7)."""
    cutoff = func.now() - func.make_interval(0, 0, 0, 0, 0, 0, retention_days * 86400)
    expired = (
        select(ResponseRow.id)
        .where(ResponseRow.completed_at < cutoff, ResponseRow.status.not_in(LIVE))
        .limit(limit)
        .scalar_subquery()
    )
    result = await conn.execute(delete(ResponseRow).where(ResponseRow.id.in_(expired)))
    return int(result.rowcount)
