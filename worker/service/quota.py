"""Per-owner quotas, kept in Redis so that every API replica enforces the same ones: a
request rate (`RESPOOL_RATE_LIMIT_PER_MINUTE`) and event streams open at once
(`RESPOOL_MAX_STREAMS_PER_KEY`). Both are off (no Redis work at all) while their setting is 0.

The rate is a GCRA (generic cell rate algorithm): one key per owner holds the time its next request
is due, so a check is one atomic script, and a refusal says exactly how long to wait. An owner may
spend its whole minute at once; after that one request is allowed every 60/limit seconds.

A stream holds a slot (worker/slots.py): a token in the owner's sorted set, scored by when its
lease runs out. The process relaying the stream renews every slot it holds, in one pipeline each
heartbeat, and gives the slot back when the stream ends. A process that dies stops renewing: its
slots lapse after the lease and are pruned by the next stream that asks.
Every time is Redis's own (TIME), so replicas whose clocks disagree still agree on the quotas.

While Redis is unreachable, rates go unchecked (what needs Redis answers its own 503, what Postgres
serves alone goes on, as without a limit), and a stream gets the 503 it would get anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import defaultdict
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError

from worker.errors import RateLimitError, StreamLimitError
from worker.ids import new_id
from worker.keys import rate_key, streams_key
from worker.outages import is_redis_outage
from worker.settings import Settings
from worker.slots import NOW_MS, RENEW, TAKE

log = logging.getLogger("respool.quota")

# After Redis failed a rate check, rates go unchecked this long: a hung Redis would otherwise hold
# every request, even those Postgres serves alone, for RESPOOL_REDIS_TIMEOUT_SECONDS.
UNCHECKED_SECONDS = 5.0

# KEYS: rate. ARGV: emission interval ms, burst. Returns 0 if the request is allowed (and counts
# it), else the ms until one would be.
_RATE = (
    NOW_MS
    + """
local interval = tonumber(ARGV[1])
local due = tonumber(redis.call('GET', KEYS[1]) or now)
if due < now then due = now end
local wait = due - interval * (tonumber(ARGV[2]) - 1) - now
if wait > 0 then return math.ceil(wait) end
due = due + interval
redis.call('SET', KEYS[1], string.format('%.3f', due), 'PX', math.ceil(due - now))
return 0
"""
)


@dataclass(frozen=True)
class StreamSlot:
    """One open event stream of `owner`, counted against its limit until given back."""

    owner: str
    token: str


class Quotas:
    """One per API process: checks rates, hands out stream slots, renews the slots it holds."""

    def __init__(self, redis: Redis, settings: Settings) -> None:
        self._redis = redis
        self.per_minute = settings.rate_limit_per_minute
        self.max_streams = settings.max_streams_per_key
        self._lease_ms = int(settings.lease_seconds * 1000)
        self._renew_seconds = settings.heartbeat_seconds
        self._rate = redis.register_script(_RATE)
        self._take = redis.register_script(TAKE)
        self._renew = redis.register_script(RENEW)
        self._held: dict[str, str] = {}  # token -> owner, the slots this process renews
        self._renewer: asyncio.Task[None] | None = None
        self._unchecked_until = 0.0

    async def check_rate(self, owner: str) -> None:
        """Count one request of `owner`; `RateLimitError`, counting nothing, past its rate."""
        if self.per_minute <= 0:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._unchecked_until:
            return
        interval_ms = 60_000 / self.per_minute
        try:
            wait_ms = int(await self._rate(keys=[rate_key(owner)], args=[interval_ms, self.per_minute]))
        except Exception as exc:
            if not is_redis_outage(exc):
                raise
            log.warning("Redis is unavailable: request rates go unchecked for %g s", UNCHECKED_SECONDS)
            self._unchecked_until = loop.time() + UNCHECKED_SECONDS
            return
        if wait_ms > 0:
            raise RateLimitError(owner, self.per_minute, math.ceil(wait_ms / 1000))

    async def open_stream(self, owner: str) -> StreamSlot | None:
        """A slot for one more stream of `owner` (None while streams are unlimited): a 429
        `StreamLimitError` while it has all it may, a 503 while Redis is unreachable."""
        if self.max_streams <= 0:
            return None
        slot = StreamSlot(owner, new_id("stream"))
        args: list[str | int] = [slot.token, self.max_streams, self._lease_ms]
        if not await self._take(keys=[streams_key(owner)], args=args):
            raise StreamLimitError(owner, self.max_streams)
        self._held[slot.token] = owner
        return slot

    async def close_stream(self, slot: StreamSlot | None) -> None:
        """Give the slot back (None: nothing to give). It is no longer renewed either way, so if
        Redis cannot be told now the slot lapses with its lease."""
        if slot is None:
            return
        self._held.pop(slot.token, None)
        try:
            await self._redis.zrem(streams_key(slot.owner), slot.token)
        except Exception as exc:
            if not is_redis_outage(exc):
                raise
            log.warning("a stream slot of '%s' could not be given back: it lapses", slot.owner)

    async def renew(self) -> None:
        """Renew every slot this process holds: one script call per owner, in one pipeline."""
        tokens: defaultdict[str, list[str]] = defaultdict(list)
        for token, owner in self._held.items():
            tokens[owner].append(token)
        if not tokens:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for owner, held in tokens.items():
                await self._renew(keys=[streams_key(owner)], args=[self._lease_ms, *held], client=pipe)
            await pipe.execute()

    def start(self) -> None:
        if self.max_streams > 0:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_forever())

    async def stop(self) -> None:
        """Stop renewing, and give back what is still held (what cannot be lapses with its lease)."""
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        for token, owner in list(self._held.items()):
            await self.close_stream(StreamSlot(owner, token))

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self._renew_seconds)
            try:
                await self.renew()
            except RedisError as exc:  # Redis is away: the next heartbeat tries again
                log.warning("stream slots could not be renewed: %s", exc)
