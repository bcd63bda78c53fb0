"""What respool needs of its Redis, asked of it once at start: a process refuses to run on a Redis
it cannot work with, naming what is wrong, rather than answering 500s and crash-looping later.

Needed: a standalone Redis (or a Sentinel-managed primary), not a Redis Cluster, since one Lua script
names a response's lease, events and queue keys together, which a cluster keeps in other slots; of
version 6.2 or newer (GETDEL, LMOVE, BLMOVE); with every command respool and RQ send.
"""

from __future__ import annotations

import logging
from typing import Any

from redis import Redis
from redis.exceptions import ResponseError

from worker.errors import ConfigError
from worker.outages import is_redis_outage

log = logging.getLogger("respool.compatibility")

MINIMUM_VERSION = (6, 2)
# Every command respool sends (its scripts' included) and the ones RQ's webhook deliveries add.
COMMANDS = (
    "EVAL", "EVALSHA", "SCRIPT", "XADD", "XREAD", "XRANGE", "XREVRANGE", "GETDEL", "LMOVE", "BLMOVE",
    "LPUSH", "RPUSH", "LREM", "LINDEX", "LLEN", "LRANGE", "ZADD", "ZREM", "ZCARD", "ZRANGEBYSCORE",
    "ZREMRANGEBYSCORE", "SET", "GET", "DEL", "EXISTS", "EXPIRE", "PEXPIRE", "PTTL", "INCR", "TIME",
    "HSET", "HGETALL", "SADD", "SREM", "SMEMBERS", "MULTI", "EXEC", "PING", "INFO",
)  # fmt: skip


class UnsupportedRedisError(ConfigError):
    """The Redis respool was pointed at cannot run it; the message says why."""


def problems(server_info: dict[str, Any], missing: list[str]) -> list[str]:
    """What is wrong with a Redis whose `INFO server` is `server_info` and that lacks `missing`.

    Rules:
    - `redis_mode: cluster` => Redis Cluster is not supported
    - `redis_version` below MINIMUM_VERSION => too old, naming both versions
    - any command missing => named, all of them
    """
    found: list[str] = []
    if server_info.get("redis_mode") == "cluster":
        found.append(
            "Redis Cluster is not supported yet: respool's scripts name a response's lease, events and "
            "queue keys together, which a cluster spreads over slots. Use a standalone Redis or a "
            "Sentinel-managed primary (RESPOOL_REDIS_SENTINELS; docs/redis.md)"
        )
    version = str(server_info.get("redis_version", ""))
    if version and _version(version) < MINIMUM_VERSION:
        needed = ".".join(map(str, MINIMUM_VERSION))
        found.append(f"Redis {version} is too old: respool needs {needed} or newer (GETDEL, LMOVE)")
    if missing:
        found.append(f"this Redis lacks commands respool sends (renamed or disabled?): {', '.join(missing)}")
    return found


def check_redis(redis: Redis) -> None:
    """Raise `UnsupportedRedisError` naming everything that keeps respool from running on `redis`.
    An unreachable Redis is an outage, not a refusal: it is logged, and the process starts."""
    try:
        server_info = redis.info("server")
        replies = redis.execute_command("COMMAND INFO", *COMMANDS)  # type: ignore[no-untyped-call]
    except ResponseError as exc:  # COMMAND or INFO itself disabled: nothing else can be asked
        raise UnsupportedRedisError(
            f"this Redis refused to describe itself (INFO, COMMAND INFO): {exc}"
        ) from exc
    except Exception as exc:
        if not is_redis_outage(exc):
            raise
        log.warning("Redis could not be checked at start (%s): it is checked at the next start", exc)
        return
    missing = [name for name, reply in zip(COMMANDS, replies, strict=True) if reply is None]
    found = problems(server_info, missing)
    if found:
        raise UnsupportedRedisError("; ".join(found))


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split(".")[:2]:
        parts.append(int(part) if part.isdigit() else 0)
    return tuple(parts)
