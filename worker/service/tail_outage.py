"""The live tail across a Redis outage (worker/service/tailer.py): how it waits for Redis, how it
tells a stream Redis lost from one only quiet, and the error that ends a follower it cannot serve.

A read that fails because Redis is unreachable ends nobody: the tailer tries again with backoff
(`reach_again`), each subscriber keeping its cursor (the exact id it has), and once Redis answers
every subscriber continues from there, missing and repeating nothing (a managed failover takes
tens of seconds). Only an outage longer than RESPOOL_REDIS_OUTAGE_SECONDS ends them, with a
`TailLostError` that says how long Redis was away.

When Redis answers again, each followed stream is asked whether it is still the one its
subscribers were reading (`lost_streams`): a Redis that came back without its data would leave
them waiting on streams that no longer move, or that began anew below their cursors (a recovery
ends a lost response with its terminal event alone), so theirs end too. A quiet stream is asked
the same at each of its follower's idle cues (`is_lost`), should a restart go unseen.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Protocol

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from worker.connections import HeldConnection
from worker.events.stream import Event, sequence_of
from worker.outages import is_redis_outage

# How soon, then how often at most, Redis is tried again while it is unreachable.
RETRY_FIRST_SECONDS = 0.25
RETRY_MAX_SECONDS = 2.0

LOST = "Redis came back without this response's events (it lost its data)."


class TailLostError(RedisConnectionError):
    """The live tail cannot go on for a subscriber: Redis was unreachable longer than the bound, or
    it came back without the subscriber's stream (then its events cannot be resumed:
    `is_resumable` is false). An outage (a ConnectionError) to the API's boundary; its message,
    for the client, says which."""

    def __init__(self, message: str, *, is_resumable: bool) -> None:
        super().__init__(message)
        self.is_resumable = is_resumable


def unreachable(away: float, bound: float) -> str:
    """What ends a follower after an outage of `away` seconds, past the `bound`."""
    return (
        f"Redis was unreachable for {away:.0f} s, longer than this server waits for it "
        f"({bound:g} s, RESPOOL_REDIS_OUTAGE_SECONDS)."
    )


class Follower(Protocol):
    def is_behind(self, newest: int) -> bool:
        """Whether it has an event newer than its stream's newest (`newest`)."""
        ...


type Followed = Mapping[str, Iterable[Follower]]  # the followers of each stream key


async def reach_again(
    reads: HeldConnection, followed: Followed, began: float, outage_seconds: float, timeout_seconds: float
) -> list[str] | None:
    """Try Redis on `reads` with backoff, each try bounded by `timeout_seconds`, until it answers
    (then the followed streams it lost: `lost_streams`) or `outage_seconds` have passed since
    `began` (None). An error reply that is no outage is raised."""
    loop = asyncio.get_running_loop()
    delay = min(RETRY_FIRST_SECONDS, outage_seconds)
    while (left := outage_seconds - (loop.time() - began)) > 0:
        await asyncio.sleep(min(delay, left))
        try:
            return await asyncio.wait_for(lost_streams(reads, followed), timeout_seconds)
        except (RedisError, TimeoutError) as failed:
            if isinstance(failed, RedisError) and not is_redis_outage(failed):
                raise
        delay = min(delay * 2, RETRY_MAX_SECONDS)
    return None


async def lost_streams(reads: HeldConnection, followed: Followed) -> list[str]:
    """Which followed streams Redis no longer has as their followers were reading them, in one
    round trip on `reads` (the tail's connection: that Redis answers at all is what it tells
    first): a stream gone (every followed stream exists from its response's enqueue, which writes
    its first events), or one whose newest event comes before what a follower has."""
    keys = list(followed)
    if not keys:
        await reads.command("PING")
        return []
    replies = await reads.pipeline(*[("XREVRANGE", key, "+", "-", "COUNT", 1) for key in keys])
    lost = []
    for key, entries in zip(keys, replies, strict=True):
        if isinstance(entries, Exception):
            raise entries
        followers = followed.get(key, ())  # its last follower may have gone meanwhile
        if not entries or any(follower.is_behind(sequence_of(entries[0][0])) for follower in followers):
            lost.append(key)
    return lost


def is_lost(newest: Event | None, follower: Follower) -> bool:
    """Whether a stream whose newest event is `newest` is lost to `follower` (as `lost_streams`)."""
    return newest is None or follower.is_behind(newest.sequence_number)
