"""Leases and fencing tokens (DESIGN.md §4): who may write a response's events and final record.

A lease is `"<attempt>:<holder>"` under a PX ttl. Acquiring INCRs the attempt counter, which is the
fencing token every later write is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from redis.asyncio import Redis

from worker.keys import attempt_key, cancel_key, events_key, lease_key, observed_key

# KEYS: lease, attempt, events. ARGV: holder, ttl ms. Returns {the new attempt, the stream's newest
# entry as XREVRANGE gives it (none: an empty list)}, or {0} while another holder is alive. Only a
# lease's holder appends, so what is newest when the lease is taken stays newest until its holder
# writes: whoever takes a lease to write learns where the stream ends in the same round trip.
ACQUIRE_FUNCTION = """
local function acquire(lease, attempt_key, events, holder, ttl_ms)
  if redis.call('EXISTS', lease) == 1 then return {0} end
  local attempt = redis.call('INCR', attempt_key)
  redis.call('SET', lease, attempt .. ':' .. holder, 'PX', ttl_ms)
  return {attempt, redis.call('XREVRANGE', events, '+', '-', 'COUNT', 1)}
end
"""
_ACQUIRE = ACQUIRE_FUNCTION + "return acquire(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2])"

# A stream entry as Redis sends it inside a script's reply: (entry id, [name, value, ...]).
type FlatEntry = tuple[bytes, list[bytes]]

# KEYS: lease. ARGV: value, ttl ms. Renews only our own lease.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

# KEYS: lease. ARGV: value. Deletes only our own lease.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class Lease:
    """A held lease: the right to append to `response_id`'s stream as `attempt`."""

    response_id: str
    attempt: int
    holder: str

    @cached_property
    def value(self) -> str:
        return f"{self.attempt}:{self.holder}"

    @cached_property
    def appended(self) -> tuple[bytes, ...]:
        """What every append under this lease names (stream.EventLog): the response's lease, events,
        cancel, attempt and observed keys, and the lease's value, encoded once for all of them (a
        token's append built and encoded them afresh)."""
        rid = self.response_id
        keys = (lease_key(rid), events_key(rid), cancel_key(rid), attempt_key(rid), observed_key(rid))
        return (*(key.encode() for key in keys), self.value.encode())


class Leases:
    """Acquire, renew and release leases on one Redis connection pool."""

    def __init__(self, redis: Redis, ttl_seconds: float) -> None:
        self._redis = redis
        self.ttl_seconds = ttl_seconds
        self._ttl_ms = int(ttl_seconds * 1000)
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    async def acquire(self, response_id: str, holder: str) -> Lease | None:
        """A new lease under the next attempt, or None while another holder's lease is alive."""
        acquired = await self.acquire_reading(response_id, holder)
        return None if acquired is None else acquired[0]

    async def acquire_reading(self, response_id: str, holder: str) -> tuple[Lease, FlatEntry | None] | None:
        """`acquire`, and the newest entry of the response's stream when the lease was taken
        (`stream.take_lease` decodes it)."""
        reply = await self._acquire(keys=_acquire_keys(response_id), args=[holder, self._ttl_ms])
        return acquired(response_id, holder, reply)

    @property
    def ttl_ms(self) -> int:
        return self._ttl_ms

    def acquire_commands(self, pipe: Any, response_id: str, holder: str) -> None:
        """Queue `acquire_reading`'s script on `pipe` (its reply is read by `acquired`). Sent whole
        (EVAL): a pipeline's EVALSHA that met a Redis without the script would fail."""
        keys = _acquire_keys(response_id)
        pipe.eval(_ACQUIRE, len(keys), *keys, holder, self._ttl_ms)

    async def renew(self, leases: list[Lease]) -> list[Lease]:
        """Renew every lease in one pipeline; return the ones that were lost."""
        if not leases:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for lease in leases:
                await self._renew(
                    keys=[lease_key(lease.response_id)], args=[lease.value, self._ttl_ms], client=pipe
                )
            results = await pipe.execute()
        return [lease for lease, kept in zip(leases, results, strict=True) if not kept]

    async def release(self, lease: Lease) -> None:
        """Give the lease up (a no-op if it is no longer ours)."""
        await self._release(keys=[lease_key(lease.response_id)], args=[lease.value])


def _acquire_keys(response_id: str) -> list[str]:
    return [lease_key(response_id), attempt_key(response_id), events_key(response_id)]


def acquired(response_id: str, holder: str, reply: list[Any]) -> tuple[Lease, FlatEntry | None] | None:
    """The lease and newest entry an acquire's reply gives; None if another holder's lease is alive."""
    attempt = int(reply[0])
    if not attempt:
        return None
    newest = reply[1]
    return Lease(response_id, attempt, holder), (newest[0][0], newest[0][1]) if newest else None


def release_commands(pipe: Any, lease: Lease) -> None:
    """Queue the release of `lease` on `pipe` (a no-op if the lease is no longer ours), sent whole."""
    pipe.eval(_RELEASE, 1, lease_key(lease.response_id), lease.value)
