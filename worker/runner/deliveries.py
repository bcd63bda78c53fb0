"""Sending webhook deliveries (DESIGN.md §12): one attempt per job of the deliveries' queue, and the
sweep that queues the attempts that are due.

An attempt: the delivery is claimed (a compare-and-set that holds it for the attempt's length, so
no other job tries it meanwhile; nothing if it is no longer pending and due); it waits up to
`BUSY_WAIT_SECONDS` for one of its endpoint's `endpoint_concurrency` slots, in this process and then
across every worker (a leased slot in Redis, worker/slots.py, that lapses with a dead worker), else
it is put off a second (the claim given back, no attempt counted: a slow receiver holds its own
deliveries back, and others' only for that wait); then it is signed with each of the endpoint's
secrets (read from the environment now) and POSTed (connect and read timeouts; no redirects; the
outbound rule, DESIGN.md §13). A 2xx acknowledges it. Anything else is recorded and tried again after the retry policy's backoff (the receiver's
`retry-after` on 429 and 503), until `max_age` after the event, then given up.

The sweep (each worker's maintenance) queues pending deliveries to the endpoints it configures that
are due and have no live job: the retries, and the first attempts whose queuing was lost.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import httpx2
from redis.asyncio import Redis
from rq.job import JobStatus
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.errors import ConfigError, OutboundRefusedError
from worker.ids import new_id
from worker.keys import due_lock_key, webhook_slots_key
from worker.outbound import OutboundPolicy, guard_transport
from worker.postgres import deliveries, store
from worker.postgres.deliveries import Delivery
from worker.protocol.webhooks import Endpoint, RetryPolicy, check_secrets, headers
from worker.runner.metrics import WorkerMetrics
from worker.runner.upstream import retry_after
from worker.settings import Settings
from worker.slots import TAKE
from worker.webhooks import Notifier

log = logging.getLogger("respool.webhooks")

BUSY_WAIT_SECONDS = 2.0  # how long a delivery waits for its endpoint's slot
BUSY_SECONDS = 1.0  # how long it is then put off
BUSY_POLL_SECONDS = 0.05  # how often a slot held by another worker is asked for again
SWEEP_BATCH = 500
# A delivery recorded with a response's end is queued by whoever recorded it, right after its commit
# (`Notifier.send`); the sweep queues only those recorded at least this long ago (the send failed,
# or its process died between the two). Sooner, the sweep of another worker, finding no job for one
# whose send was under way, queued it a second time: two jobs of one id, the second of which found
# the first's record gone at its end (seen with two workers, a few times a run of the bench's
# webhooks scenario; the delivery itself went once, its claim being atomic).
SEND_SETTLE_SECONDS = 5.0
_HELD = frozenset({JobStatus.QUEUED, JobStatus.STARTED, JobStatus.SCHEDULED, JobStatus.DEFERRED})


class Deliverer:
    """One per worker process: the attempts it runs, and the client they go out on."""

    def __init__(
        self,
        settings: Settings,
        engine: AsyncEngine,
        redis: Redis,
        notifier: Notifier,
        policy: OutboundPolicy,
        metrics: WorkerMetrics,
    ) -> None:
        self.autocommit = store.single_statements(engine)  # every statement here is one transaction
        self.redis = redis
        self.queue = settings.queue
        self._take = redis.register_script(TAKE)
        self.notifier = notifier
        self.endpoints: dict[str, Endpoint] = {endpoint.name: endpoint for endpoint in notifier.endpoints}
        for endpoint in self.endpoints.values():  # a worker that cannot sign or send says so at start
            try:
                check_secrets(os.environ.get(endpoint.secret_env, ""), endpoint.secret_env)
                policy.check_url(endpoint.url)  # a name is checked as it resolves, at each attempt
            except ValueError as exc:
                raise ConfigError(f"webhook endpoint '{endpoint.name}': {exc}") from exc
            except OutboundRefusedError as exc:
                raise ConfigError(f"webhook endpoint '{endpoint.name}': {exc.message}") from exc
        self.metrics = metrics
        self.retry = RetryPolicy(
            settings.webhook_backoff_seconds,
            settings.webhook_backoff_max_seconds,
            settings.webhook_max_age_seconds,
        )
        self.endpoint_concurrency = settings.webhook_endpoint_concurrency
        self.timeout = settings.webhook_timeout_seconds
        # An attempt's whole length, at most (httpx's timeouts bound each phase, not their sum), and
        # how long a claim holds the delivery: past it, an attempt whose worker died is retried.
        self.attempt_seconds = settings.webhook_connect_seconds + 2 * settings.webhook_timeout_seconds
        self.hold_seconds = self.attempt_seconds + 5
        self.hold_ms = int(self.hold_seconds * 1000)  # an endpoint slot's lease, as long
        self.slots: dict[str, asyncio.Semaphore] = {}  # attempts that may run at once here, by endpoint
        transport = guard_transport(httpx2.AsyncHTTPTransport(trust_env=False), policy)
        timeout = httpx2.Timeout(settings.webhook_timeout_seconds, connect=settings.webhook_connect_seconds)
        self.http = httpx2.AsyncClient(transport=transport, timeout=timeout, follow_redirects=False)

    async def close(self) -> None:
        await self.http.aclose()

    async def deliver(self, delivery_id: str) -> None:
        """One attempt of the delivery (module docstring)."""
        async with self.autocommit.connect() as conn:
            delivery = await deliveries.claim(conn, delivery_id, self.hold_seconds)
        if delivery is None:
            return  # delivered, given up, not due yet, or another attempt holds it
        if delivery.endpoint not in self.endpoints:  # a deployment that shares the database
            log.warning("webhook %s: endpoint %s is not configured here", delivery_id, delivery.endpoint)
            await self._release(delivery, 0.0)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BUSY_WAIT_SECONDS
        slots = self.slots.setdefault(delivery.endpoint, asyncio.Semaphore(self.endpoint_concurrency))
        try:
            await asyncio.wait_for(slots.acquire(), BUSY_WAIT_SECONDS)
        except TimeoutError:  # its endpoint is slow: try later, and let other endpoints' go first
            await self._release(delivery, BUSY_SECONDS)
            return
        try:
            key = webhook_slots_key(self.queue, delivery.endpoint)
            token = new_id("slot")
            while not await self._take(keys=[key], args=[token, self.endpoint_concurrency, self.hold_ms]):
                if loop.time() >= deadline:  # other workers hold them all
                    await self._release(delivery, BUSY_SECONDS)
                    return
                await asyncio.sleep(BUSY_POLL_SECONDS)
            try:
                await self._attempt(delivery)
            finally:
                await self.redis.zrem(key, token)
        finally:
            slots.release()

    async def _release(self, delivery: Delivery, seconds: float) -> None:
        async with self.autocommit.connect() as conn:
            await deliveries.release(conn, delivery, seconds)

    async def _attempt(self, delivery: Delivery) -> None:
        started = time.monotonic()
        code, error, hinted = await self._post(delivery)
        duration_ms = int((time.monotonic() - started) * 1000)
        retry_in = None
        if error is not None:
            self.metrics.webhook_failures.inc()
            wait = self.retry.backoff(delivery.attempts, hinted)
            age = (datetime.now(tz=UTC) - delivery.created_at).total_seconds()
            retry_in = wait if age + wait <= self.retry.max_age_seconds else None
        async with self.autocommit.connect() as conn:
            status = await deliveries.finish_attempt(
                conn, delivery, status_code=code, error=error, duration_ms=duration_ms, retry_in=retry_in
            )
        if status == "delivered":
            self.metrics.webhooks_sent.inc()
            latency = (datetime.now(tz=UTC) - delivery.created_at).total_seconds()
            self.metrics.webhook_latency.observe(max(latency, 0.0))
        elif status == "given_up":
            self.metrics.webhooks_given_up.inc()
            log.warning(
                "webhook %s (%s) to endpoint %s given up after %d attempts: %s",
                delivery.id, delivery.event_type, delivery.endpoint, delivery.attempts, error,
            )  # fmt: skip
        else:
            log.info(
                "webhook %s to endpoint %s: attempt %d failed (%s); next in %.1f s",
                delivery.id, delivery.endpoint, delivery.attempts, error, retry_in or 0.0,
            )  # fmt: skip

    async def _post(self, delivery: Delivery) -> tuple[int | None, str | None, float | None]:
        """The receiver's status code, the error (None when it acknowledged) and its retry-after."""
        endpoint = self.endpoints.get(delivery.endpoint)
        if endpoint is None:
            return None, f"endpoint '{delivery.endpoint}' is no longer configured", None
        try:
            secrets = check_secrets(os.environ.get(endpoint.secret_env, ""), endpoint.secret_env)
        except ValueError as exc:
            return None, str(exc), None
        sent = headers(delivery.id, delivery.body, secrets)
        try:
            async with asyncio.timeout(self.attempt_seconds):
                reply = await self.http.post(delivery.url, content=delivery.body.encode(), headers=sent)
        except (httpx2.TimeoutException, TimeoutError):
            return None, f"no answer within {self.timeout:g} s", None
        except (httpx2.HTTPError, OutboundRefusedError) as exc:
            cause = exc.__cause__ if isinstance(exc.__cause__, OutboundRefusedError) else exc
            reason = (
                cause.message if isinstance(cause, OutboundRefusedError) else f"{type(exc).__name__}: {exc}"
            )
            return None, f"could not reach the endpoint: {reason}", None
        if 200 <= reply.status_code < 300:
            return reply.status_code, None, None
        wait = retry_after(reply.headers) if reply.status_code in (429, 503) else None
        return reply.status_code, f"the endpoint answered {reply.status_code}", wait


async def queue_due(
    engine: AsyncEngine,
    notifier: Notifier,
    statuses: Callable[[Sequence[str]], dict[str, JobStatus | None]],
    max_age_seconds: float | None,
    settled_seconds: float = SEND_SETTLE_SECONDS,
    *,
    holder: str | None = None,
    lock_ms: int = 0,
) -> int:
    """Queue an attempt of every pending delivery to an endpoint this process configures that is
    due and has no live job (one never tried, if it was recorded `settled_seconds` ago or more: its
    recorder queues it itself); give up those past `max_age_seconds` (if given) that nobody sends.
    How many were queued. `engine` runs each statement as its own transaction (store.single_statements).

    With a `holder`, only if it takes the lock of the workers that configure the same endpoints for
    `lock_ms` (a sweep's period): two workers' sweeps at once would each find a due delivery without
    a job, and each queue it."""
    names = [endpoint.name for endpoint in notifier.endpoints]
    if max_age_seconds is None and not names:
        return 0
    if holder is not None:
        key = due_lock_key(notifier.queue.name, names)
        if not await notifier.redis.set(key, holder, nx=True, px=lock_ms):
            return 0
    async with engine.connect() as conn:
        if max_age_seconds is not None and await deliveries.give_up_expired(conn, max_age_seconds):
            log.warning(
                "webhook deliveries past RESPOOL_WEBHOOK_MAX_AGE_SECONDS that nobody sent were given up"
            )
        due = await deliveries.due(conn, names, SWEEP_BATCH, settled_seconds) if names else []
    if not due:
        return 0
    held = await asyncio.to_thread(statuses, due)
    lost = [delivery_id for delivery_id in due if held.get(delivery_id) not in _HELD]
    await notifier.send(lost)
    return len(lost)
