"""A worker process's shared state (connections, routes, the responses it runs), and how it is
opened and closed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx2
from pydantic import SecretStr
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.connections import connect, sync_client
from worker.errors import ConfigError
from worker.events.lease import Lease, Leases
from worker.events.stream import EventLog
from worker.outages import OutageMemory
from worker.outbound import OutboundPolicy
from worker.postgres import store
from worker.postgres.direct import DirectPool
from worker.postgres.keys import compaction_sealer
from worker.protocol.compaction import Sealer
from worker.queue import ResponseQueue, delivery_queue
from worker.routing import Routes, load_routes
from worker.runner.ends import GatheredEnds
from worker.runner.metrics import WorkerMetrics
from worker.runner.search import DEFAULT_URLS, Searcher
from worker.runner.upstream import RetryPolicy, create_client
from worker.settings import Settings
from worker.webhooks import Notifier


class RunEnd(StrEnum):
    """How `run_response` ended, which decides what the queue is told."""

    FINISHED = "finished"  # the response has its terminal state (now, or from before): it leaves the queue
    FENCED = "fenced"  # another attempt holds it now: tell the queue nothing
    BUSY = "busy"  # another live holder kept it past the wait
    STOPPED = "stopped"  # this worker stopped it to shut down: back to the queue's front


@dataclass
class Runtime:
    """A worker process's connections and state, shared by every response it runs."""

    engine: AsyncEngine
    redis: Redis
    http: httpx2.AsyncClient
    routes: Routes
    holder: str
    stream_ttl_seconds: int
    synthetic_delay_seconds: float
    leases: Leases
    queue: ResponseQueue  # the queue this worker takes responses from
    notifier: Notifier  # webhook deliveries, recorded with a background response's end
    direct: DirectPool  # the hot single statements (a response's start and end) on psycopg directly
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    database_wait_seconds: float = 120.0
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    outbound: OutboundPolicy = field(default_factory=OutboundPolicy)  # DESIGN.md §13
    tool_timeout_seconds: float = 120.0
    searcher: Searcher | None = None  # the web search backend, if one is configured
    compaction_keys: SecretStr | None = None  # RESPOOL_COMPACTION_KEYS (None: the key in Postgres)
    compact_threshold_tokens: int = 24000  # `context_management`'s when it gives none and none is known
    compact_summary_tokens: int = 2048  # the longest summary a compaction asks for
    batch_seconds: float = 0.0  # RESPOOL_BATCH_MS (EventLog)
    gather_ends_seconds: float = 0.0  # RESPOOL_GATHER_ENDS_MS (GatheredEnds; 0: each end alone)
    # RESPOOL_REDIS_OUTAGE_SECONDS: how long a response's appends wait for an unreachable Redis.
    redis_outage_seconds: float = 60.0
    # How long after an outage this worker takes back its lapsed leases and leaves other workers'
    # missed deadlines alone: long enough for each live worker to renew what it holds.
    after_outage_seconds: float = 12.0
    outages: OutageMemory = field(default_factory=OutageMemory)
    log: EventLog = field(init=False)
    ends: GatheredEnds | None = field(init=False)  # unfollowed background responses' ends
    autocommit: AsyncEngine = field(init=False)  # for one-statement work (store.single_statements)
    running: dict[str, asyncio.Task[Any]] = field(default_factory=dict)
    # Set as each response starts to run (`attempt.run_response`): what is done only while responses
    # run waits on it while none does (`until_running`).
    started: asyncio.Event = field(default_factory=asyncio.Event)
    held: dict[str, Lease] = field(default_factory=dict)
    generating: set[str] = field(default_factory=set)  # between the upstream call's start and end
    cancelling: set[str] = field(default_factory=set)
    interrupted: dict[str, RunEnd] = field(default_factory=dict)  # fenced or stopped, by response
    left_queue: set[str] = field(default_factory=set)  # ended by a final append that left the queue too
    _sealer: Sealer | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.log = EventLog(
            self.redis,
            on_append=self.metrics.events.inc,
            batch_seconds=self.batch_seconds,
            on_outage=self.outages.met,
        )
        self.autocommit = store.single_statements(self.engine)
        self.ends = (
            GatheredEnds(self.direct, self.gather_ends_seconds, self.metrics.gathered_ends.observe)
            if self.gather_ends_seconds > 0
            else None
        )
        self.metrics.in_flight.set_function(lambda: len(self.running))

    async def sealer(self) -> Sealer:
        """The sealer of respool's compaction items, loaded on first use."""
        if self._sealer is None:
            self._sealer = await compaction_sealer(self.engine, self.compaction_keys)
        return self._sealer

    async def until_running(self) -> None:
        """Return at once while a response runs, else once one starts."""
        if not self.running:
            self.started.clear()
            await self.started.wait()

    def request_cancel(self, response_id: str) -> None:
        """Interrupt the response's upstream call (the cancel watcher saw its flag).

        Outside the upstream call the flag is seen at the next append, or the final commit loses
        to the cancel recorded in Postgres, so only a generating task is interrupted.
        """
        task = self.running.get(response_id)
        if task is not None and response_id in self.generating and response_id not in self.cancelling:
            self.cancelling.add(response_id)
            task.cancel()

    def recovering(self) -> bool:
        """Whether Redis was unreachable too lately for leases and deadlines to be judged by."""
        return self.outages.within(self.after_outage_seconds)

    async def reclaim(self, lease: Lease) -> bool:
        """Take `lease` again where it lapsed during a recent outage and no later attempt started
        (an append found it gone before the heartbeat took it again); False if it is lost."""
        return self.recovering() and await self.leases.reclaim(lease)

    def interrupt(self, response_id: str, end: RunEnd) -> None:
        """Stop the response's attempt at once: its lease was lost (FENCED), or the worker stops (STOPPED)."""
        task = self.running.get(response_id)
        if task is not None and response_id not in self.interrupted:
            self.interrupted[response_id] = end
            task.cancel()


async def open_runtime(settings: Settings, holder: str, concurrency: int) -> Runtime:
    """Connections for a process that runs up to `concurrency` responses at once."""
    redis = connect(settings.redis_url, max_connections=max(16, concurrency // 4))
    routes = load_routes(settings)
    # The deliveries' queue only builds RQ's commands on this client; they go out on `redis`.
    deliveries = delivery_queue(sync_client(settings.redis_url), settings.queue)
    engine, direct = store.open_pools(settings)
    return Runtime(
        notifier=Notifier(routes.webhooks, redis, deliveries),
        engine=engine,
        direct=direct,
        redis=redis,
        http=create_client(
            settings.upstream_stall_seconds, concurrency, connect_seconds=settings.upstream_connect_seconds
        ),
        retry=RetryPolicy.from_settings(settings),
        database_wait_seconds=settings.database_wait_seconds,
        routes=routes,
        holder=holder,
        stream_ttl_seconds=settings.stream_ttl_seconds,
        synthetic_delay_seconds=settings.synthetic_delay_seconds,
        leases=Leases(redis, settings.lease_seconds),
        queue=ResponseQueue(redis, settings.queue, settings.registry_seconds),
        outbound=OutboundPolicy.parse(settings.outbound_allowlist),
        tool_timeout_seconds=settings.tool_timeout_seconds,
        searcher=searcher_of(settings, routes),
        compaction_keys=settings.compaction_keys,
        compact_threshold_tokens=settings.compact_threshold_tokens,
        compact_summary_tokens=settings.compact_summary_tokens,
        batch_seconds=settings.batch_ms / 1000,
        gather_ends_seconds=settings.gather_ends_ms / 1000,
        redis_outage_seconds=settings.redis_outage_seconds,
        after_outage_seconds=settings.registry_seconds + 2 * settings.heartbeat_seconds,
    )


def searcher_of(settings: Settings, routes: Routes) -> Searcher | None:
    """The web search backend the settings configure, or None; `ConfigError` if the `mcp` backend's
    server is not registered."""
    backend = settings.web_search_backend
    if not backend:
        return None
    if backend == "mcp":
        label, _, tool = settings.web_search_mcp_tool.partition("/")
        registered = routes.mcp_servers.get(label)
        if registered is None:
            raise ConfigError(
                f"RESPOOL_WEB_SEARCH_MCP_TOOL names '{label}', which respool.toml does not register "
                "under [mcp_servers]"
            )
        return Searcher(backend, max_results=settings.web_search_max_results, server=registered, tool=tool)
    key = settings.web_search_api_key.get_secret_value() if settings.web_search_api_key else ""
    url = settings.web_search_url or DEFAULT_URLS.get(backend, "")
    return Searcher(backend, url, key, settings.web_search_max_results)


async def close_runtime(rt: Runtime) -> None:
    await rt.http.aclose()
    await rt.engine.dispose()
    if rt.ends is not None:
        await rt.ends.close()
    await rt.direct.close()
    await rt.queue.close()
    await rt.redis.aclose(close_connection_pool=True)  # connect() hands the client a pool of its own
