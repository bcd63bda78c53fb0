"""The worker process (DESIGN.md §7): an asyncio multi-execution worker.

Responses come from respool's own queue (worker/queue.py), taken by a task on an event loop in a
second thread whenever one of the process's slots is free, each run as a coroutine on that loop:
one process holds hundreds of responses and never forks per job. Webhook deliveries are RQ jobs
on a queue of their own: RQ's work loop runs on the main thread over that queue (so its signal
handling, registration, maintenance and registries are RQ's), handing each delivery to the same
loop, with slots of their own. The loop also runs the heartbeat (every lease, every running
response's deadline, every RQ execution) and the cancel watcher.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

import uvloop
from redis import Redis as SyncRedis
from redis.exceptions import RedisError
from rq.exceptions import StopRequested
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.utils import now
from rq.worker import BaseWorker

from worker import logs
from worker.connections import blocking_client, sync_client
from worker.heap import freeze_startup_heap
from worker.keys import cancel_key, registries_lock_key
from worker.outages import is_outage, is_redis_outage, patiently
from worker.queue import Started, delivery_queue, job_statuses
from worker.runner.attempt import run_response
from worker.runner.deliveries import Deliverer, queue_due
from worker.runner.recovery import rare_seconds, retention_seconds, sweep
from worker.runner.runtime import RunEnd, Runtime, close_runtime, open_runtime
from worker.settings import Settings

log = logging.getLogger("respool.worker")

_BEAT_SECONDS = 1.0
# RQ's own maintenance (expired registry entries, dead workers' records) at RQ's own pace: what must
# come sooner, abandoned deliveries, the sweep does every maintenance period (`_clean_registries`).
_RQ_MAINTENANCE_SECONDS = 600
# An idle pop waits this long: a push wakes it at once, and nothing else waits on it (the periodic
# work has timers of its own), so an idle worker wakes seldom.
_POP_SECONDS = 15


@dataclass
class _Running:
    job: Job
    queue: Queue
    execution: Execution
    future: Future[None]


class ResponseWorker(BaseWorker):
    """Runs up to `concurrency` responses at once on one event loop, and webhook deliveries beside
    them, keeping RQ's registries of the deliveries true."""

    def __init__(self, settings: Settings, connection: SyncRedis, concurrency: int) -> None:
        self._deliveries = delivery_queue(connection, settings.queue)
        super().__init__(
            [self._deliveries],
            connection=connection,
            serializer=JSONSerializer,
            worker_ttl=max(30, settings.registry_seconds * 3),
            job_monitoring_interval=settings.registry_seconds,
        )
        self.maintenance_interval = _RQ_MAINTENANCE_SECONDS
        # RQ's reconnect backoff grows to a minute by default: after an outage, resume sooner.
        self.max_connection_wait_time = float(max(5, settings.maintenance_seconds * 2))
        self._settings = settings
        self._last_beat = self._last_suspension_check = self._retention_at = self._rare_at = -math.inf
        # Webhook deliveries have slots of their own: slow receivers never take a response's.
        self._delivery_slots = threading.Semaphore(settings.webhook_concurrency)
        self._response_slots = asyncio.Semaphore(concurrency)
        self._responses: dict[asyncio.Task[None], str] = {}  # every response this process runs
        # How long a worker that stopped beating counts as alive: what it had popped goes back after.
        self._alive_seconds = float(max(30, settings.registry_seconds * 3))
        self._running: dict[str, _Running] = {}
        # Held while a job's end is recorded and while the executions' heartbeat is sent: a
        # heartbeat that took a job as running must not land after its end (see `_ended`).
        self._records = threading.Lock()
        self._loop = uvloop.new_event_loop()  # libuv's loop: a third of asyncio's cost per I/O callback
        self._thread = threading.Thread(target=self._loop.run_forever, name="responses", daemon=True)
        self._thread.start()
        self._runtime: Runtime = self._call(open_runtime(settings, self.name, concurrency))
        rt = self._runtime
        self._deliverer = Deliverer(settings, rt.engine, rt.redis, rt.notifier, rt.outbound, rt.metrics)
        if settings.worker_metrics_port:
            self._runtime.metrics.serve(settings.worker_metrics_port)
        self._closing = threading.Event()
        # The queue's blocking pops wait on a connection of their own.
        self._popper = blocking_client(
            settings.redis_url, self.dequeue_timeout, settings.redis_timeout_seconds
        )
        self._taker = self._submit(self._take_responses())
        self._background = [
            self._submit(self._every(settings.heartbeat_seconds, self._heartbeat)),
            # Only while responses run: an idle worker's event loop woke four times a second for
            # it, about a third of the CPU an idle worker costs.
            self._submit(self._every(settings.cancel_poll_seconds, self._watch_cancels, while_running=True)),
            self._submit(self._every(settings.maintenance_seconds, self._sweep)),
        ]

    # RQ's hooks ----------------------------------------------------------------------------

    @property
    def dequeue_timeout(self) -> int:
        return _POP_SECONDS

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        """The StartedJobRegistry entry outlives a missed heartbeat or two, not minutes (DESIGN.md §4)."""
        return self._settings.registry_seconds

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> tuple[Job, Queue] | None:
        """Take a job only when a slot is free: a job popped without one would wait unseen.

        While Redis is unreachable, wait for it: RQ's own loop would quit on the error.
        """
        while True:
            self._wait_for_slot()
            try:
                result: tuple[Job, Queue] | None = super().dequeue_job_and_maintain_ttl(
                    timeout, max_idle_time
                )
            except BaseException as exc:
                self._delivery_slots.release()
                if not is_redis_outage(exc):
                    raise
                self._wait_for_redis(exc)
                continue
            if result is None:
                self._delivery_slots.release()
            return result

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        if pipeline is not None:  # queued on someone's pipeline: its execute() meets any error
            super().heartbeat(timeout, pipeline=pipeline)
            return
        # RQ's loop beats before and after every dequeue and after every job, three round trips
        # each: at hundreds of jobs a second, once a second says as much (the key lives 30 s+).
        if time.monotonic() - self._last_beat < _BEAT_SECONDS and timeout is None:
            return
        self._last_beat = time.monotonic()
        try:
            super().heartbeat(timeout)
        except RedisError as exc:
            if not is_redis_outage(exc):
                raise
            log.warning("worker heartbeat failed (%s); carrying on", exc)

    def run_maintenance_tasks(self) -> None:
        try:
            super().run_maintenance_tasks()  # type: ignore[no-untyped-call]
        except RedisError as exc:
            if not is_redis_outage(exc):
                raise
            log.warning("maintenance skipped: Redis is unreachable (%s)", exc)

    def set_state(self, state: str, pipeline: Any = None) -> None:
        """Write the state only when it changes (RQ rewrites it at every dequeue)."""
        if pipeline is None and state == self.get_state():
            return
        super().set_state(state, pipeline)

    def check_for_suspension(self, burst: bool) -> None:
        # `rq suspend` is noticed within a second, not re-read before every job.
        if time.monotonic() - self._last_suspension_check < _BEAT_SECONDS:
            return
        self._last_suspension_check = time.monotonic()
        try:
            super().check_for_suspension(burst)
        except RedisError as exc:
            if not is_redis_outage(exc):
                raise
            self._wait_for_redis(exc)

    def _wait_for_redis(self, exc: BaseException) -> None:
        log.warning("Redis is unreachable (%s); waiting for it", exc)
        time.sleep(self._settings.maintenance_seconds)
        if self._stop_requested:
            raise StopRequested()

    def execute_job(self, job: Job, queue: Queue) -> None:
        """Record the job as started, start its response on the event loop, and return at once.

        The records are those RQ's `prepare_execution` and `prepare_job_execution` write (the
        execution in the StartedJobRegistry, the job's status and heartbeat, the job out of the
        intermediate queue), sent in one round trip where RQ sends three: this worker runs many
        jobs at once, so it never flips its own state to busy and back for one.
        """
        self._start(job, queue)

    def _start(self, job: Job, queue: Queue) -> None:
        ttl = self.get_heartbeat_ttl(job)
        with self.connection.pipeline() as pipe:
            execution = Execution.create(job, ttl, pipeline=pipe, worker_name=self.name)
            self.executions[execution.id] = execution
            self.heartbeat(ttl, pipeline=pipe)
            job.heartbeat(now(), ttl, pipeline=pipe)
            job.prepare_for_execution(self.name, pipeline=pipe)
            pipe.persist(job.key)
            pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            pipe.execute()
        future = self._submit(self._perform(job, queue, execution))
        self._running[job.id] = _Running(job, queue, execution, future)

    def _install_signal_handlers(self) -> None:
        super()._install_signal_handlers()  # type: ignore[no-untyped-call]
        freeze_startup_heap()  # started: what is alive now lives as long as the process
        # From here on SIGTERM drains instead of killing: say so (tests and operators wait for it).
        log.info("worker %s ready: taking responses (SIGTERM drains)", self.name)

    def teardown(self) -> None:
        """Stop taking, let running responses finish (up to the drain deadline), then close the loop."""
        self._closing.set()  # nothing is taken from here on
        self._taker.cancel()
        self._drain(self._settings.drain_seconds)
        for task in self._background:
            task.cancel()
        try:
            # What a pop cut short by the stop left in this worker's taking list goes back.
            self._call(self._runtime.queue.leave(self.name))
        except Exception as exc:
            log.warning("could not hand back what this worker was taking (%s): the sweep will", exc)
        self._call(self._popper.aclose())
        self._call(self._deliverer.close())
        self._call(close_runtime(self._runtime))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        super().teardown()  # type: ignore[no-untyped-call]

    # Internals -----------------------------------------------------------------------------

    def _wait_for_slot(self) -> None:
        while not self._delivery_slots.acquire(timeout=1.0):
            self.heartbeat()
            if self._stop_requested:
                raise StopRequested()

    async def _take_responses(self) -> None:
        """Take a response from the queue whenever a slot is free, and run it, until the worker stops."""
        queue = self._runtime.queue
        # Known to the queue before taking anything: what a dead worker had taken goes back only
        # once the queue knows of the worker.
        await patiently(partial(queue.renew, [], self.name, self._alive_seconds), math.inf)
        await patiently(queue.load_scripts, math.inf)
        while not self._closing.is_set():
            await self._response_slots.acquire()
            try:
                taken = await queue.take_started(
                    self._popper, self._runtime.leases, self.name, self.dequeue_timeout
                )
            except Exception as exc:
                self._response_slots.release()
                if is_outage(exc):
                    log.warning("the response queue is unreachable (%s); waiting for it", type(exc).__name__)
                else:
                    log.exception("taking from the response queue failed; retrying")
                await asyncio.sleep(self._settings.maintenance_seconds)
                continue
            if taken is None:
                self._response_slots.release()
                continue
            response_id, started = taken
            task = self._loop.create_task(self._run(response_id, started))
            self._responses[task] = response_id
            task.add_done_callback(self._responses.pop)

    async def _run(self, response_id: str, started: Started | None) -> None:
        try:
            await run_response(self._runtime, response_id, started)
        except Exception:
            log.exception("response %s: its run failed", response_id)
            # One that could not even start (Redis unreachable past the wait) is still in this
            # worker's taking list: back to the queue with it, or the sweep would never see it.
            try:
                await patiently(
                    partial(self._runtime.queue.hand_back, response_id, self.name),
                    self._settings.database_wait_seconds,
                )
            except Exception:
                log.exception("response %s: could not put it back in the queue", response_id)
        finally:
            self._response_slots.release()

    async def _perform(self, job: Job, queue: Queue, execution: Execution) -> None:
        """Run a webhook delivery (an RQ job), and record its end with RQ."""
        try:
            await self._deliverer.deliver(job.id)
        except BaseException:
            exc_info = sys.exc_info()
            log.exception("delivery %s: the job failed", job.id)
            await asyncio.to_thread(self._ended, job, self._finalize_failure, job, queue, execution, exc_info)
        else:
            try:
                await asyncio.to_thread(self._ended, job, self._finish, job, execution)
            except Exception:
                log.exception("delivery %s: recording its end with RQ failed", job.id)
        finally:
            self._running.pop(job.id, None)
            self._delivery_slots.release()

    def _ended(self, job: Job, record: Callable[..., None], *args: Any) -> None:
        """Write a job's end with `record` and take it out of those running, while no executions'
        heartbeat is under way: one that took the job as running before it ended would write the
        job's `last_heartbeat` after its end, and a delivery's job hash, deleted at its end, would
        come back as a hash of that one field, which RQ cannot read."""
        with self._records:
            try:
                record(*args)
            finally:
                self._running.pop(job.id, None)

    def _finish(self, job: Job, execution: Execution) -> None:
        """RQ's records of a job that ran to its end, in one round trip: those RQ's
        `handle_job_success` writes (the job finished, its result, the finished registry, the
        execution gone, the worker's counts), without what it adds for features respool's jobs do
        not use (dependents under WATCH, repeats, callbacks, rate limits) and the heartbeat it
        writes first: one round trip where RQ's took four."""
        job.ended_at = now()
        job._status = JobStatus.FINISHED
        result_ttl = job.get_result_ttl(self.default_result_ttl)
        with self.connection.pipeline() as pipe:
            self.increment_successful_job_count(pipeline=pipe)
            self.increment_total_working_time(job.ended_at - (job.started_at or job.ended_at), pipe)
            if result_ttl != 0:
                job._handle_success(
                    result_ttl,
                    pipeline=pipe,
                    worker_name=self.name,
                    execution_id=execution.id,
                    execution_started_at=execution.created_at,
                    execution_ended_at=job.ended_at,
                )
            job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
            self.cleanup_execution(job, pipeline=pipe, execution=execution)
            pipe.execute()

    async def _every(self, seconds: float, action: Any, *, while_running: bool = False) -> None:
        while True:
            if while_running:
                await self._runtime.until_running()
            await asyncio.sleep(seconds)
            try:
                await action()
            except Exception as exc:
                if is_redis_outage(exc):
                    self._runtime.outages.met()
                if is_outage(exc):  # say it in one line
                    log.warning("periodic %s skipped: %s", action.__name__, type(exc).__name__)
                else:
                    log.exception("periodic %s failed; retrying", action.__name__)

    async def _heartbeat(self) -> None:
        """Renew every lease, every running response's deadline, the worker's own, and every RQ
        execution of a delivery (DESIGN.md §4).

        A lease found lost (this worker was frozen past its TTL, and the response may run elsewhere
        now) stops its attempt at once, and its deadline is no longer renewed.
        """
        held = self._runtime.held
        lost, retaken = await self._runtime.leases.renew(
            list(held.values()), reclaim=self._runtime.recovering()
        )
        # A response that ended while the renewal was under way gave its lease back: not lost, and
        # not to be held again.
        lost = [lease for lease in lost if held.get(lease.response_id) is lease]
        for lease in retaken:
            if held.get(lease.response_id) is not lease:
                await self._runtime.leases.release(lease)
        for lease in lost:
            log.warning("response %s: lease lost (attempt %d); stopping it", lease.response_id, lease.attempt)
            self._runtime.interrupt(lease.response_id, RunEnd.FENCED)
        fenced = {lease.response_id for lease in lost} | set(self._runtime.interrupted)
        kept = [response_id for response_id in held if response_id not in fenced]
        await self._runtime.queue.renew(kept, self.name, self._alive_seconds)
        if self._running:  # deliveries under way (RQ's loop beats the worker's own key)
            await asyncio.to_thread(self._heartbeat_executions)

    def _heartbeat_executions(self) -> None:
        ttl = self._settings.registry_seconds
        with self._records, self.connection.pipeline() as pipe:
            self.heartbeat(pipeline=pipe)
            for running in list(self._running.values()):
                running.execution.heartbeat(running.job.started_job_registry, ttl, pipeline=pipe)
                running.job.heartbeat(now(), ttl, pipeline=pipe, xx=True)
            pipe.execute()

    async def _sweep(self) -> None:
        """Put back what dead workers held, queue the webhook deliveries that are due, and, less
        often, what only a rarer failure leaves (orphans of a Redis that lost data, deliveries
        abandoned by a dead worker or past their age) and what is past retention
        (worker/runner/recovery.py)."""
        now = time.monotonic()
        due, rare = now >= self._retention_at, now >= self._rare_at
        if await sweep(self._runtime, self._settings, retention=due, orphans=rare) is not None:
            if due:
                self._retention_at = now + retention_seconds(self._settings)
            if rare:
                self._rare_at = now + rare_seconds(self._settings)
        lock_ms = int(self._settings.maintenance_seconds * 1000)
        if rare and await self._runtime.redis.set(
            registries_lock_key(self._settings.queue), self.name, nx=True, px=lock_ms
        ):
            await asyncio.to_thread(self._clean_registries)
        await queue_due(
            self._runtime.autocommit,
            self._runtime.notifier,
            self._delivery_statuses,
            self._settings.webhook_max_age_seconds if rare else None,
            holder=self.name,
            lock_ms=lock_ms,
        )

    def _clean_registries(self) -> None:
        """RQ's handling of abandoned delivery jobs (those whose worker died: retried, or failed when
        no retry is left), under a lock of respool's that lapses with the maintenance period. RQ's
        own runs under a lock that lives 15 minutes, which a worker killed while holding it leaves
        behind: no delivery of its queue would be taken over meanwhile."""
        queue = self._deliveries
        queue.started_job_registry.cleanup(exception_handlers=self._exc_handlers)
        queue.intermediate_queue.cleanup(self, queue)

    def _delivery_statuses(self, delivery_ids: Sequence[str]) -> dict[str, JobStatus | None]:
        return job_statuses(self._deliveries, list(delivery_ids))

    async def _watch_cancels(self) -> None:
        """Interrupt responses whose cancel flag is set, even while their upstream is silent."""
        response_ids = list(self._runtime.running)
        if not response_ids:
            return
        async with self._runtime.redis.pipeline(transaction=False) as pipe:
            for response_id in response_ids:
                pipe.exists(cancel_key(response_id))
            flags = await pipe.execute()
        for response_id, flagged in zip(response_ids, flags, strict=True):
            if flagged:
                self._runtime.request_cancel(response_id)

    def _drain(self, seconds: float) -> None:
        """Let running responses and deliveries finish for up to `seconds`, then stop the responses
        left and put them back at the front of the queue, their leases released (DESIGN.md §4,
        "Graceful stop")."""
        deadline = time.monotonic() + seconds
        deliveries = [running.future for running in list(self._running.values())]
        if deliveries or self._responses:
            log.info(
                "draining %d running responses and %d deliveries (up to %.0f s)",
                len(self._responses), len(deliveries), seconds,
            )  # fmt: skip
            self._call(self._settle(seconds))
            concurrent.futures.wait(deliveries, timeout=max(0.0, deadline - time.monotonic()))
        if not self._responses:
            return
        log.info("stopping %d responses still running; they go back to the queue", len(self._responses))
        self._call(self._stop_responses())

    async def _settle(self, seconds: float) -> None:
        if self._responses:
            await asyncio.wait(list(self._responses), timeout=seconds)

    async def _stop_responses(self) -> None:
        """Stop every response still running (each goes back to the queue) and wait for them, up to
        10 s; one still taking its lease is cancelled (past its deadline the sweep puts it back)."""
        for task, response_id in list(self._responses.items()):
            if response_id in self._runtime.running:
                self._runtime.interrupt(response_id, RunEnd.STOPPED)
            else:
                task.cancel()
        if self._responses:
            await asyncio.wait(list(self._responses), timeout=10)

    def _submit(self, coroutine: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def _call(self, coroutine: Any) -> Any:
        return self._submit(coroutine).result()


def run_worker(settings: Settings, concurrency: int) -> None:
    """`respool worker`: run until SIGINT/SIGTERM."""
    # RQ's loop (this thread) waits for the GIL after each Redis reply while the responses' event
    # loop runs; the default 5 ms switch interval would add up to 5 ms to each of its round trips.
    sys.setswitchinterval(0.0005)
    connection = sync_client(settings.redis_url)
    # RQ's own lines (registry cleaning every few seconds, three a job) only from `debug` on.
    ResponseWorker(settings, connection, concurrency).work(
        logging_level=logs.chatty_level(settings.log_level)
    )
