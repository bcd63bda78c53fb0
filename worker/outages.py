"""Backing servers' outages, in one vocabulary: is this error Redis or Postgres being unreachable?

An outage is a server unreachable, hung, still loading its data, restarting, out of free connections,
(Redis) a read-only replica after a failover, or (Postgres) a transaction pooler losing a prepared
statement between server connections (docs/postgres.md: `RESPOOL_DATABASE_POOLER`). Any other error of theirs (a misconfiguration such
as a wrong password, a bug) is not one, and passes through as itself. What respool does about an
outage, in two places only:
- inside the core, where waiting helps, an action is tried again with backoff (`patiently`,
  `patiently_sync`): a worker recording a finished response, an append, a migration at start;
- at the API's boundary (`api/errors.py`, `api/sse.py`), an outage that reaches it becomes a 503 with
  `retry-after` (`as_unavailable`), so no route wraps its calls by hand.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import psycopg
from redis.exceptions import AuthenticationError as RedisAuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from worker.errors import UnavailableError

log = logging.getLogger("respool.outages")

# The foreign error classes an outage can come as: what the API's boundary looks at.
# (psycopg's own: the hot statements run on it directly, worker/postgres/direct.py.)
OUTAGE_CLASSES: tuple[type[Exception], ...] = (
    RedisError,
    DBAPIError,
    PoolTimeoutError,
    psycopg.OperationalError,
    psycopg.InterfaceError,
    psycopg.errors.InvalidSqlStatementName,
    psycopg.errors.DuplicatePreparedStatement,
)
# A prepared statement not on the server connection a transaction pooler chose, or already there
# (another client's): a pooler's doing, which a retry may well escape, never a respool bug.
_POOLER_ERRORS = (psycopg.errors.InvalidSqlStatementName, psycopg.errors.DuplicatePreparedStatement)


def is_redis_outage(exc: BaseException) -> bool:
    """Unreachable, hung, still loading its data (a ConnectionError), or a replica after a failover."""
    if not isinstance(exc, RedisError) or isinstance(exc, RedisAuthenticationError):
        return False  # a misconfiguration, not an outage: a 500 that says so in the log
    return isinstance(exc, RedisConnectionError | RedisTimeoutError | ReadOnlyError)


def is_postgres_outage(exc: BaseException) -> bool:
    """Down, restarting, or no pooled connection free in time (connects hanging, or overload),
    said by SQLAlchemy or, on the direct pool, by psycopg; or a transaction pooler's lost statement."""
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return True
    if isinstance(exc, _POOLER_ERRORS) or isinstance(getattr(exc, "orig", None), _POOLER_ERRORS):
        return True
    return isinstance(exc, OperationalError | InterfaceError | PoolTimeoutError) or (
        isinstance(exc, DBAPIError) and exc.connection_invalidated
    )


def is_outage(exc: BaseException) -> bool:
    return is_redis_outage(exc) or is_postgres_outage(exc)


def as_unavailable(exc: BaseException) -> UnavailableError | None:
    """The 503 an outage is, saying which server, with the outage as its cause; None for any other error."""
    if is_redis_outage(exc):
        error = UnavailableError("The queue (Redis) is unavailable; retry the request shortly.")
    elif is_postgres_outage(exc):
        error = UnavailableError("The database is unavailable; retry the request shortly.")
    else:
        return None
    error.__cause__ = exc
    return error


class OutageMemory:
    """When this process last met Redis unreachable (a failed round trip of any of its users).

    Leases and deadlines lapse on the wall clock while nobody can renew them, so for a while after
    an outage a worker takes back the leases it holds that lapsed (`Leases.renew`), and waits before
    it judges other workers dead by their missed deadlines (`recovery.take_back`): each live one
    renews within a heartbeat of Redis answering again. A process starts as if it had just met one:
    it has not yet seen the others renew either."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def met(self) -> None:
        self.last = time.monotonic()

    def within(self, seconds: float) -> bool:
        """Whether the last outage was less than `seconds` ago."""
        return time.monotonic() - self.last < seconds


def _server(exc: BaseException) -> str:
    return "Redis" if is_redis_outage(exc) else "Postgres"


def _reason(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


async def patiently[T](
    action: Callable[[], Awaitable[T]], seconds: float, *, first_delay: float = 0.25, max_delay: float = 2.0
) -> T:
    """`action`, tried again with backoff (doubling from `first_delay` up to `max_delay`) while it
    meets an outage, for up to `seconds`; then the outage itself. Any other error at once."""
    deadline, delay = time.monotonic() + seconds, first_delay
    while True:
        try:
            return await action()
        except Exception as exc:
            if not is_outage(exc) or time.monotonic() + delay > deadline:
                raise
            log.warning(
                "%s is not reachable yet (%s); trying again in %.1f s", _server(exc), _reason(exc), delay
            )
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_delay)


def patiently_sync[T](
    action: Callable[[], T], seconds: float, *, first_delay: float = 0.5, max_delay: float = 5.0
) -> T:
    """`patiently`, for synchronous code (`respool migrate`)."""
    deadline, delay = time.monotonic() + seconds, first_delay
    while True:
        try:
            return action()
        except Exception as exc:
            if not is_outage(exc) or time.monotonic() + delay > deadline:
                raise
            log.warning(
                "%s is not reachable yet (%s); trying again in %.1f s", _server(exc), _reason(exc), delay
            )
        time.sleep(delay)
        delay = min(delay * 2, max_delay)
