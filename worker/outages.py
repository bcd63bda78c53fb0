"""Backing servers' outages, mapped once at the service boundary to `UnavailableError` (503 +
retry-after): Redis or Postgres unreachable, hung, loading, or read-only after a failover. Any
other error of theirs (a misconfiguration, a bug) passes through as itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from redis.exceptions import AuthenticationError as RedisAuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from worker.errors import UnavailableError
from worker.postgres import store


@contextlib.asynccontextmanager
async def _unavailable_on(is_outage: Callable[[Exception], bool], message: str) -> AsyncIterator[None]:
    """Map a backing server's outage to `UnavailableError` (503 + retry-after) at this boundary."""
    try:
        yield
    except Exception as exc:
        if is_outage(exc):
            raise UnavailableError(message) from exc
        raise


def redis_outage() -> contextlib.AbstractAsyncContextManager[None]:
    """Within it, Redis being unreachable is `UnavailableError`."""
    return _unavailable_on(is_redis_outage, "The queue (Redis) is unavailable; retry the request shortly.")


def database_outage() -> contextlib.AbstractAsyncContextManager[None]:
    """Within it, Postgres being unreachable is `UnavailableError`."""
    return _unavailable_on(store.is_unreachable, "The database is unavailable; retry the request shortly.")


def is_redis_outage(exc: Exception) -> bool:
    """Unreachable, hung, still loading its data (a ConnectionError), or a replica after a failover."""
    if not isinstance(exc, RedisError) or isinstance(exc, RedisAuthenticationError):
        return False  # a misconfiguration, not an outage: a 500 that says so in the log
    return isinstance(exc, RedisConnectionError | RedisTimeoutError | ReadOnlyError)
