"""Looking at per-owner quotas (worker/service/quota.py) from outside, through Redis, for tests that must
not spend an owner's requests on asking."""

from __future__ import annotations

from redis import Redis

from worker.keys import streams_key


def live_stream_slots(redis_url: str, owner: str) -> int:
    """How many stream slots `owner` holds whose lease has not run out, by Redis's clock."""
    with Redis.from_url(redis_url) as redis:
        seconds, micros = redis.time()
        now_ms = seconds * 1000 + micros // 1000
        return int(redis.zcount(streams_key(owner), f"({now_ms}", "+inf"))


def stream_slot_expiries(redis_url: str, owner: str) -> list[float]:
    """When each of `owner`'s stream slots runs out (ms, Redis's clock), soonest first."""
    with Redis.from_url(redis_url) as redis:
        return [score for _, score in redis.zrange(streams_key(owner), 0, -1, withscores=True)]
