"""The queue contract between the API and the workers: RQ jobs whose id is the response id.

A job's only argument is the response id: the request, the conversation and every secret stay
out of Redis (DESIGN.md §8). RQ is synchronous: the API sends the enqueue's commands (which RQ
builds) on its asyncio client, and calls the other functions here in a thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis import Redis as SyncRedis
from redis.asyncio import Redis as AsyncRedis
from redis.client import Pipeline
from rq import Queue, Retry
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from worker.events.stream import Event, add_events
from worker.keys import secrets_key

# The job function, as RQ records it in every job: the runner package's own name for it, which a
# worker of an earlier release (during a rolling upgrade) and of a later one both resolve.
JOB_FUNCTION = "worker.runner.run_job"
# A response may stream for a long time; the lease, not RQ's job timeout, bounds a dead worker.
# A delivery attempt's job function, as RQ records it (respool's worker runs it itself).
DELIVERY_FUNCTION = "worker.runner.deliver_job"
JOB_TIMEOUT = -1
RESULT_TTL = 600


# Redis commands as a pipeline records them: each one's arguments and options.
type Commands = list[tuple[tuple[Any, ...], dict[str, Any]]]


def response_queue(connection: SyncRedis, name: str) -> Queue:
    return Queue(name, connection=connection, serializer=JSONSerializer)


def enqueue_commands(
    queue: Queue, response_id: str, first_events: list[Event], max_attempts: int
) -> Commands:
    """The commands that append the response's first events and enqueue its job, for an asyncio
    client to send in one MULTI (DESIGN.md §2.1).

    RQ itself builds them, on a pipeline that only records (so the job's format stays RQ's own);
    nothing is sent. It needs `queue.redis_server_version` set, or it asks the server for it first.
    A job whose worker dies is retried by RQ's maintenance, up to `max_attempts` runs in all
    (DESIGN.md §4, "Orphans"); the next attempt decides whether it may generate again.
    """

    def build(recorder: Pipeline) -> None:
        add_events(recorder, response_id, first_events)
        queue.enqueue_call(
            JOB_FUNCTION,
            args=(response_id,),
            job_id=response_id,
            timeout=JOB_TIMEOUT,
            result_ttl=RESULT_TTL,
            failure_ttl=RESULT_TTL,
            retry=Retry(max=max_attempts - 1) if max_attempts > 1 else None,
            description=f"response {response_id}",
            pipeline=recorder,
        )

    return recorded(queue.connection, build)


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


async def enqueue(
    redis: AsyncRedis,
    queue: Queue,
    response_id: str,
    first_events: list[Event],
    max_attempts: int,
    secrets: tuple[bytes, int] | None = None,
) -> None:
    """Append the response's first events and enqueue its job, in one MULTI on an asyncio client;
    with `secrets` (its tools' secrets, and how many seconds to keep them), those too."""
    await _know_server_version(redis, queue)
    commands = enqueue_commands(queue, response_id, first_events, max_attempts)
    if secrets is not None:
        commands.insert(0, (("SET", secrets_key(response_id), secrets[0], "EX", secrets[1]), {}))
    await send(redis, commands)


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


def remove_queued(queue: Queue, response_id: str) -> bool:
    """Take a job that no worker has picked up out of the queue; False if a worker already has it."""
    if queue.remove(response_id) == 0:
        return False
    job = Job.fetch(response_id, connection=queue.connection, serializer=JSONSerializer)
    with queue.connection.pipeline() as pipe:
        job.set_status(JobStatus.CANCELED, pipeline=pipe)
        queue.canceled_job_registry.add(job, pipeline=pipe)
        pipe.execute()
    return True


def delete_job(queue: Queue, response_id: str) -> None:
    """Remove a finished response's job record, if RQ still has one."""
    try:
        Job.fetch(response_id, connection=queue.connection, serializer=JSONSerializer).delete()
    except NoSuchJobError:  # already expired: nothing to delete
        return


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
