"""Leases and fencing tokens (DESIGN.md §4): who may write a response's events and final record.

A lease is `"<attempt>:<holder>"` under a PX ttl. Acquiring INCRs the attempt counter, which is the
fencing token every later write is checked against.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from redis.asyncio import Redis

from worker.keys import attempt_key, cancel_key, events_key, lease_key, observed_key

log = logging.getLogger("respool.leases")

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

# KEYS: lease, attempt, events. ARGV: value, ttl ms, attempt, whether to take a lapsed lease again
# ("1" or ""). Renews our own lease; a lease that is gone is taken again, if asked, if no later
# attempt has started (the attempt counter is not past ours) and the response's stream is there (a
# Redis that came back without its data lost what the attempt had told): a lease
# that lapsed while Redis was unreachable, or restarting, was never anyone else's meanwhile, since
# only an acquire (which counts the attempt up) makes a new holder. A counter behind ours (writes a
# failover lost) is set back to ours, so a later acquire still fences us. Returns 1 renewed, 2
# taken again, 0 lost (another holder's, or a later attempt's).
_RENEW = """
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if held or ARGV[4] ~= '1' or redis.call('EXISTS', KEYS[3]) == 0 then return 0 end
local counted = tonumber(redis.call('GET', KEYS[2]) or '0')
local attempt = tonumber(ARGV[3])
if counted > attempt then return 0 end
if counted < attempt then redis.call('SET', KEYS[2], attempt, 'KEEPTTL') end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 2
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

    async def renew(self, leases: list[Lease], *, reclaim: bool = False) -> tuple[list[Lease], list[Lease]]:
        """Renew every lease in one pipeline, with `reclaim` taking again those that lapsed while
        nobody else could take them (`_RENEW`: after an outage); the ones lost, and the ones taken
        again."""
        if not leases:
            return [], []
        flag = "1" if reclaim else ""
        async with self._redis.pipeline(transaction=False) as pipe:
            for lease in leases:
                args: list[str | int] = [lease.value, self._ttl_ms, lease.attempt, flag]
                await self._renew(keys=_renew_keys(lease), args=args, client=pipe)
            results = await pipe.execute()
        retaken = [lease for lease, kept in zip(leases, results, strict=True) if kept == 2]
        for lease in retaken:
            log.info("response %s: lease taken again (attempt %d)", lease.response_id, lease.attempt)
        return [lease for lease, kept in zip(leases, results, strict=True) if not kept], retaken

    async def reclaim(self, lease: Lease) -> bool:
        """Renew `lease`, or take it again if it lapsed and no later attempt has started (an append
        found it gone after Redis was unreachable); False if it is lost."""
        lost, _ = await self.renew([lease], reclaim=True)
        return not lost

    async def release(self, lease: Lease) -> None:
        """Give the lease up (a no-op if it is no longer ours)."""
        await self._release(keys=[lease_key(lease.response_id)], args=[lease.value])


def _renew_keys(lease: Lease) -> list[str]:
    rid = lease.response_id
    return [lease_key(rid), attempt_key(rid), events_key(rid)]


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
