"""Webhook deliveries in Postgres (DESIGN.md §12): recorded with the response's end, claimed by one
attempt at a time (a compare-and-set on `next_attempt_at`), and ended delivered or given up."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from worker.ids import new_id
from worker.protocol.webhooks import Endpoint, event_body, event_type

_RECORD = text(
    """
    INSERT INTO webhook_delivery (id, response_id, owner, endpoint, url, event_type, body)
    SELECT :id, id, owner, :endpoint, :url, :event_type, :body FROM response
    WHERE id = :response_id AND background
    RETURNING id
    """
)
_CLAIM = text(
    """
    UPDATE webhook_delivery
    SET attempts = attempts + 1, next_attempt_at = now() + make_interval(secs => :hold)
    WHERE id = :id AND status = 'pending' AND next_attempt_at <= now()
    RETURNING id, response_id, owner, endpoint, url, event_type, body, attempts, created_at
    """
)


@dataclass(frozen=True)
class Delivery:
    id: str
    response_id: str
    owner: str
    endpoint: str
    url: str
    event_type: str
    body: str
    attempts: int  # this one included, once claimed
    created_at: datetime


async def record(
    conn: AsyncConnection, response_id: str, owner: str, status: str, endpoints: Sequence[Endpoint]
) -> list[str]:
    """Insert, in the caller's transaction (the one that records the response's end), one delivery
    per endpoint that wants this end's event, if the response ran in the background; their ids."""
    kind = event_type(status)
    if kind is None:
        return []
    created_at = int(time.time())
    ids = []
    for endpoint in endpoints:
        if not endpoint.wants(owner, kind):
            continue
        event_id = new_id("evt")
        found = await conn.execute(
            _RECORD,
            {
                "id": event_id,
                "endpoint": endpoint.name,
                "url": endpoint.url,
                "event_type": kind,
                "body": event_body(event_id, kind, response_id, created_at),
                "response_id": response_id,
            },
        )
        ids += list(found.scalars())
    return ids


async def claim(conn: AsyncConnection, delivery_id: str, hold_seconds: float) -> Delivery | None:
    """Take the delivery for one attempt (None if it is not pending and due, or another took it):
    nobody else may try it for `hold_seconds`, after which an attempt that never ended is retried."""
    found = await conn.execute(_CLAIM, {"id": delivery_id, "hold": hold_seconds})
    row = found.first()
    return None if row is None else Delivery(*row)


async def release(conn: AsyncConnection, delivery: Delivery, seconds: float) -> None:
    """Give back a claim that made no attempt (its endpoint is busy, or not this process's): it is
    due again in `seconds`, its attempts as they were."""
    await conn.execute(
        text(
            "UPDATE webhook_delivery SET next_attempt_at = now() + make_interval(secs => :s), "
            "attempts = attempts - 1 WHERE id = :id AND status = 'pending' AND attempts = :attempts"
        ),
        {"id": delivery.id, "s": seconds, "attempts": delivery.attempts},
    )


async def finish_attempt(
    conn: AsyncConnection,
    delivery: Delivery,
    *,
    status_code: int | None,
    error: str | None,
    duration_ms: int,
    retry_in: float | None,
) -> str:
    """Record the attempt; the delivery ends `delivered` (no error), is tried again in `retry_in`
    seconds, or (`retry_in` None) is `given_up`. Its new status. One statement (a data-modifying
    CTE): in autocommit, one round trip."""
    if error is None:
        status, sets = "delivered", "status = 'delivered', delivered_at = now(), last_error = NULL"
    elif retry_in is None:
        status, sets = "given_up", "status = 'given_up', last_error = :error"
    else:
        status, sets = (
            "pending",
            "next_attempt_at = now() + make_interval(secs => :retry), last_error = :error",
        )
    await conn.execute(
        text(
            "WITH attempt AS (INSERT INTO webhook_attempt (delivery_id, attempt, status_code, error, "
            "duration_ms) VALUES (:id, :attempt, :code, :error, :ms)) "
            f"UPDATE webhook_delivery SET {sets} WHERE id = :id"
        ),
        {
            "id": delivery.id,
            "attempt": delivery.attempts,
            "code": status_code,
            "error": error,
            "ms": duration_ms,
            "retry": retry_in,
        },
    )
    return status


async def due(
    conn: AsyncConnection, endpoints: Sequence[str], limit: int, settled_seconds: float = 0.0
) -> list[str]:
    """Pending deliveries to `endpoints` whose next attempt is due, oldest first; of those never
    tried, only those recorded at least `settled_seconds` ago."""
    found = await conn.execute(
        text(
            "SELECT id FROM webhook_delivery WHERE status = 'pending' AND next_attempt_at <= now() "
            "AND (attempts > 0 OR created_at <= now() - make_interval(secs => :settled)) "
            "AND endpoint = ANY(:endpoints) ORDER BY next_attempt_at LIMIT :limit"
        ),
        {"endpoints": list(endpoints), "limit": limit, "settled": settled_seconds},
    )
    return list(found.scalars())


async def give_up_expired(conn: AsyncConnection, max_age_seconds: float) -> int:
    """Give up pending deliveries older than `max_age_seconds` (an endpoint no process configures any
    more leaves them behind); how many."""
    found = await conn.execute(
        text(
            "UPDATE webhook_delivery SET status = 'given_up', last_error = COALESCE(last_error, "
            "'no worker configures its endpoint') WHERE status = 'pending' "
            "AND created_at < now() - make_interval(secs => :age)"
        ),
        {"age": max_age_seconds},
    )
    return found.rowcount


async def of_response(conn: AsyncConnection, response_id: str) -> list[dict[str, Any]]:
    """Every delivery of a response, with its attempts (for operators: `respool deliveries`)."""
    found = await conn.execute(
        text(
            "SELECT d.id, d.endpoint, d.url, d.event_type, d.status, d.attempts, d.last_error, "
            "d.created_at, d.delivered_at, d.next_attempt_at, "
            "COALESCE(json_agg(json_build_object('attempt', a.attempt, 'at', a.at, 'status_code', "
            "a.status_code, 'error', a.error, 'duration_ms', a.duration_ms) ORDER BY a.attempt) "
            "FILTER (WHERE a.id IS NOT NULL), '[]') "
            "FROM webhook_delivery d LEFT JOIN webhook_attempt a ON a.delivery_id = d.id "
            "WHERE d.response_id = :id GROUP BY d.id ORDER BY d.created_at, d.id"
        ),
        {"id": response_id},
    )
    keys = (
        "id", "endpoint", "url", "event_type", "status", "attempts", "last_error",
        "created_at", "delivered_at", "next_attempt_at", "attempt_log",
    )  # fmt: skip
    return [dict(zip(keys, row, strict=True)) for row in found.all()]


async def delete_expired(conn: AsyncConnection, retention_days: float, limit: int) -> int:
    """Delete up to `limit` deliveries that ended (delivered or given up) over `retention_days` ago,
    their attempts with them; how many."""
    found = await conn.execute(
        text(
            "DELETE FROM webhook_delivery WHERE id IN (SELECT id FROM webhook_delivery "
            "WHERE status <> 'pending' AND created_at < now() - make_interval(secs => :age) LIMIT :limit)"
        ),
        {"age": retention_days * 86400, "limit": limit},
    )
    return found.rowcount
