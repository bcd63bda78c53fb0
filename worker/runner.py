"""Running one response (DESIGN.md §2, steps 2 and 3): lease, mark in progress, call the upstream,
translate, append every event fenced, record the final Response, then append the terminal event.

Postgres is the authority: the terminal event follows the commit, and a cancel recorded there wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from typing import Any

import httpx2
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError as RedisResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy.ext.asyncio import AsyncEngine

from worker import logs, store
from worker.errors import RespoolError
from worker.events import (
    AppendResult,
    Event,
    EventLog,
    connect,
    encode,
    expire_response,
    last_event,
    read_events,
)
from worker.lease import Lease, Leases
from worker.metrics import WorkerMetrics
from worker.response import TERMINAL, Status, failed, finished
from worker.routing import Route, Routes, UpstreamApi, load_routes
from worker.settings import Settings
from worker.synthetic import synthetic_chunks
from worker.translation import chat_request, chat_stream, coalesce, native, output
from worker.upstream import RetryPolicy, UpstreamError, create_client, redact, stream_json

log = logging.getLogger("respool.runner")

# Events after which no output has reached a client yet: a new attempt may still generate.
_BEFORE_OUTPUT = frozenset({"response.created", "response.queued", "response.in_progress"})
WORKER_LOST = (
    "The worker running this response stopped after it had started streaming output; running it "
    "again would repeat that output, so it was ended here. Retry the request."
)


class CancelRequested(Exception):
    """A cancel was requested for the response this attempt is running."""


class FencedOut(Exception):
    """Another attempt holds the response now: this one must write nothing more."""


class UpstreamFailed(Exception):
    """The upstream failed after output had started: `output` is what was streamed, ended `incomplete`."""

    def __init__(self, message: str, output_: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.output = output_


# What the upstream can do wrong: each ends the response `failed` with its message.
_UPSTREAM_FAULTS = (UpstreamError, native.NativeFailure, RespoolError)


class RunEnd(StrEnum):
    """How `run_response` ended, which decides what the worker tells RQ."""

    FINISHED = "finished"  # the response has its terminal state (now, or from before)
    FENCED = "fenced"  # another attempt holds it now: tell RQ nothing
    BUSY = "busy"  # another live holder kept it past the wait
    STOPPED = "stopped"  # this worker stopped it to shut down: requeue it


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
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    database_wait_seconds: float = 120.0
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    log: EventLog = field(init=False)
    autocommit: AsyncEngine = field(init=False)  # for one-statement work (store.single_statements)
    running: dict[str, asyncio.Task[Any]] = field(default_factory=dict)
    held: dict[str, Lease] = field(default_factory=dict)
    generating: set[str] = field(default_factory=set)  # between the upstream call's start and end
    cancelling: set[str] = field(default_factory=set)
    interrupted: dict[str, RunEnd] = field(default_factory=dict)  # fenced or stopped, by response

    def __post_init__(self) -> None:
        self.log = EventLog(self.redis, on_append=self.metrics.events.inc)
        self.autocommit = store.single_statements(self.engine)
        self.metrics.in_flight.set_function(lambda: len(self.running))

    def request_cancel(self, response_id: str) -> None:
        """Interrupt the response's upstream call (the cancel watcher saw its flag).

        Outside the upstream call the flag is seen at the next append, or the final commit loses
        to the cancel recorded in Postgres, so only a generating task is interrupted.
        """
        task = self.running.get(response_id)
        if task is not None and response_id in self.generating and response_id not in self.cancelling:
            self.cancelling.add(response_id)
            task.cancel()

    def interrupt(self, response_id: str, end: RunEnd) -> None:
        """Stop the response's attempt at once: its lease was lost (FENCED), or the worker stops (STOPPED)."""
        task = self.running.get(response_id)
        if task is not None and response_id not in self.interrupted:
            self.interrupted[response_id] = end
            task.cancel()


class ResponseWriter:
    """Numbers one attempt's events and appends them under its lease.

    An append that meets an unreachable Redis is retried for up to `patience` seconds (the lease's
    time to live: past it the lease is gone and the append would be fenced anyway).

    `send` does not wait: events sent while an append is in flight go together in the next one,
    their deltas merged (DESIGN.md §7, natural batching), so a fast upstream costs a round trip
    per batch, not per chunk. `drain` waits for all of them; a failed append is raised by the next `send` or `drain`.
    """

    def __init__(self, log_: EventLog, lease: Lease, next_sequence: int, patience: float = 0.0) -> None:
        self._log = log_
        self.lease = lease
        self.next_sequence = next_sequence
        self.patience = patience
        self.started_at = time.monotonic()
        self.first_output_at: float | None = None
        self._pending: list[dict[str, Any]] = []
        self._flushing: asyncio.Task[None] | None = None

    def send(self, events: list[dict[str, Any]]) -> None:
        """Append `events` after those sent before, without waiting (see `drain`)."""
        if self._flushing is not None and self._flushing.done():
            flushed, self._flushing = self._flushing, None
            flushed.result()  # raise what the last append met
        self._pending += events
        if self._flushing is None and self._pending:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def drain(self) -> None:
        """Wait until everything sent has landed; raise what an append met."""
        if self._flushing is not None:
            flushing, self._flushing = self._flushing, None
            await flushing

    async def settle(self) -> None:
        """Wait until what was sent is appended or an append fails, whatever it meets: then
        `next_sequence` is where the stream ends."""
        if self._flushing is not None:
            flushing, self._flushing = self._flushing, None
            with contextlib.suppress(Exception):
                await flushing

    async def abandon(self) -> None:
        """Stop appending what was sent (the attempt is over). An append already sent may still land:
        whoever writes next reads where the stream ends (`_ensure_terminal`)."""
        self._pending.clear()
        if self._flushing is not None:
            flushing, self._flushing = self._flushing, None
            flushing.cancel()
            with contextlib.suppress(BaseException):
                await flushing

    async def _flush(self) -> None:
        while self._pending:
            events, self._pending = coalesce.merge_deltas(self._pending), []
            await self.emit(events)

    async def emit(self, events: list[dict[str, Any]], *, final: bool = False) -> None:
        """Append `events`; raise `FencedOut`, or `CancelRequested` (unless this is the final append)."""
        encoded = [encode(event, self.next_sequence + offset) for offset, event in enumerate(events)]
        result = await self._append(encoded)
        # Only once they landed: a writer that goes on after a failed append must leave no gap.
        self.next_sequence += len(encoded)
        if self.first_output_at is None and any(_is_output(event) for event in encoded):
            self.first_output_at = time.monotonic()
        if result is AppendResult.FENCED:
            raise FencedOut(self.lease.response_id)
        if result is AppendResult.CANCEL_REQUESTED and not final:
            raise CancelRequested(self.lease.response_id)

    async def _append(self, encoded: list[Event]) -> AppendResult:
        deadline, delay = time.monotonic() + self.patience, 0.1
        while True:
            try:
                return await self._log.append(self.lease, encoded)
            except RedisResponseError as exc:
                # Explicit entry ids make a repeat fail (DESIGN.md §3). The script checked our lease
                # first, so only we can have written these numbers: a try whose reply was lost (ours,
                # or the client's own resend after a dropped connection) got through.
                if "equal or smaller" in str(exc):
                    return AppendResult.OK
                raise
            except (RedisConnectionError, RedisTimeoutError):
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("response %s: Redis unreachable; retrying an append", self.lease.response_id)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


def _is_output(event: Event) -> bool:
    """Whether the event tells something the model said (no lifecycle event, no ending)."""
    return event.type not in _BEFORE_OUTPUT and not event.is_terminal


def terminal_event(response: dict[str, Any]) -> dict[str, Any]:
    """The one terminal event for a finished Response (a cancel ends as `response.failed`, PROTOCOL.md §4.1)."""
    kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
        response["status"], "response.failed"
    )
    return {"type": kind, "response": response}


async def run_response(rt: Runtime, response_id: str) -> RunEnd:
    """Run `response_id` to its end under a new lease (DESIGN.md §2, steps 2-3)."""
    logs.RESPONSE_ID.set(response_id)  # this task's log lines carry it
    lease = await _acquire(rt, response_id)
    if lease is None:
        log.warning("response %s is held by another live holder; not running it", response_id)
        return RunEnd.BUSY
    rt.running[response_id] = asyncio.current_task()  # type: ignore[assignment]
    rt.held[response_id] = lease
    try:
        await _run_attempt(rt, lease)
        return RunEnd.FINISHED
    except FencedOut:
        log.warning("response %s: attempt %d was fenced out", response_id, lease.attempt)
        return RunEnd.FENCED
    except asyncio.CancelledError:
        end = rt.interrupted.get(response_id)
        if end is None:
            raise
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        log.warning("response %s: attempt %d %s", response_id, lease.attempt, end)
        return end
    except Exception:
        await _fail_unexpectedly(rt, lease)
        raise
    finally:
        rt.running.pop(response_id, None)
        rt.held.pop(response_id, None)
        rt.cancelling.discard(response_id)
        rt.interrupted.pop(response_id, None)
        await rt.leases.release(lease)


async def _acquire(rt: Runtime, response_id: str) -> Lease | None:
    """A new lease, waiting out a holder that is gone but whose lease has not expired yet (a dead
    or frozen worker whose job RQ retried). None if a live holder keeps renewing it."""
    deadline = time.monotonic() + rt.leases.ttl_seconds + 1
    while (lease := await rt.leases.acquire(response_id, rt.holder)) is None:
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.5)
    return lease


async def _fail_unexpectedly(rt: Runtime, lease: Lease) -> None:
    """An attempt broke on something other than its upstream: end the response failed, if we still can."""
    log.exception("response %s: attempt %d broke; failing the response", lease.response_id, lease.attempt)
    try:
        async with rt.engine.connect() as conn:
            stored = await store.get_response(conn, lease.response_id)
        last = await last_event(rt.redis, lease.response_id)
        if stored is None or stored.status is not Status.IN_PROGRESS or last is None:
            return
        writer = ResponseWriter(rt.log, lease, last.sequence_number + 1, rt.leases.ttl_seconds)
        final = failed(
            stored.response, "The server had an error while running this response.", int(time.time())
        )
        await _finish(rt, writer, stored, final)
    except Exception:
        log.exception("response %s: could not record the failure; recovery will end it", lease.response_id)


async def _run_attempt(rt: Runtime, lease: Lease) -> None:
    response_id = lease.response_id
    # Read together: nothing but this lease's holder appends now, so the newest event is the same
    # before or after the row moves.
    last_read = asyncio.ensure_future(last_event(rt.redis, response_id))
    try:
        stored = await _patiently(rt, partial(_start, rt, lease))
    except BaseException:
        last_read.cancel()
        raise
    last = await last_read
    writer = ResponseWriter(
        rt.log, lease, 0 if last is None else last.sequence_number + 1, rt.leases.ttl_seconds
    )
    if stored is None:  # deleted, ended, or a later attempt's: end its stream if it has ended
        await _end_as_stored(rt, writer)
        return
    response = stored.response
    if lease.attempt > 1 and last is not None and last.type != "response.queued":
        rt.metrics.orphans.inc()  # an earlier attempt had started it: this is a takeover
    if last is not None and last.type not in _BEFORE_OUTPUT:
        # DESIGN.md §4: an earlier attempt's output reached clients; generating again would repeat it.
        await _finish(rt, writer, stored, await _end_what_was_told(rt, writer, response))
        return
    announced = last is not None and last.type == "response.in_progress"
    final = await _produce(rt, writer, stored, response, announced=announced)
    if final is None:
        await _end_as_stored(rt, writer)
        return
    await _finish(rt, writer, stored, final)


async def _end_what_was_told(rt: Runtime, writer: ResponseWriter, response: dict[str, Any]) -> dict[str, Any]:
    """The failed Response of a response whose earlier attempt died mid-output: the items that
    attempt had opened are closed `incomplete` on the stream and kept, so both tell the same."""
    told = await read_events(rt.redis, response["id"])
    out = output.rebuild(event.payload() for event in told)
    await _emit(writer, output.close_open(out, "incomplete"))
    return failed(response, WORKER_LOST, int(time.time()), output=output.output_items(out))


async def _produce(
    rt: Runtime,
    writer: ResponseWriter,
    stored: store.StoredResponse,
    response: dict[str, Any],
    *,
    announced: bool,
) -> dict[str, Any] | None:
    """The final Response of this attempt, or None when it was cancelled."""
    rt.generating.add(stored.id)
    try:
        if not announced:  # appended while the upstream call starts
            writer.send([{"type": "response.in_progress", "response": response}])
        outcome = await _generate(rt, writer, stored)
    except CancelRequested:
        rt.metrics.cancels.inc()
        return None
    except asyncio.CancelledError:
        if stored.id not in rt.cancelling:
            raise
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        rt.metrics.cancels.inc()
        return None
    except (UpstreamFailed, *_UPSTREAM_FAULTS) as exc:
        await writer.settle()  # what was sent lands before the failure is told
        # An upstream (or a proxy before it) may quote the key it was sent, in any failure it reports.
        reason = redact(str(exc), rt.routes.api_key_of(stored.request["model"]))
        log.info("response %s failed: %s", stored.id, reason)
        rt.metrics.upstream_errors.labels(_fault_kind(exc)).inc()
        streamed = exc.output if isinstance(exc, UpstreamFailed) else []
        return failed(response, f"The upstream model failed: {reason}", int(time.time()), output=streamed)
    finally:
        rt.generating.discard(stored.id)
        await writer.abandon()  # a no-op unless the attempt ends here with appends in flight
    return finished(
        response,
        Status(outcome.status),
        int(time.time()),
        output=outcome.output,
        usage=outcome.usage,
        incomplete_details=outcome.incomplete_details,
    )


async def _generate(rt: Runtime, writer: ResponseWriter, stored: store.StoredResponse) -> chat_stream.Outcome:
    route = rt.routes.resolve(stored.request["model"])
    model = route.upstream_model or route.model
    if route.api is UpstreamApi.RESPONSES:
        native_state = native.NativeStream()
        body = native.to_responses_request(stored.request, stored.conversation, model)
        events = stream_json(rt.http, route, "/responses", body, rt.retry)
        translate = partial(native.translate_event, native_state)
        finish = partial(native.finish_stream, native_state)
        return await _translate(writer, events, translate, finish, native_state.output)
    chat_state = chat_stream.start_stream(include_logprobs=chat_request.includes_logprobs(stored.request))
    body = chat_request.to_chat_request(stored.request, stored.conversation, model)
    chunks = _chat_chunks(rt, route, body)
    translate = partial(chat_stream.translate_chunk, chat_state)
    finish = partial(chat_stream.finish_stream, chat_state)
    return await _translate(writer, chunks, translate, finish, chat_state.output)


def _chat_chunks(rt: Runtime, route: Route, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any]]:
    if route.api is UpstreamApi.SYNTHETIC:
        return synthetic_chunks(body, rt.synthetic_delay_seconds)
    return stream_json(rt.http, route, "/chat/completions", body, rt.retry)


Finish = Callable[[], tuple[list[dict[str, Any]], chat_stream.Outcome]]


async def _translate(
    writer: ResponseWriter,
    payloads: AsyncGenerator[dict[str, Any]],
    translate: Callable[[dict[str, Any]], list[dict[str, Any]]],
    finish: Finish,
    out: output.Output,
) -> chat_stream.Outcome:
    """Append the events of every upstream payload, then the closing ones; the outcome.

    The next payload is read while the last one's events are being appended (`ResponseWriter.send`).
    An upstream fault ends the items opened so far in `out` `incomplete` (`_fail_mid_stream`).
    However the loop ends (a cancel, a fence), the upstream call is closed at once, not when the
    garbage collector gets to it.
    """
    try:
        async with contextlib.aclosing(payloads):
            async for payload in payloads:
                writer.send(translate(payload))
        events, outcome = finish()
    except _UPSTREAM_FAULTS as exc:
        await writer.drain()
        raise await _fail_mid_stream(writer, out, exc) from exc
    except BaseException:
        await writer.abandon()
        raise
    writer.send(events)
    await writer.drain()
    return outcome


async def _emit(writer: ResponseWriter, events: list[dict[str, Any]]) -> None:
    if events:
        await writer.emit(events)


async def _fail_mid_stream(writer: ResponseWriter, out: output.Output, exc: Exception) -> UpstreamFailed:
    """End the items the upstream had opened as `incomplete`, so the stream adds up to the failed Response."""
    await _emit(writer, output.close_open(out, "incomplete"))
    return UpstreamFailed(str(exc), output.output_items(out))


async def _finish(
    rt: Runtime, writer: ResponseWriter, stored: store.StoredResponse, final: dict[str, Any]
) -> None:
    """Commit the final Response (fenced), then end the stream; if the commit lost, end as stored."""
    won = await _patiently(rt, partial(_record_final, rt, stored, writer.lease.attempt, final))
    if not won:
        await _end_as_stored(rt, writer)
        return
    await writer.emit([terminal_event(final)], final=True)
    _observe(rt.metrics, writer, str(final["status"]))
    await expire_response(rt.redis, stored.id, rt.stream_ttl_seconds)


def _observe(metrics: WorkerMetrics, writer: ResponseWriter, status: str) -> None:
    metrics.finished.labels(status).inc()
    metrics.completion.observe(time.monotonic() - writer.started_at)
    if writer.first_output_at is not None:
        metrics.first_event.observe(writer.first_output_at - writer.started_at)


def _fault_kind(exc: Exception) -> str:
    """A small label set: `http_<status>` for an upstream that answered, else the fault's class."""
    cause = exc.__cause__ if isinstance(exc, UpstreamFailed) and exc.__cause__ is not None else exc
    status = getattr(cause, "status", None)
    return f"http_{status}" if status else type(cause).__name__


async def _end_as_stored(rt: Runtime, writer: ResponseWriter) -> None:
    """Another outcome (a cancel) won in Postgres: end the stream with what is stored there."""
    stored = await _patiently(rt, partial(_read, rt, writer.lease.response_id))
    if stored is not None and stored.status in TERMINAL:
        await _ensure_terminal(rt, writer, stored.response, await last_event(rt.redis, stored.id))


async def _ensure_terminal(
    rt: Runtime, writer: ResponseWriter, response: dict[str, Any], last: Event | None
) -> None:
    """Append the terminal event unless the stream already ends with one (the caller holds the lease)."""
    if last is not None and last.is_terminal:
        return
    if last is not None:  # an append of an abandoned batch may have landed after the writer counted
        writer.next_sequence = last.sequence_number + 1
    await writer.emit([terminal_event(response)], final=True)
    await expire_response(rt.redis, writer.lease.response_id, rt.stream_ttl_seconds)


# --- Postgres, waited for -------------------------------------------------------------------------


async def _patiently[T](rt: Runtime, action: Callable[[], Awaitable[T]]) -> T:
    """`action`, retried while Postgres is unreachable, for up to `database_wait_seconds`.

    The heartbeat keeps the lease meanwhile, so a response that finished generating during a
    Postgres outage (or restart) is recorded once it is back, instead of being lost.
    """
    deadline, delay = time.monotonic() + rt.database_wait_seconds, 0.25
    while True:
        try:
            return await action()
        except Exception as exc:
            if not store.is_unreachable(exc) or time.monotonic() > deadline:
                raise
            log.warning("Postgres is unreachable (%s); retrying in %.1f s", type(exc).__name__, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 2.0)


async def _read(rt: Runtime, response_id: str) -> store.StoredResponse | None:
    async with rt.autocommit.connect() as conn:
        return await store.get_response(conn, response_id)


async def _start(rt: Runtime, lease: Lease) -> store.StoredResponse | None:
    """The row, moved to `in_progress` under this attempt; None if it may not run (store.start_attempt)."""
    async with rt.autocommit.connect() as conn:
        return await store.start_attempt(conn, lease.response_id, lease.attempt)


async def _record_final(
    rt: Runtime, stored: store.StoredResponse, attempt: int, final: dict[str, Any]
) -> bool:
    """Commit the final Response, fenced on `attempt`; a `store: false` response leaves nothing."""
    async with rt.autocommit.connect() as conn:
        if stored.store:
            return await store.mark_finished(conn, stored.id, attempt, final)
        return await store.delete_finished(conn, stored.id, attempt)


async def end_response(rt: Runtime, response_id: str, message: str) -> bool:
    """End a live response nobody runs as `failed` with `message`, under a lease of our own.

    False if a holder appeared, or it had already ended. The stream gets its terminal event either way.
    """
    lease = await rt.leases.acquire(response_id, f"{rt.holder}:sweep")
    if lease is None:
        return False
    try:
        async with rt.engine.begin() as conn:
            stored = await store.get_response(conn, response_id)
            if stored is None:
                return False
            won = stored.status not in TERMINAL and await store.mark_failed(
                conn, response_id, failed(stored.response, message, int(time.time()))
            )
        last = await last_event(rt.redis, response_id)
        writer = ResponseWriter(
            rt.log, lease, 0 if last is None else last.sequence_number + 1, rt.leases.ttl_seconds
        )
        await _end_as_stored(rt, writer)
        return bool(won)
    finally:
        await rt.leases.release(lease)


async def open_runtime(settings: Settings, holder: str, concurrency: int) -> Runtime:
    """Connections for a process that runs up to `concurrency` responses at once."""
    redis = connect(settings.redis_url, max_connections=max(16, concurrency // 4))
    return Runtime(
        engine=store.create_engine(settings.database_url, pool_size=min(20, max(5, concurrency // 10))),
        redis=redis,
        http=create_client(
            settings.upstream_stall_seconds, concurrency, connect_seconds=settings.upstream_connect_seconds
        ),
        retry=RetryPolicy.from_settings(settings),
        database_wait_seconds=settings.database_wait_seconds,
        routes=load_routes(settings),
        holder=holder,
        stream_ttl_seconds=settings.stream_ttl_seconds,
        synthetic_delay_seconds=settings.synthetic_delay_seconds,
        leases=Leases(redis, settings.lease_seconds),
    )


async def close_runtime(rt: Runtime) -> None:
    await rt.http.aclose()
    await rt.engine.dispose()
    await rt.redis.aclose(close_connection_pool=True)  # connect() hands the client a pool of its own


def run_job(response_id: str) -> None:
    """The RQ job function, for a stock `rq worker` on respool's queue (one response per process).

    respool's own worker never calls it: it runs `run_response` for many jobs on one event loop.
    """

    async def run_once() -> None:
        rt = await open_runtime(Settings(), f"rq:{os.getpid()}", 1)
        try:
            await run_response(rt, response_id)
        finally:
            await close_runtime(rt)

    asyncio.run(run_once())
