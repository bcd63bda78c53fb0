"""The queue contract between the API and the workers (DESIGN.md §4).

Responses go through respool's own queue: a Redis list of response ids (`queue_key`), and beside
it a sorted set of every response the queue holds (`held_key`): waiting (+inf), or running, scored
by when its holder must have renewed its lease by. A worker pops an id into a list of its own
(`taking_key`: a worker killed between the pop and the lease loses nothing) with a script
pipelined behind the pop, which Redis runs as soon as the pop is served: it takes the id out of
that list, sets its deadline and takes the lease (`take_started`). Only the id is queued; beside it,
for a few seconds, the row as recorded (its ticket, `store.ticket`: no secret is in a row), which
that round trip takes too, so the worker can call the upstream before Postgres has started the
row. A ticket is an optimisation only: without one (too large, expired, or taken by a worker that
died) the worker reads the row.

RQ's job records (a hash a job, its registries, executions and results: about 30 commands and
1.5 ms of a worker's CPU a response) are kept for webhook deliveries only, which are RQ jobs on
a queue of their own. RQ is synchronous: the API sends their enqueue's commands (which RQ builds)
on its asyncio client, and calls the other functions here in a thread.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from redis import Redis as SyncRedis
from redis.asyncio import Redis as AsyncRedis
from redis.client import Pipeline
from redis.exceptions import NoScriptError
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from worker.connections import HeldConnection, HeldConnections, bare_pipeline
from worker.events.lease import ACQUIRE_FUNCTION, FlatEntry, Lease, Leases, acquired, release_commands
from worker.events.stream import Event, entry_id
from worker.keys import (
    announce_key,
    attempt_key,
    cancel_key,
    events_key,
    held_key,
    lease_key,
    observed_key,
    queue_key,
    queued_key,
    secrets_key,
    taking_key,
    ticket_key,
    workers_key,
)

# A delivery attempt's job function, as RQ records it (respool's worker runs it itself).
DELIVERY_FUNCTION = "worker.runner.deliver_job"
# A delivery may take long; the worker's own timeouts bound it, not RQ's job timeout.
JOB_TIMEOUT = -1
RESULT_TTL = 600
# A ticket is kept this long: a response that waits longer than that for a worker has no use for
# the millisecond it saves, and the tickets a backlog holds stay bounded.
TICKET_SECONDS = 10
TICKET_MAX_BYTES = 64 * 1024  # a Codex CLI first request takes 45 KiB

# KEYS: events, queued marker, held, queue, ticket, secrets, observed mark, announce. ARGV: response
# id, the queue's name, ticket ("" for none), its seconds, secrets ("" for none), their seconds,
# whether its creator relays it ("1" or ""), the `response.in_progress` its take appends ("" for
# none; kept as long as the ticket), then each first event's entry id, type and data.
# `ResponseQueue.enqueue`: one script, sent bare (a MULTI through redis-py's pipeline cost 136 µs of
# the API's CPU against 50, in a loop on this project's machine).
_ENQUEUE = """
if ARGV[3] ~= '' then redis.call('SET', KEYS[5], ARGV[3], 'EX', ARGV[4]) end
if ARGV[5] ~= '' then redis.call('SET', KEYS[6], ARGV[5], 'EX', ARGV[6]) end
if ARGV[7] ~= '' then redis.call('SET', KEYS[7], '1') end
if ARGV[8] ~= '' then redis.call('SET', KEYS[8], ARGV[8], 'EX', ARGV[4]) end
for i = 9, #ARGV, 3 do redis.call('XADD', KEYS[1], ARGV[i], 't', ARGV[i + 1], 'd', ARGV[i + 2]) end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[3], 'inf', ARGV[1])
redis.call('RPUSH', KEYS[4], ARGV[1])
return 1
"""
_ENQUEUE_SHA = hashlib.sha1(_ENQUEUE.encode()).hexdigest()

# KEYS: held, queued marker, lease. ARGV: response id, lease value. `ResponseQueue.finished`: the
# response leaves what the queue holds, and its lease is given back if it is still this one.
_FINISHED = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
if redis.call('GET', KEYS[3]) == ARGV[2] then redis.call('DEL', KEYS[3]) end
return 1
"""
_FINISHED_SHA = hashlib.sha1(_FINISHED.encode()).hexdigest()

# KEYS: queue, held. ARGV: response id. Takes a response that no worker has taken out of the queue.
_REMOVE_QUEUED = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

# KEYS: taking, queue. Puts back, at the front of the queue, what a worker had popped and not leased.
_PUT_BACK = """
local n = 0
while redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'LEFT') do n = n + 1 end
return n
"""


# KEYS: taking, queue. ARGV: response id. Puts one popped response back at the front of the queue.
_HAND_BACK = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
redis.call('LPUSH', KEYS[2], ARGV[1])
return 1
"""

# KEYS: RQ's queue of responses (an earlier release's), the queue, held. ARGV: the queue's name,
# then what comes before and after a response id in its `queued_key`. Takes in what RQ's holds.
_ADOPT = """
local n = 0
while true do
  local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
  if not id then return n end
  redis.call('ZADD', KEYS[3], 'inf', id)
  redis.call('SET', ARGV[2] .. id .. ARGV[3], ARGV[1])
  n = n + 1
end
"""
_QUEUED_KEY_AROUND = tuple(queued_key("\n").split("\n"))

# KEYS: a worker's taking list, held. ARGV: holder, lease ttl ms, deadline ms from now, then what
# comes before and after a response id in its lease, attempt, events, ticket, announce and cancel
# keys. Sent right behind the worker's blocking pop, on its connection, so Redis runs it the moment
# the pop moves a response into the taking list: `ResponseQueue.start`'s work (out of the list, its
# deadline by Redis's clock, its lease and newest entry, its ticket) without a round trip of its
# own. A fresh background response (its ticket and its announce key there, its stream still ending
# at its create's `response.queued`, no cancel requested) is told `in_progress` here too: the
# event its create encoded is appended under the new lease, as its worker's first append would
# have. An empty list (the pop timed out): nil. Otherwise {the id, the acquire's reply (its newest
# entry the `in_progress` if it was appended), the ticket, 1 if it was}.
_START_POPPED = (
    ACQUIRE_FUNCTION
    + """
local id = redis.call('LINDEX', KEYS[1], -1)
if not id then return false end
local ticket = redis.call('GETDEL', ARGV[10] .. id .. ARGV[11])
local announce = redis.call('GETDEL', ARGV[12] .. id .. ARGV[13])
redis.call('LREM', KEYS[1], 0, id)
local now = redis.call('TIME')
local deadline = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) + tonumber(ARGV[3])
redis.call('ZADD', KEYS[2], deadline, id)
local lease, attempt, events = ARGV[4] .. id .. ARGV[5], ARGV[6] .. id .. ARGV[7], ARGV[8] .. id .. ARGV[9]
local taken = acquire(lease, attempt, events, ARGV[1], ARGV[2])
local newest = taken[2]
if ticket and announce and newest and newest[1] and newest[1][1] == '0-2'
    and redis.call('EXISTS', ARGV[14] .. id .. ARGV[15]) == 0 then
  redis.call('XADD', events, '0-3', 't', 'response.in_progress', 'd', announce)
  taken[2] = {{'0-3', {'t', 'response.in_progress', 'd', announce}}}
  return {id, taken, ticket, 1}
end
return {id, taken, ticket}
"""
)
_START_POPPED_SHA = hashlib.sha1(_START_POPPED.encode()).hexdigest()
_AROUND = tuple(
    part
    for key in (lease_key, attempt_key, events_key, ticket_key, announce_key, cancel_key)
    for part in key("\n").split("\n")
)


class Started(NamedTuple):
    """A response a worker has started: its lease, the stream's newest entry, its ticket, and whether
    its take appended its `response.in_progress` (then the newest entry)."""

    lease: Lease
    newest: FlatEntry | None
    ticket: bytes | None
    announced: bool = False


class ResponseQueue:
    """One queue of responses (`RESPOOL_QUEUE`) on an asyncio client."""

    def __init__(self, redis: AsyncRedis, name: str, deadline_seconds: float = 8.0) -> None:
        self.redis = redis
        self.name = name
        self.key = queue_key(name)
        self.held = held_key(name)
        self.workers = workers_key(name)
        # How long a running response's holder has to renew it before it counts as abandoned.
        self.deadline_seconds = deadline_seconds
        self._round_trips = HeldConnections(redis, 4)  # a create's enqueue, a response's end
        self._popping: tuple[AsyncRedis, HeldConnection] | None = None  # the taker's, on its client

    async def close(self) -> None:
        """Give the connections it holds back to their pools."""
        await self._round_trips.close()
        if self._popping is not None:
            await self._popping[1].close()

    async def enqueue(
        self,
        response_id: str,
        first_events: list[Event],
        secrets: tuple[bytes, int] | None = None,
        ticket: bytes | None = None,
        *,
        is_relayed: bool = False,
        announce: bytes = b"",
    ) -> None:
        """Append the response's first events and queue it, in one script (DESIGN.md §2.1); with
        `secrets` (its tools' secrets, and how many seconds to keep them), those too, and its
        `ticket` if it has one, with `announce` beside it (a background response's `in_progress`
        event, sequence 2, for the take that starts it to append: `take_started`). `is_relayed`:
        its creator follows it from its first event (a foreground or streamed create), so it is
        marked observed here, as a relay's first read marks it (DESIGN.md §4, "Orphans"), and that
        follow needs no read of its own to mark it."""
        keys = (
            events_key(response_id),
            queued_key(response_id),
            self.held,
            self.key,
            ticket_key(response_id),
            secrets_key(response_id),
            observed_key(response_id),
            announce_key(response_id),
        )
        args: list[str | bytes | int] = [response_id, self.name, ticket or b"", TICKET_SECONDS]
        args += (b"", 0) if secrets is None else secrets
        args += (b"1" if is_relayed else b"", announce if ticket else b"")
        for event in first_events:
            args += (entry_id(event.sequence_number), event.type, event.data)
        try:
            await self._round_trips.command("EVALSHA", _ENQUEUE_SHA, len(keys), *keys, *args)
        except NoScriptError:  # a Redis that restarted (or flushed its scripts) ran nothing of it
            # Sent whole (EVAL), not loaded then asked for again: scripts flushed between the two
            # would fail the create (seen where test sessions share a Redis that one flushes).
            await self._round_trips.command("EVAL", _ENQUEUE, len(keys), *keys, *args)

    async def depth(self) -> int:
        """How many responses wait for a worker."""
        return int(await self.redis.llen(self.key))

    async def remove_queued(self, response_id: str) -> bool:
        """Take a response that no worker has taken out of the queue; False if a worker has it."""
        if not await self.redis.eval(_REMOVE_QUEUED, 2, self.key, self.held, response_id):
            return False
        await self.redis.delete(*(key(response_id) for key in (queued_key, ticket_key, announce_key)))
        return True

    async def forget(self, response_id: str) -> None:
        """Drop a deleted response from what the queue holds (its own keys are deleted with it)."""
        await self.redis.zrem(self.held, response_id)

    # The worker's side ---------------------------------------------------------------------------

    async def take(self, blocking: AsyncRedis, worker: str, timeout_seconds: float) -> str | None:
        """The next response id, popped into `worker`'s taking list (None: none came in time).
        `blocking` is a client whose reads may wait that long. (A worker takes with `take_started`;
        this pop alone leaves what a worker that died before its start would.)"""
        popped = await blocking.execute_command(  # type: ignore[no-untyped-call]
            "BLMOVE", self.key, taking_key(self.name, worker), "LEFT", "RIGHT", timeout_seconds
        )
        return None if popped is None else _decoded(popped)

    async def load_scripts(self) -> None:
        """Load the start that `take_started` pipelines behind its pop, before the first take: a
        Redis that lacks it (new, or restarted) answers that start NOSCRIPT, and the response the pop
        took is started only when the worker reads that and asks again (`EVAL`), where a frozen or
        dead worker never does (its response then waits for the sweep to find its dead taker)."""
        await self.redis.script_load(_START_POPPED)

    async def take_started(
        self, blocking: AsyncRedis, leases: Leases, worker: str, timeout_seconds: float
    ) -> tuple[str, Started | None] | None:
        """`take` and `start` in one round trip (`_START_POPPED`, pipelined behind the pop): the next
        response id and, unless another holder's lease is alive, its start (None: nothing came in
        time)."""
        taking = taking_key(self.name, worker)
        deadline_ms = int(self.deadline_seconds * 1000)
        start: tuple[str | int, ...] = (2, taking, self.held, worker, leases.ttl_ms, deadline_ms, *_AROUND)
        # Sent bare, the pop and the script in one write: redis-py's pipeline cost a third of a
        # millisecond of the worker's CPU, spent before the response it had just taken could start.
        pop = ("BLMOVE", self.key, taking, "LEFT", "RIGHT", timeout_seconds)
        if self._popping is None or self._popping[0] is not blocking:  # one taker a worker
            self._popping = (blocking, HeldConnection(blocking))
        _, started = await self._popping[1].pipeline(pop, ("EVALSHA", _START_POPPED_SHA, *start))
        if isinstance(started, NoScriptError):  # a Redis that restarted: what the pop took is started
            (started,) = await bare_pipeline(self.redis, ("EVAL", _START_POPPED, *start))
        if isinstance(started, Exception):  # the script failed: what the pop took goes back
            await self.redis.eval(_PUT_BACK, 2, taking, self.key)
            raise started
        if started is None:
            return None
        popped, reply, ticket, *announced = started
        response_id = _decoded(popped)
        taken = acquired(response_id, worker, reply)
        return response_id, None if taken is None else Started(*taken, ticket, bool(announced))

    async def start(self, leases: Leases, response_id: str, worker: str) -> Started | None:
        """Take the response out of `worker`'s taking list, give it a deadline, and take its lease
        with the stream's newest entry and its ticket, in one round trip and one transaction (the
        response is never out of the list without its deadline); None while another holder's lease
        is alive (it renews the deadline then; the ticket is gone either way)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.lrem(taking_key(self.name, worker), 0, response_id)
            pipe.zadd(self.held, {response_id: _ms(time.time() + self.deadline_seconds)})
            pipe.delete(announce_key(response_id))  # told by this worker's own first append
            pipe.getdel(ticket_key(response_id))
            leases.acquire_commands(pipe, response_id, worker)
            replies = await pipe.execute()
        taken = acquired(response_id, worker, replies[-1])
        return None if taken is None else Started(*taken, replies[-2])

    def leaving(self, response_id: str) -> tuple[str, str]:
        """The keys a response that ends leaves this queue by, for its final append to do what
        `finished` does in the same step (`EventLog.append`): the held set, its queued key."""
        return self.held, queued_key(response_id)

    async def finished(self, leases: Leases, lease: Lease) -> None:
        """The response has ended: give its lease back and drop it from what the queue holds, in one
        script sent bare (a MULTI through redis-py's pipeline was a sixth of a short response's
        Redis round trips in a worker's profile)."""
        rid = lease.response_id
        args = (3, self.held, queued_key(rid), lease_key(rid), rid, lease.value)
        try:
            await self._round_trips.command("EVALSHA", _FINISHED_SHA, *args)
        except NoScriptError:  # a Redis that restarted (or flushed its scripts) ran nothing of it
            await self._round_trips.command("EVAL", _FINISHED, *args)

    async def put_back(self, leases: Leases, lease: Lease) -> None:
        """A response this worker stopped (to shut down): at the front of the queue, then its lease
        given back. Queued first: should this process die in between, the lease expires onto a
        response that is queued (and held as waiting), which another worker takes."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.lpush(self.key, lease.response_id)
            pipe.zadd(self.held, {lease.response_id: math.inf})
            release_commands(pipe, lease)
            await pipe.execute()

    async def renew(self, response_ids: list[str], worker: str, worker_seconds: float) -> None:
        """The heartbeat's share: each running response's new deadline (only where the queue still
        holds it), and the worker's own (it counts as alive `worker_seconds` from now)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            if response_ids:
                pipe.zadd(
                    self.held, dict.fromkeys(response_ids, _ms(time.time() + self.deadline_seconds)), xx=True
                )
            pipe.zadd(self.workers, {worker: _ms(time.time() + worker_seconds)})
            await pipe.execute()

    async def hand_back(self, response_id: str, worker: str) -> bool:
        """Put a response this worker popped and could not start back at the front of the queue
        (if it is still in the worker's taking list); whether it was."""
        return bool(
            await self.redis.eval(_HAND_BACK, 2, taking_key(self.name, worker), self.key, response_id)
        )

    async def leave(self, worker: str) -> None:
        """A worker that stops: what it popped and never leased goes back, and it leaves the queue."""
        await self.redis.eval(_PUT_BACK, 2, taking_key(self.name, worker), self.key)
        await self.redis.zrem(self.workers, worker)

    # The sweep's side ----------------------------------------------------------------------------

    async def overdue(self, limit: int) -> list[str]:
        """Running responses whose holder missed its deadline."""
        found = await self.redis.zrangebyscore(self.held, "-inf", _ms(time.time()), start=0, num=limit)
        return [_decoded(raw) for raw in found]

    async def requeue(self, response_ids: list[str]) -> None:
        """Put abandoned responses back at the front of the queue, as waiting."""
        if not response_ids:
            return
        async with self.redis.pipeline(transaction=True) as pipe:
            for response_id in response_ids:
                pipe.lpush(self.key, response_id)
            pipe.zadd(self.held, dict.fromkeys(response_ids, math.inf))
            await pipe.execute()

    async def extend(self, response_ids: list[str]) -> None:
        """A new deadline for responses found still leased (their holder's heartbeat was late)."""
        if response_ids:
            await self.redis.zadd(
                self.held, dict.fromkeys(response_ids, _ms(time.time() + self.deadline_seconds))
            )

    async def drop(self, response_ids: list[str]) -> None:
        """Responses given up: the queue holds them no more."""
        if response_ids:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zrem(self.held, *response_ids)
                for response_id in response_ids:
                    pipe.delete(queued_key(response_id))
                await pipe.execute()

    async def adopt(self) -> int:
        """Take into the queue responses an earlier release queued as RQ jobs (a rolling upgrade);
        how many there were."""
        keys = (f"rq:queue:{self.name}", self.key, self.held)
        return int(await self.redis.eval(_ADOPT, 3, *keys, self.name, *_QUEUED_KEY_AROUND))

    async def dead_workers(self) -> int:
        """Put back what dead workers had popped and never leased; how many responses that was."""
        dead = await self.redis.zrangebyscore(self.workers, "-inf", _ms(time.time()))
        moved = 0
        for raw in dead:
            worker = _decoded(raw)
            moved += int(await self.redis.eval(_PUT_BACK, 2, taking_key(self.name, worker), self.key))
            await self.redis.zrem(self.workers, worker)
        return moved


async def held_by_a_queue(redis: AsyncRedis, response_ids: list[str]) -> list[bool]:
    """Whether some queue (this deployment's or another's on the same Redis) holds each response."""
    if not response_ids:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for response_id in response_ids:
            pipe.exists(queued_key(response_id))
        return [bool(found) for found in await pipe.execute()]


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _decoded(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


# Redis commands as a pipeline records them: each one's arguments and options.
type Commands = list[tuple[tuple[Any, ...], dict[str, Any]]]


def recorded(connection: SyncRedis, build: Callable[[Pipeline], object]) -> Commands:
    """The commands `build` queues on a pipeline of RQ's client that only records: nothing is sent
    (RQ builds its records on a pipeline it is given). An asyncio client sends them (`send`)."""
    recorder = connection.pipeline()
    recorder.multi()
    try:
        build(recorder)
        return [(tuple(args), dict(options)) for args, options in recorder.command_stack]
    finally:
        recorder.reset()


async def send(redis: AsyncRedis, commands: Commands) -> None:
    """Send recorded commands in one MULTI on an asyncio client."""
    async with redis.pipeline(transaction=True) as pipe:
        for args, options in commands:
            pipe.execute_command(*args, **options)
        await pipe.execute()


def delivery_queue(connection: SyncRedis, name: str) -> Queue:
    """The webhook deliveries' queue (DESIGN.md §12): `<queue>-webhooks`, a job per delivery attempt
    whose id is the delivery's (its event's) id and whose only argument is that id."""
    return Queue(f"{name}-webhooks", connection=connection, serializer=JSONSerializer)


async def enqueue_deliveries(redis: AsyncRedis, queue: Queue, delivery_ids: list[str]) -> None:
    """Queue an attempt of each delivery, in one MULTI on an asyncio client."""
    if not delivery_ids:
        return
    await _know_server_version(redis, queue)

    def build(recorder: Pipeline) -> None:
        for delivery_id in delivery_ids:
            queue.enqueue_call(
                DELIVERY_FUNCTION,
                args=(delivery_id,),
                job_id=delivery_id,
                timeout=JOB_TIMEOUT,
                result_ttl=0,  # the attempt's record is the delivery's row: RQ keeps none of its own
                failure_ttl=RESULT_TTL,
                description=f"webhook {delivery_id}",
                pipeline=recorder,
            )

    await send(redis, recorded(queue.connection, build))


async def _know_server_version(redis: AsyncRedis, queue: Queue) -> None:
    """RQ asks the server's version once per process before it builds commands: ask it here, on
    the asyncio client."""
    if queue.redis_server_version is None:
        info = await redis.info("server")
        queue.redis_server_version = parse_server_version(info["redis_version"])


def parse_server_version(version: str) -> tuple[int, int, int]:
    """`INFO server`'s `redis_version` as RQ keeps it (`Queue.redis_server_version`)."""
    parts = [int(part) for part in str(version).split(".")[:3]]
    return (*parts, 0, 0, 0)[:3]  # type: ignore[return-value]


def job_statuses(queue: Queue, job_ids: list[str]) -> dict[str, JobStatus | None]:
    """Each job's status as RQ has it; None where RQ holds no job (expired, or lost).

    Only each job hash's `status` field is read (one pipelined HGET each): RQ's `fetch_many` reads
    and decodes whole jobs, and raises for the whole batch on any hash it cannot read (one holding
    only a stray `last_heartbeat`, say), which would stop every later sweep at the same job.
    """
    with queue.connection.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hget(Job.key_for(job_id), "status")
        raw = pipe.execute()
    return {job_id: _status(value) for job_id, value in zip(job_ids, raw, strict=True)}


def _status(raw: bytes | None) -> JobStatus | None:
    if not raw:
        return None
    try:
        return JobStatus(raw.decode())
    except ValueError:  # a status this RQ does not know: held by nobody it can see
        return None
