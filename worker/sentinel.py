"""Redis behind Sentinel: where the sentinels and the primary's name are (`SentinelAddress`, the
`redis+sentinel://` URL), and the pools that follow the primary the sentinels name
(`async_pool`, `sync_pool`) through a failover. `worker.connections` builds every client on them.

Sentinel promotes the replica while the old primary still takes writes, and demotes that one
seconds later (about 11 s after SENTINEL FAILOVER on loopback): every write it takes meanwhile is
lost when it resyncs. So each pool listens to every sentinel's `+try-failover` and `+switch-master`:
from a failover's start until one announces the new primary (or `_FAILOVER_WAIT_SECONDS` pass) the
pool holds no connection and makes none, its commands failing as a dropped connection does (an
outage of the failover's length, which respool's outage handling rides out); and while some
sentinels still name the old primary it goes to the announced one (they switch one by one).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, unquote

from redis import Redis as SyncRedis
from redis import sentinel as sync_sentinel
from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("respool.sentinel")

SENTINEL_SCHEME = "redis+sentinel"
_SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelAddress:
    """Where a Sentinel-managed primary is found: `redis+sentinel://[[user]:password@]host[:port][,…]
    /master[/db][?sentinel_password=…]`, the password the primary's (and its replicas')."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None

    @classmethod
    def parse(cls, url: str) -> SentinelAddress:
        """The address `url` names; `ValueError` saying what is wrong with it."""
        rest = url.removeprefix(f"{SENTINEL_SCHEME}://")
        rest, _, query = rest.partition("?")
        netloc, _, path = rest.partition("/")
        userinfo, _, hosts = netloc.rpartition("@")
        username, _, password = userinfo.partition(":")
        master, _, db = path.strip("/").partition("/")
        if not master:
            raise ValueError(f"{url!r} names no master: redis+sentinel://host:port,…/<master>")
        if not db.isdigit() and db:
            raise ValueError(f"{url!r}: the database after the master must be a number")
        sentinel_password = parse_qs(query).get("sentinel_password", [None])[-1]
        return cls(
            sentinels=tuple(_host_port(item, url) for item in hosts.split(",") if item),
            master=unquote(master),
            db=int(db or 0),
            username=unquote(username) or None,
            password=unquote(password) or None,
            sentinel_password=sentinel_password,
        )

    def connection_kwargs(self) -> dict[str, Any]:
        return {"db": self.db, "username": self.username, "password": self.password}

    def sentinel_kwargs(self, timeout_seconds: float | None) -> dict[str, Any]:
        """How each sentinel is asked: bounded even where the primary's replies need not be."""
        bound = timeout_seconds or 5.0
        return {
            "socket_connect_timeout": bound,
            "socket_timeout": bound,
            "password": self.sentinel_password,
        }


def _host_port(item: str, url: str) -> tuple[str, int]:
    host, _, port = item.strip().rpartition(":") if ":" in item else (item, "", "")
    if not host or (port and not port.isdigit()):
        raise ValueError(f"{url!r}: {item!r} is not a sentinel's host:port")
    return host, int(port or _SENTINEL_PORT)


def sentinel_address(redis_url: str) -> SentinelAddress | None:
    """The Sentinel address `redis_url` names, or None for a plain Redis URL."""
    if not redis_url.startswith(f"{SENTINEL_SCHEME}://"):
        return None
    return SentinelAddress.parse(redis_url)


def sentinel_url(sentinels: str, master: str, sentinel_password: str | None = None) -> str:
    """The `redis+sentinel://` URL of RESPOOL_REDIS_SENTINELS and RESPOOL_REDIS_SENTINEL_MASTER."""
    hosts = ",".join(item.strip() for item in sentinels.split(",") if item.strip())
    query = f"?sentinel_password={quote(sentinel_password, safe='')}" if sentinel_password else ""
    return f"{SENTINEL_SCHEME}://{hosts}/{quote(master, safe='')}{query}"


def is_role_change(reply: Any) -> bool:
    """A reply that says the connection's server stopped being the primary: READONLY (a replica now),
    NOREPLICAS (`min-replicas-to-write`: its replica left it, promoted), UNBLOCKED (a blocked read
    cut short as its role changed)."""
    if isinstance(reply, ReadOnlyError):
        return True
    return isinstance(reply, ResponseError) and str(reply).startswith(("NOREPLICAS", "UNBLOCKED"))


class _PrimaryConnection(SentinelManagedConnection):
    """A connection to the sentinels' primary that, on a reply saying it is no longer the primary,
    disconnects (the next connect asks the sentinels again) and fails as a dropped connection does,
    which `connect`'s retry, `bare_pipeline` and the outage handling all treat as one."""

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except ResponseError as exc:
            if not is_role_change(exc):
                raise
            await self.disconnect()
            raise RedisConnectionError(f"{self.host}:{self.port} is no longer the primary: {exc}") from exc


class _SyncPrimaryConnection(sync_sentinel.SentinelManagedConnection):
    """`_PrimaryConnection` for RQ's synchronous client."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except ResponseError as exc:
            if not is_role_change(exc):
                raise
            self.disconnect()  # type: ignore[no-untyped-call]
            raise RedisConnectionError(f"{self.host}:{self.port} is no longer the primary: {exc}") from exc


# How long a pool waits, once a failover has begun, for a sentinel to announce the new primary
# before it trusts the old one again (a failover that neither ends nor aborts).
_FAILOVER_WAIT_SECONDS = 15.0
_EVENTS = (
    "+try-failover",
    "+switch-master",
    "-failover-abort-not-elected",
    "-failover-abort-no-good-slave",
    "-failover-abort-slave-timeout",
)

Address = tuple[str, int]


class _Failover:
    """What the sentinels have announced of one primary's failover, for a pool to obey."""

    def __init__(self, service_name: str) -> None:
        self.service_name = service_name
        self._stale: Address | None = None  # the primary being left, for a while
        self._until = 0.0
        self._switched_to: Address | None = None  # the new primary, once announced

    def heard(self, channel: str, data: str) -> bool:
        """Take in a sentinel's event; whether the pool must drop its connections (every one: a
        connection to the old primary must not take another write)."""
        words = data.split()
        name = words[0] if channel == "+switch-master" else (words[1] if len(words) > 1 else "")
        if name != self.service_name:
            return False
        self._until = time.monotonic() + _FAILOVER_WAIT_SECONDS
        if channel == "+try-failover" and len(words) >= 4:  # master <name> <ip> <port>
            self._stale, self._switched_to = (words[2], int(words[3])), None
        elif channel == "+switch-master" and len(words) == 5:  # <name> <old ip> <port> <new ip> <port>
            self._stale, self._switched_to = (words[1], int(words[2])), (words[3], int(words[4]))
        elif self._stale is not None and self._switched_to is None:
            self._stale = None  # aborted: the old primary is the primary still
        else:
            return False
        return True

    def primary(self, named: Address) -> Address:
        """The primary to connect to when a sentinel names `named`: never one being left."""
        if (named[0], int(named[1])) != self._stale or time.monotonic() >= self._until:
            return named
        if self._switched_to is None:
            raise MasterNotFoundError(f"{self.service_name!r} is failing over")
        return self._switched_to


def _listening(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A sentinel's connection settings for a subscription: its connect bounded, its reads not (an
    idle subscription is silent for as long as no failover happens)."""
    kept = ("host", "port", "password", "socket_connect_timeout")
    return {**{key: kwargs[key] for key in kept if key in kwargs}, "socket_keepalive": True}


class _FollowingPool(SentinelConnectionPool):
    """An asyncio pool of connections to the primary the sentinels name, through a failover (the
    module's docstring); it listens from its first checkout on, until it is closed."""

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        super().__init__(service_name, sentinel_manager, **kwargs)  # type: ignore[no-untyped-call]
        self._failover = _Failover(service_name)
        self._watch: asyncio.Task[None] | None = None

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._follow())
        return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]

    async def get_master_address(self) -> Any:
        named = self._failover.primary(await self.sentinel_manager.discover_master(self.service_name))
        if self.master_address != named:
            self.master_address = named
            await self.disconnect(inuse_connections=False)  # idle ones reconnect to it when next used
        return named

    async def disconnect(self, inuse_connections: bool = True) -> None:
        if inuse_connections and self._watch is not None:  # closing: the watch goes with the pool
            self._watch.cancel()
            self._watch = None
            await self.sentinel_manager.aclose()  # its clients connect again if the pool is used again
        await super().disconnect(inuse_connections)

    async def _follow(self) -> None:
        hosts = [sentinel.connection_pool.connection_kwargs for sentinel in self.sentinel_manager.sentinels]
        await asyncio.gather(*(self._follow_one(Redis(**_listening(kwargs))) for kwargs in hosts))

    async def _follow_one(self, sentinel: Redis) -> None:
        try:
            while True:
                try:
                    async with sentinel.pubsub() as pubsub:
                        await pubsub.subscribe(*_EVENTS)
                        async for message in pubsub.listen():
                            if message["type"] == "message" and self._failover.heard(
                                message["channel"].decode(), message["data"].decode()
                            ):
                                await super().disconnect(inuse_connections=True)
                except (RedisConnectionError, RedisTimeoutError, OSError):
                    await asyncio.sleep(1)  # that sentinel is away: the others are listened to meanwhile
                except Exception:  # whatever it was, a pool that stops listening stops following
                    log.exception("listening to the sentinel failed; listening again in 1 s")
                    await asyncio.sleep(1)
        finally:
            await sentinel.aclose()


class _BlockingFollowingPool(_FollowingPool, BlockingConnectionPool):
    """`_FollowingPool` making a burst wait for a free connection."""


class _SyncFollowingProxy(sync_sentinel.SentinelConnectionPoolProxy):
    """What a synchronous sentinel connection asks for its primary's address (redis-py's design)."""

    failover: _Failover

    def get_master_address(self) -> Any:
        named = self.failover.primary(self.sentinel_manager.discover_master(self.service_name))
        if self.master_address != named:
            self.master_address = named
            pool = self.connection_pool_ref()
            if pool is not None:
                pool.disconnect(inuse_connections=False)
        return named


class _SyncFollowingPool(sync_sentinel.SentinelConnectionPool):
    """`_FollowingPool` for RQ's synchronous client: a daemon thread listens to each sentinel, from
    the pool's first checkout until it is closed (`disconnect()`)."""

    def __init__(self, service_name: str, sentinel_manager: Any, **kwargs: Any) -> None:
        super().__init__(service_name, sentinel_manager, **kwargs)  # type: ignore[no-untyped-call]
        self._failover = _Failover(service_name)
        self.proxy = _SyncFollowingProxy(  # type: ignore[no-untyped-call]
            self, self.is_master, self.check_connection, service_name, sentinel_manager
        )
        self.proxy.failover = self._failover
        self.connection_kwargs["connection_pool"] = self.proxy
        self._watch_lock = threading.Lock()
        self._stop: threading.Event | None = None  # set: the listening threads end

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        with self._watch_lock:
            if self._stop is None:
                self._stop = threading.Event()
                for sentinel in self.sentinel_manager.sentinels:
                    listening = _listening(sentinel.connection_pool.connection_kwargs)
                    threading.Thread(
                        target=self._follow_one, args=(listening, self._stop), daemon=True
                    ).start()
        return super().get_connection(*args, **kwargs)

    def disconnect(self, inuse_connections: bool = True) -> None:
        if inuse_connections:  # closing: the listening goes with the pool
            with self._watch_lock:
                if self._stop is not None:
                    self._stop.set()
                    self._stop = None
        super().disconnect(inuse_connections)

    def _drop_connections(self) -> None:
        """Idle connections now; one in use as it comes back (closing a socket under another
        thread's read breaks that read with errors that are no dropped connection's)."""
        with self._lock:
            in_use = list(self._in_use_connections)
        for connection in in_use:
            connection.mark_for_reconnect()
        super().disconnect(inuse_connections=False)

    def _follow_one(self, kwargs: dict[str, Any], stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                with SyncRedis(**kwargs) as sentinel, sentinel.pubsub() as pubsub:
                    pubsub.subscribe(*_EVENTS)
                    while not stop.is_set():
                        # a bounded wait, so a closed pool's thread ends (rarely: waking costs CPU)
                        message = pubsub.get_message(timeout=_STOP_SECONDS)
                        if (
                            message
                            and message["type"] == "message"
                            and self._failover.heard(message["channel"].decode(), message["data"].decode())
                        ):
                            self._drop_connections()
            except (RedisConnectionError, RedisTimeoutError, OSError):
                stop.wait(1)
            except Exception:
                log.exception("listening to the sentinel failed; listening again in 1 s")
                stop.wait(1)


_STOP_SECONDS = 10.0


def async_pool(
    address: SentinelAddress, timeout_seconds: float, *, is_blocking: bool, **kwargs: Any
) -> ConnectionPool:
    """An asyncio pool of connections to `address`'s primary (`kwargs`: the pool's and its
    connections' settings); `is_blocking`: a burst waits for a free connection."""
    sentinels = Sentinel(address.sentinels, sentinel_kwargs=address.sentinel_kwargs(timeout_seconds))  # type: ignore[no-untyped-call]
    pool_class = _BlockingFollowingPool if is_blocking else _FollowingPool
    return pool_class(
        address.master,
        sentinels,
        connection_class=_PrimaryConnection,
        **address.connection_kwargs(),
        **kwargs,
    )


def sync_pool(address: SentinelAddress, timeout_seconds: float | None, **kwargs: Any) -> Any:
    """RQ's synchronous pool of connections to `address`'s primary."""
    sentinels = sync_sentinel.Sentinel(  # type: ignore[no-untyped-call]
        address.sentinels, sentinel_kwargs=address.sentinel_kwargs(timeout_seconds)
    )
    return _SyncFollowingPool(
        address.master,
        sentinels,
        connection_class=_SyncPrimaryConnection,
        **address.connection_kwargs(),
        **kwargs,
    )
