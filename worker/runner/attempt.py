"""Running one response (DESIGN.md §2, steps 2 and 3): lease, mark in progress, call the upstream,
translate, append every event fenced, record the final Response, then append the terminal event.

Postgres is the authority: the terminal event follows the commit, and a cancel recorded there wins.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from worker import logs
from worker.errors import (
    CancelRequestedError,
    FencedOutError,
    MidStreamError,
    ToolError,
    UpstreamError,
    redact,
)
from worker.events.lease import Lease
from worker.events.stream import Event, decode_flat, expire_response, last_event, read_events, start_over
from worker.events.writer import (
    BEFORE_OUTPUT,
    RedisOutlastedError,
    ResponseWriter,
    end_stream,
    terminal_event,
)
from worker.outages import is_outage, is_redis_outage, patiently
from worker.postgres import conversations, store
from worker.protocol import compaction, items
from worker.protocol.response import APPENDED, LIVE, TERMINAL, Status, failed, finished
from worker.queue import Started
from worker.routing import Route, UpstreamApi
from worker.runner import compacting, summary, tool_loop
from worker.runner.metrics import WorkerMetrics
from worker.runner.runtime import RunEnd, Runtime
from worker.runner.upstream import RESPONSES_STREAM, Call, stream_into
from worker.translation import chat_request, chat_stream, native, output, replay
from worker.translation.chat_tools import ServerTool

log = logging.getLogger("respool.runner")

# The newest event of a response no worker has started: only the API's first events are in its stream.
_FRESH = frozenset({"response.created", "response.queued"})

# How long a worker holding a response's ticket waits for its row: its create inserts it while the
# response is queued (DESIGN.md §2.1), in a millisecond or so unless Postgres is struggling.
ROW_WAIT_SECONDS = 10.0

WORKER_LOST = (
    "The worker running this response stopped after it had started streaming output; running it "
    "again would repeat that output, so it was ended here. Retry the request."
)


REDIS_OUTLASTED = (
    "respool could not reach its Redis for {seconds:g} s (RESPOOL_REDIS_OUTAGE_SECONDS) while running "
    "this response, so it was ended here. Retry the request."
)


async def run_response(rt: Runtime, response_id: str, started: Started | None = None) -> RunEnd:
    """Run `response_id`, which this worker took from the queue, to its end under a new lease
    (DESIGN.md §2, steps 2-3), the one its take started if it did; the queue is told how it ended."""
    logs.RESPONSE_ID.set(response_id)  # this task's log lines carry it
    acquired = await _acquire(rt, response_id) if started is None else _read_start(started)
    if acquired is None:
        log.warning("response %s is held by another live holder; not running it", response_id)
        return RunEnd.BUSY
    lease, last, ticket, announced = acquired
    rt.running[response_id] = asyncio.current_task()  # type: ignore[assignment]
    rt.started.set()
    rt.held[response_id] = lease
    end: RunEnd | None = None
    try:
        if ticket is not None and last is not None and (announced or last.type in _FRESH):
            stored = store.from_ticket(response_id, ticket, lease.attempt)
            await _run_ahead(rt, lease, last, stored, announced=announced)
        else:
            await _run_attempt(rt, lease, last)
        end = RunEnd.FINISHED
    except FencedOutError:
        log.warning("response %s: attempt %d was fenced out", response_id, lease.attempt)
        end = RunEnd.FENCED
    except asyncio.CancelledError:
        end = rt.interrupted.get(response_id)
        if end is None:
            raise
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        log.warning("response %s: attempt %d %s", response_id, lease.attempt, end)
    except Exception:
        if await _fail_unexpectedly(rt, lease):
            end = RunEnd.FINISHED
        raise
    finally:
        rt.running.pop(response_id, None)
        rt.held.pop(response_id, None)
        rt.cancelling.discard(response_id)
        rt.interrupted.pop(response_id, None)
        try:
            await _let_go(rt, lease, end)
        except Exception as exc:
            if not is_redis_outage(exc):
                raise
            # The queue still holds it: past its deadline the sweep puts it back, and its next
            # holder finds it ended and tells its stream so.
            log.warning("response %s: could not leave the queue (%s)", response_id, exc)
    assert end is not None  # every way out without one raised
    return end


async def _let_go(rt: Runtime, lease: Lease, end: RunEnd | None) -> None:
    """Give the lease back, and tell the queue: an ended response leaves it, a stopped one goes
    back to its front. Otherwise (fenced out; broken before the response could be failed) it stays
    held: its next holder's, or past its deadline the sweep's to put back or give up (DESIGN.md §4)."""
    left = lease.response_id in rt.left_queue
    rt.left_queue.discard(lease.response_id)
    if end is RunEnd.FINISHED:
        if not left:  # else its final append did this
            await rt.queue.finished(rt.leases, lease)
    elif end is RunEnd.STOPPED:
        await rt.queue.put_back(rt.leases, lease)
        log.info("response %s: requeued for another worker", lease.response_id)
    else:
        await rt.leases.release(lease)


async def _acquire(rt: Runtime, response_id: str) -> tuple[Lease, Event | None, bytes | None, bool] | None:
    """A new lease, the stream's newest event and the response's ticket (if it still had one),
    waiting out a holder that is gone but whose lease has not expired yet (a frozen worker whose
    response the sweep put back). None if a live holder keeps renewing it."""
    deadline = time.monotonic() + rt.leases.ttl_seconds + 1
    start = partial(rt.queue.start, rt.leases, response_id, rt.holder)
    while (started := await _patiently(rt, start)) is None:
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.5)
    return _read_start(started)


def _read_start(started: Started) -> tuple[Lease, Event | None, bytes | None, bool]:
    newest = None if started.newest is None else decode_flat(*started.newest)
    return started.lease, newest, started.ticket, started.announced


async def _fail_unexpectedly(rt: Runtime, lease: Lease) -> bool:
    """An attempt broke on something other than its upstream: end the response failed, if we still
    can; whether it has ended."""
    log.exception("response %s: attempt %d broke; failing the response", lease.response_id, lease.attempt)
    try:
        async with rt.engine.connect() as conn:
            stored = await store.get_response(conn, lease.response_id)
        await rt.log.flushed(lease)  # the broken attempt's last append, abandoned, may still be on its way
        last = await last_event(rt.redis, lease.response_id)
        if stored is None or stored.status not in LIVE or last is None:
            return stored is None or stored.status in TERMINAL
        writer = ResponseWriter.after(rt.log, lease, last, rt.redis_outage_seconds, rt.reclaim)
        final = failed(
            stored.response, "The server had an error while running this response.", int(time.time())
        )
        await _finish(rt, writer, stored, final)
        return True
    except Exception:
        log.exception("response %s: could not record the failure; recovery will end it", lease.response_id)
        return False


async def _run_ahead(
    rt: Runtime, lease: Lease, last: Event, stored: store.StoredResponse, *, announced: bool = False
) -> None:
    """A fresh response whose ticket came with its lease (queue.ResponseQueue.start): the upstream
    call starts without waiting for Postgres (DESIGN.md §2, step 2), and its row is not moved first:
    its end claims it, in the same statement that records it (`_finish`, fenced on no later attempt
    having claimed it and on the row being live), waiting for a row its create is still inserting.
    One statement a response less: a foreground row is `in_progress` from its insert; a
    background one says `queued` until its end, and a poll tells `in_progress` from the lease its
    worker holds (`ResponseService.retrieve`, PROTOCOL.md §7: in progress is a worker's lease).

    A background response cancelled while this starts (its cancel found it `queued` in Postgres)
    stops at the cancel flag (its next append reports it, or the worker's watch of cancel flags),
    and its end finds the row ended: the stream ends as stored. A foreground response not streamed
    defers its appends (`ResponseWriter.defer`): its create waits for the terminal event alone.
    `announced`: its take appended its `response.in_progress` (`queue.ResponseQueue.take_started`)."""
    row_wait_until = time.monotonic() + ROW_WAIT_SECONDS
    writer = ResponseWriter.after(rt.log, lease, last, rt.redis_outage_seconds, rt.reclaim)
    if not stored.stream and not stored.background:
        writer.defer()
    if announced:
        rt.metrics.events.inc()  # an event appended for this worker, as its appends are counted
    final = await _produce(rt, writer, stored, stored.response, announced=announced)
    if final is None:  # cancelled: told as stored
        await _end_as_stored(rt, writer)
        return
    await _finish(rt, writer, stored, final, row_wait_until=row_wait_until)


async def _run_attempt(rt: Runtime, lease: Lease, last: Event | None) -> None:
    """`last`: the stream's newest event when the lease was taken (nothing but this lease's holder
    appends now, so it is still the newest)."""
    stored = await _patiently(rt, partial(_start, rt, lease))
    writer = ResponseWriter.after(rt.log, lease, last, rt.redis_outage_seconds, rt.reclaim)
    if stored is None:  # deleted, ended, or a later attempt's: end its stream if it has ended
        await _end_as_stored(rt, writer)
        return
    if not stored.stream and not stored.background:
        writer.defer()  # its create waits for the terminal event alone
    response = stored.response
    if lease.attempt > 1 and last is not None and last.type != "response.queued":
        rt.metrics.orphans.inc()  # an earlier attempt had started it: this is a takeover
    last_type = None if last is None else last.type
    resumed = None
    if (
        last_type is not None
        and last_type not in BEFORE_OUTPUT
        and tool_loop.uses_tools(stored.request, rt.searcher is not None)
    ):
        resumed = await _resumable(rt, writer, response)
    if resumed is not None:
        log.info("response %s: attempt %d resumes its tool loop", stored.id, lease.attempt)
        last_type = "response.in_progress"
    elif last_type is not None and last_type not in BEFORE_OUTPUT:
        # DESIGN.md §4: an earlier attempt's output is in the stream. Unless a relay has read it,
        # nobody saw it: this attempt starts the stream's output over and generates it again.
        started = await start_over(rt.redis, lease)
        if started is None:  # a client saw that output; generating again would repeat it
            await _finish(rt, writer, stored, await _end_what_was_told(rt, writer, response))
            return
        log.info(
            "response %s: attempt %d starts over (no client saw the output so far)", stored.id, lease.attempt
        )
        writer.next_sequence, last_type = started.kept, started.last_type
    final = await _produce(
        rt, writer, stored, response, announced=last_type == "response.in_progress", resumed=resumed
    )
    if final is None:
        await _end_as_stored(rt, writer)
        return
    await _finish(rt, writer, stored, final)


async def _resumable(rt: Runtime, writer: ResponseWriter, response: dict[str, Any]) -> output.Output | None:
    """A tool loop's output as told, to continue from (DESIGN.md §10, "Durable"), when it holds a
    finished tool step: what the dead attempt left open is closed `incomplete` on the stream first."""
    told = await read_events(rt.redis, response["id"])
    out = replay.rebuild(event.payload() for event in told)
    if not tool_loop.has_completed_step(out):
        return None
    await _emit(writer, output.close_open(out, "incomplete"))
    return out


async def _end_what_was_told(rt: Runtime, writer: ResponseWriter, response: dict[str, Any]) -> dict[str, Any]:
    """The failed Response of a response whose earlier attempt died mid-output: the items that
    attempt had opened are closed `incomplete` on the stream and kept, so both tell the same."""
    told = await read_events(rt.redis, response["id"])
    out = replay.rebuild(event.payload() for event in told)
    await _emit(writer, output.close_open(out, "incomplete"))
    return failed(response, WORKER_LOST, int(time.time()), output=output.output_items(out))


async def _produce(
    rt: Runtime,
    writer: ResponseWriter,
    stored: store.StoredResponse,
    response: dict[str, Any],
    *,
    announced: bool,
    resumed: output.Output | None = None,
) -> dict[str, Any] | None:
    """The final Response of this attempt, or None when it was cancelled."""
    rt.generating.add(stored.id)
    outcome = None
    try:
        if not announced:  # appended while the upstream call starts
            writer.send([{"type": "response.in_progress", "response": response}])
        outcome = await _generate(rt, writer, stored, resumed)
    except CancelRequestedError:
        rt.metrics.cancels.inc()
        return None
    except asyncio.CancelledError:
        if stored.id not in rt.cancelling:
            raise
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        rt.metrics.cancels.inc()
        return None
    except ToolError as exc:
        await writer.settle()
        log.info("response %s failed: %s", stored.id, exc.message)
        return failed(response, exc.message, int(time.time()), output=exc.output)
    except RedisOutlastedError as exc:
        # Its end is recorded in Postgres; its stream's end is told once Redis answers, by whoever
        # holds the response next (`_end_as_stored`), so nothing waits another bound for it.
        await writer.abandon()
        writer.patience = 0.0
        log.warning("response %s failed: %s", stored.id, exc)
        return failed(response, REDIS_OUTLASTED.format(seconds=exc.seconds), int(time.time()))
    except UpstreamError as exc:
        await writer.settle()  # what was sent lands before the failure is told
        # An upstream (or a proxy before it) may quote the key it was sent, in any failure it reports.
        reason = redact(str(exc), rt.routes.api_key_of(stored.request["model"]))
        log.info("response %s failed: %s", stored.id, reason)
        rt.metrics.upstream_errors.labels(_fault_kind(exc)).inc()
        streamed = exc.output if isinstance(exc, MidStreamError) else []
        message = f"The upstream model failed: {reason}"
        return failed(response, message, int(time.time()), code=exc.code, output=streamed)
    finally:
        rt.generating.discard(stored.id)
        if outcome is None:  # what it kept for its end (`end_turn`) goes with it
            await writer.abandon()  # a no-op unless the attempt ends here with appends in flight
    return finished(
        response,
        Status(outcome.status),
        int(time.time()),
        output=outcome.output,
        usage=outcome.usage,
        incomplete_details=outcome.incomplete_details,
    )


async def _generate(
    rt: Runtime, writer: ResponseWriter, stored: store.StoredResponse, resumed: output.Output | None = None
) -> chat_stream.Outcome:
    route = rt.routes.resolve(stored.request["model"])
    model = route.upstream_model or route.model
    turn = _native_turn if route.api is UpstreamApi.RESPONSES else _chat_turn
    if stored.request.get("truncation") == "auto":
        turn = partial(_truncating, turn)
    if stored.request.get(compaction.COMPACT):
        return await compacting.compact_request(rt, writer, route, stored)
    if compacting.is_triggered(stored.conversation):
        return await compacting.compact_only(rt, writer, route, stored)
    if compacting.applies(stored.request, stored.conversation):
        turn = partial(compacting.run_turn, stored.owner, turn)
    if tool_loop.uses_tools(stored.request, rt.searcher is not None):
        loop = tool_loop.ToolLoop(
            writer=writer,
            redis=rt.redis,
            routes=rt.routes,
            policy=rt.outbound,
            timeout=rt.tool_timeout_seconds,
            request=stored.request,
            conversation=stored.conversation,
            response_id=stored.id,
            searcher=rt.searcher,
            journal_seconds=rt.stream_ttl_seconds,
        )
        return await loop.run(resumed or output.Output(), partial(turn, rt, writer, route, model))
    return await turn(rt, writer, route, model, stored.request, output.Output(), (), stored.conversation)


# What upstreams say when the input is longer than the model's context: vLLM and OpenAI ("maximum
# context length", `context_length_exceeded`), llama.cpp ("exceeds the available context size"),
# SGLang and others ("is longer than the model's context length", "too many tokens").
_OVERFLOW = re.compile(r"context.length|context.size|context window|too many tokens|prompt is too long", re.I)


async def _truncating(
    turn: Callable[..., Awaitable[chat_stream.Outcome]],
    rt: Runtime,
    writer: ResponseWriter,
    route: Route,
    model: str,
    request: dict[str, Any],
    out: output.Output,
    server_tools: tuple[ServerTool, ...],
    conversation: list[dict[str, Any]],
) -> chat_stream.Outcome:
    """`truncation: "auto"` (PROTOCOL.md §2): while the upstream refuses the input as longer than
    the model's context, before any output, the oldest turn is dropped and the turn asked again."""
    while True:
        told = len(out.items)
        try:
            return await turn(rt, writer, route, model, request, out, server_tools, conversation)
        except MidStreamError as exc:
            shorter = items.drop_oldest_turn(conversation)
            if (
                len(out.items) != told
                or exc.status != 400
                or not _OVERFLOW.search(exc.message)
                or shorter is None
            ):
                raise
            log.info(
                "response %s: the input is longer than the model's context; dropping its oldest turn",
                writer.lease.response_id,
            )
            conversation = shorter


async def _native_turn(
    rt: Runtime,
    writer: ResponseWriter,
    route: Route,
    model: str,
    request: dict[str, Any],
    out: output.Output,
    server_tools: tuple[ServerTool, ...],
    conversation: list[dict[str, Any]],
) -> chat_stream.Outcome:
    """One turn of a Responses upstream: its events told into `out` (the response's output so far)."""
    native_state = native.start_stream(out, server_tools)
    body = native.to_responses_request(request, conversation, model, server_tools)
    call = partial(stream_into, rt.http, route, "/responses", body, rt.retry, RESPONSES_STREAM)
    translate = partial(native.translate_event, native_state)
    finish = partial(native.finish_stream, native_state)
    return await _translate(writer, call, translate, finish, native_state.output)


async def _chat_turn(
    rt: Runtime,
    writer: ResponseWriter,
    route: Route,
    model: str,
    request: dict[str, Any],
    out: output.Output,
    server_tools: tuple[ServerTool, ...],
    conversation: list[dict[str, Any]],
) -> chat_stream.Outcome:
    """One chat model turn: its events told into `out` (the response's output so far)."""
    options = chat_request.stream_options(request, server_tools)
    chat_state = chat_stream.start_stream(**options, output=out)
    body = chat_request.to_chat_request(request, conversation, model, server_tools)
    call = summary.chat_call(rt.http, route, body, rt.retry, rt.synthetic_delay_seconds)
    translate = partial(chat_stream.translate_chunk, chat_state)
    finish = partial(chat_stream.finish_stream, chat_state)
    return await _translate(writer, call, translate, finish, chat_state.output)


Finish = Callable[[], tuple[list[dict[str, Any]], chat_stream.Outcome]]


async def _translate(
    writer: ResponseWriter,
    call: Call,
    translate: Callable[[dict[str, Any]], list[dict[str, Any]]],
    finish: Finish,
    out: output.Output,
) -> chat_stream.Outcome:
    """Append the events of every upstream payload, then the closing ones; the outcome.

    Each payload is translated and its events sent as it comes, in the upstream call's own callback
    (`stream_into`); the next ones are read while they are being appended (`ResponseWriter.send`).
    The read that ends the stream is held, and the turn's end keeps it for the response's end
    (`ResponseWriter.end_turn`): what it brought (a whole answer that came in one read, else the
    turn's last words and the ends of its parts and items) is appended with the terminal event,
    after the commit.
    An upstream fault ends the items opened so far in `out` `incomplete` (`_fail_mid_stream`).
    However the call ends (a cancel, a fence the writer raises), the upstream call is closed at once.
    """

    def consume(payloads: list[dict[str, Any]], ends: bool) -> None:
        if ends:  # the turn's last events: they may go with the response's end (`end_turn`)
            writer.hold()
        if len(payloads) == 1:  # a token a read: the steady pace's
            writer.send(translate(payloads[0]))
            return
        events: list[dict[str, Any]] = []
        try:
            for payload in payloads:
                events += translate(payload)
        finally:  # what came before a payload that failed its translation is told first
            writer.send(events)

    try:
        await call(consume)
        events, outcome = finish()
    except UpstreamError as exc:
        await writer.drain()
        raise await _fail_mid_stream(writer, out, exc) from exc
    except BaseException:
        await writer.abandon()
        raise
    writer.send(events)
    await writer.end_turn()
    return outcome


async def _emit(writer: ResponseWriter, events: list[dict[str, Any]]) -> None:
    if events:
        await writer.emit(events)


async def _fail_mid_stream(writer: ResponseWriter, out: output.Output, exc: UpstreamError) -> MidStreamError:
    """End the items the upstream had opened as `incomplete`, so the stream adds up to the failed Response."""
    await _emit(writer, output.close_open(out, "incomplete"))
    return MidStreamError(exc, output.output_items(out))


async def _finish(
    rt: Runtime,
    writer: ResponseWriter,
    stored: store.StoredResponse,
    final: dict[str, Any],
    row_wait_until: float | None = None,
) -> None:
    """Commit the final Response (fenced), then end the stream; if the commit lost, end as stored.
    What the writer kept (the last model turn's last read: `ResponseWriter.end_turn`) goes with the
    terminal event, one append after the commit; were that append lost (fenced out, its lease taken
    meanwhile), the next holder finds the row ended and tells the output the stream had not told
    from it (`end_stream`).
    With `row_wait_until` (an attempt that has not claimed its row: its create may still be inserting
    it), a row not there yet is waited for until then."""
    record = partial(_record_final, rt, stored, writer.lease.attempt, final)
    if row_wait_until is not None:
        record = partial(_when_the_row_is_there, rt, stored.id, record, row_wait_until)
    won = await _recorded(rt, writer, record)
    if not won:  # what it kept for its end was never told: the stream ends as stored
        await writer.abandon()
        await _end_as_stored(rt, writer)
        return
    # Its keys' retention clock starts with the terminal event, in the same round trip, and it leaves
    # the queue and gives its lease back in it too (a round trip less at its end).
    rid = writer.lease.response_id
    leaving = rt.queue.leaving(rid)
    try:
        await writer.emit(
            [terminal_event(final)], final=True, retain_seconds=rt.stream_ttl_seconds, leaving=leaving
        )
    except Exception as exc:
        if not is_redis_outage(exc):  # (the writer of one that outlasted its bound has no patience)
            raise
        # Recorded: once Redis is back, the next holder tells the stream (`_end_as_stored`).
        log.warning("response %s: its end is recorded, its stream not told (%s)", rid, exc)
        rt.held.pop(rid, None)
        _observe(rt.metrics, writer, str(final["status"]))
        return
    rt.held.pop(rid, None)  # its lease is gone: the heartbeat has nothing to renew, nor to find lost
    rt.left_queue.add(rid)
    _observe(rt.metrics, writer, str(final["status"]))


async def _recorded(rt: Runtime, writer: ResponseWriter, record: Callable[[], Awaitable[bool]]) -> bool:
    """`record` (the end's commit), tried again while Postgres is unreachable (`_patiently`). What
    the writer kept for the response's end is appended once the first try meets an outage, so that
    a client following the stream sees all the model said while the end waits for Postgres."""
    try:
        return await record()
    except Exception as exc:
        if not is_outage(exc):
            raise
    await writer.settle()  # a fence or a cancel it met is the final append's to meet again
    return await _patiently(rt, record)


def _observe(metrics: WorkerMetrics, writer: ResponseWriter, status: str) -> None:
    metrics.finished.labels(status).inc()
    metrics.completion.observe(time.monotonic() - writer.started_at)
    if writer.first_output_at is not None:
        metrics.first_event.observe(writer.first_output_at - writer.started_at)


def _fault_kind(exc: UpstreamError) -> str:
    """A small label set: `http_<status>` for an upstream that answered, else the fault's class."""
    cause = exc.cause if isinstance(exc, MidStreamError) else exc
    status = getattr(cause, "status", None)
    return f"http_{status}" if status else type(cause).__name__


async def _end_as_stored(rt: Runtime, writer: ResponseWriter) -> None:
    """Another outcome (a cancel) won in Postgres: end the stream with what is stored there. A
    response with no row (deleted, or taken back by a create whose enqueue failed after all) has
    nothing to tell: its keys are left to expire."""
    stored = await _patiently(rt, partial(_read, rt, writer.lease.response_id))
    if stored is None:
        await expire_response(rt.redis, writer.lease.response_id, rt.stream_ttl_seconds)
    elif stored.status in TERMINAL:
        await end_stream(writer, stored.response, rt.stream_ttl_seconds)


# --- Postgres, waited for -------------------------------------------------------------------------


async def _patiently[T](rt: Runtime, action: Callable[[], Awaitable[T]]) -> T:
    """`action`, tried again while Postgres is unreachable, for up to `database_wait_seconds`.

    The heartbeat keeps the lease meanwhile, so a response that finished generating during a
    Postgres outage (or restart) is recorded once it is back, instead of being lost.
    """
    return await patiently(action, rt.database_wait_seconds)


async def _read(rt: Runtime, response_id: str) -> store.StoredResponse | None:
    async with rt.direct.connection() as conn:
        return await store.get_response(conn, response_id)


async def _when_the_row_is_there(
    rt: Runtime, response_id: str, record: Callable[[], Awaitable[bool]], until: float
) -> bool:
    """`record` (an end that claims the row), asked again while the row is not there yet, up to
    `until`; one that never comes was taken back (its create failed)."""
    pause = 0.0  # asked again at once, then after 1, 2, 4 ... 100 ms
    there = False
    while True:
        if await record():
            return True
        if there:  # the row was there before this try: another outcome won
            return False
        async with rt.direct.connection() as conn:
            there = await store.response_exists(conn, response_id)
        if there:  # it landed since the try: try again
            continue
        if time.monotonic() >= until:
            log.warning("response %s: no row came for its ticket; not recording it", response_id)
            return False
        await asyncio.sleep(pause)
        pause = min(max(pause * 2, 0.001), 0.1)


async def _start(rt: Runtime, lease: Lease) -> store.StoredResponse | None:
    """The row, moved to `in_progress` under this attempt; None if it may not run (store.start_attempt)."""
    async with rt.direct.connection() as conn:
        return await store.start_attempt(conn, lease.response_id, lease.attempt)


async def _record_final(
    rt: Runtime, stored: store.StoredResponse, attempt: int, final: dict[str, Any]
) -> bool:
    """Commit the final Response, fenced on `attempt`; a `store: false` response leaves nothing. A
    response on a conversation appends its input and output items to it in the same transaction
    (DESIGN.md §11), when it completed or ended incomplete: exactly once, whatever died on the way."""
    notifies = rt.notifier.wanted(stored.owner, final["status"], background=stored.background)
    if stored.conversation_id is None and not notifies:
        if rt.ends is not None and stored.background and not stored.stream and stored.store:
            return await rt.ends.finish(stored.id, attempt, final)
        async with rt.direct.connection() as conn:
            if stored.store:
                return await store.mark_finished(conn, stored.id, attempt, final)
            return await store.delete_finished(conn, stored.id, attempt)
    delivery_ids: list[str] = []
    async with rt.engine.begin() as conn:
        # Its own input items, read once its row is there: a foreground response's end may come
        # before its create's insert (its row and items, in one statement) has landed, and each
        # statement here reads what had landed when it began (`_when_the_row_is_there` asks again).
        if stored.conversation_id is not None and not await store.response_exists(conn, stored.id):
            return False
        own = await store.own_input_items(conn, stored.id) if stored.conversation_id else []
        if stored.store:
            ended = await store.mark_finished(conn, stored.id, attempt, final)
        else:
            ended = await store.delete_finished(conn, stored.id, attempt)
        if ended and stored.conversation_id is not None and final["status"] in APPENDED:
            await conversations.append_response(
                conn, stored.conversation_id, stored.id, own + list(final.get("output") or [])
            )
        if ended and notifies:  # DESIGN.md §12: the deliveries with the end, in its transaction
            delivery_ids = await rt.notifier.record(conn, stored.id, stored.owner, final["status"])
    await rt.notifier.send(delivery_ids)
    return ended


async def end_response(rt: Runtime, response_id: str, message: str) -> bool:
    """End a live response nobody runs as `failed` with `message`, under a lease of our own.

    False if a holder appeared, or it had already ended. The stream gets its terminal event either way.
    """
    lease = await rt.leases.acquire(response_id, f"{rt.holder}:sweep")
    if lease is None:
        return False
    try:
        delivery_ids: list[str] = []
        async with rt.engine.begin() as conn:
            stored = await store.get_response(conn, response_id)
            if stored is None:
                return False
            won = stored.status not in TERMINAL and await store.mark_failed(
                conn, response_id, failed(stored.response, message, int(time.time()))
            )
            if won and rt.notifier.wanted(stored.owner, Status.FAILED, background=stored.background):
                delivery_ids = await rt.notifier.record(conn, response_id, stored.owner, Status.FAILED)
        await rt.notifier.send(delivery_ids)
        last = await last_event(rt.redis, response_id)
        await _end_as_stored(
            rt, ResponseWriter.after(rt.log, lease, last, rt.redis_outage_seconds, rt.reclaim)
        )
        return bool(won)
    finally:
        await rt.leases.release(lease)
