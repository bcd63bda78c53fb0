"""The queue's edges when workers die or freeze around a take, and responses whose row comes late or
never: each is run once, or nowhere (DESIGN.md §2.1, §4)."""

from __future__ import annotations

import asyncio
import time

import openai
import orjson
import psutil
import psycopg
import pytest
from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from api.auth import OPEN_OWNER
from tests.support.faults import (
    CONT,
    KILL,
    STOP,
    check_ended,
    signal_process,
    wait_until_ended,
)
from tests.support.lab import Lab
from tests.support.queue import QueueView
from tests.support.stack import wait_for
from worker.events.stream import encode
from worker.ids import new_id
from worker.keys import events_key, queued_key, ticket_key, workers_key
from worker.postgres import store
from worker.postgres.direct import driver_url
from worker.protocol.request import parse_create_request
from worker.protocol.response import Status, build_response
from worker.queue import TICKET_MAX_BYTES, ResponseQueue

# Each test starts and kills several processes: on a loaded 2-core machine that takes a while.
pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(300)]


def test_a_worker_killed_inside_rqs_registry_cleaning_does_not_stall_takeovers(lab: Lab) -> None:
    """RQ cleans a queue's registries (those of the webhook deliveries' queue now) under a lock that
    lives 15 minutes and is released when the cleaning ends: a worker killed -9 inside it leaves the
    lock behind (as a stale key here). Its responses are still taken over within seconds: neither
    RQ's lock nor its registries stand between a dead worker's responses and the next worker."""
    talking = f"{lab.model}-stale-lock"
    text = " ".join(f"w{n}" for n in range(40))
    lab.upstream.script(talking, {"text": text, "delay": 0.1})
    doomed = lab.start("doomed")
    created = lab.create(talking, 3)
    lab.held_by(created, doomed)
    lab.streamed(created)
    queue = lab.stack.env["RESPOOL_QUEUE"]
    for name in (queue, f"{queue}-webhooks"):
        lab.redis.set(f"rq:clean_registries:{name}", 1, ex=899)  # what a kill inside cleaning leaves
    signal_process(lab.stack, "doomed", KILL)
    lab.start("survivor")
    statuses = wait_until_ended(lab.sdk, created, timeout=60)
    assert set(statuses.values()) == {"completed"}  # nobody saw their output: each ran again


def _over_tcp(lab: Lab) -> dict[str, str]:
    """The environment of a worker whose connections to Redis `_blocked_pops` can tell from the
    rest (by their ports): an embedded Redis's unix socket names no peer, so its TCP port instead."""
    url = lab.stack.env["RESPOOL_REDIS_URL"]
    if url.startswith("unix:"):
        url = f"redis://127.0.0.1:{lab.redis.config_get('port')['port']}/0"
    return {"RESPOOL_REDIS_URL": url}


def _blocked_pops(redis: Redis, pid: int) -> int:
    """How many of process `pid`'s Redis connections (over TCP: `_over_tcp`) wait in a blocking pop."""
    ports = {c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.raddr}
    return sum(
        1
        for client in redis.client_list()
        if int(client["addr"].rsplit(":", 1)[1]) in ports and "b" in client["flags"]
    )


def _freeze_while_popping(lab: Lab, name: str) -> None:
    """Freeze worker `name` (SIGSTOP) while both its blocking pops (responses, webhooks) wait."""
    pid = lab.stack.processes[name].pid

    def frozen_while_popping() -> bool:
        signal_process(lab.stack, name, STOP)
        if _blocked_pops(lab.redis, pid) == 2:
            return True
        signal_process(lab.stack, name, CONT)  # between two pops: try again
        time.sleep(0.3)
        return False

    wait_for(frozen_while_popping, timeout=30, what="the worker frozen inside both its blocking pops")


def test_a_response_popped_by_a_worker_killed_before_it_read_its_start_is_run(lab: Lab) -> None:
    """A worker frozen while both its pops (responses, webhooks) wait is handed a response anyway:
    Redis serves the blocking pop on its side and runs the start pipelined behind it, so the frozen
    worker holds the response's lease, with a deadline, out of its taking list. Killed -9 before it
    reads any of that, it is not lost: its lease lapses, the survivor's sweep finds it past its
    deadline and puts it back, and it completes; the dead worker leaves the queue."""
    doomed = lab.start("doomed", _over_tcp(lab))
    _freeze_while_popping(lab, "doomed")
    (response_id,) = lab.create(lab.model, 1)
    queue = QueueView(lab.redis, lab.stack.env["RESPOOL_QUEUE"])
    lab.held_by([response_id], doomed)
    assert queue.taking(doomed) == [] and response_id in queue.running()
    signal_process(lab.stack, "doomed", KILL)
    lab.start("survivor")
    assert doomed in queue.workers()
    lab.redis.zadd(workers_key(queue.name), {doomed: 1000})  # its time long past
    statuses = wait_until_ended(lab.sdk, [response_id], timeout=60)
    assert statuses == {response_id: "completed"}
    assert doomed not in queue.workers()


def test_a_response_cancelled_after_its_worker_popped_it_stops_at_the_cancel_flag(lab: Lab) -> None:
    """A worker frozen inside its pops is handed a response, started on its behalf with its ticket
    (the row as recorded), and the response is cancelled before the worker thaws: Postgres records
    the cancel (the row said `queued`: a background row is claimed by its end, attempt._run_ahead);
    the queue no longer holds it to remove. Thawed, the worker starts it from its ticket: its first
    append reports the cancel flag, the upstream call is dropped before the upstream's text ends,
    and the stream ends as the cancelled row."""
    model = "ticket-cancelled"
    lab.upstream.script(model, {"text": "never told " * 4, "delay": 0.2})
    popper = lab.start("popper", _over_tcp(lab))
    _freeze_while_popping(lab, "popper")
    (response_id,) = lab.create(model, 1)
    lab.held_by([response_id], popper)  # started by Redis behind the pop, the ticket taken with it
    assert lab.redis.exists(ticket_key(response_id)) == 0
    assert lab.sdk.responses.cancel(response_id).status == "cancelled"
    signal_process(lab.stack, "popper", CONT)
    wait_for(lambda: lab.upstream.requests(model), timeout=30, what="the upstream called from the ticket")
    wait_for(lambda: _has_ended(lab.redis, response_id), timeout=30, what="the stream ended")
    types = [fields[b"t"].decode() for _, fields in lab.redis.xrange(events_key(response_id))]
    assert types[:2] == ["response.created", "response.queued"] and types[-1] == "response.failed"
    assert "response.output_text.done" not in types  # stopped before the upstream's text ended
    (_, last), *_ = lab.redis.xrevrange(events_key(response_id), count=1)
    assert orjson.loads(last[b"d"])["response"]["status"] == "cancelled"
    assert lab.redis.exists(ticket_key(response_id)) == 0
    stored = check_ended(lab.sdk, response_id)
    assert (stored["status"], stored["output"]) == ("cancelled", [])


def _has_ended(redis: Redis, response_id: str) -> bool:
    newest = redis.xrevrange(events_key(response_id), count=1)
    return bool(newest) and newest[0][1][b"t"] in {
        b"response.completed",
        b"response.failed",
        b"response.incomplete",
    }


@pytest.mark.parametrize("ticketed", [True, False], ids=["ticket", "no-ticket"])
def test_a_queued_response_whose_row_was_taken_back_runs_nowhere(lab: Lab, ticketed: bool) -> None:
    """A create whose enqueue timed out after Redis had run it takes its row back (the API's side:
    tests/api/test_outages.py): the queue holds a response with no row. The worker that takes it
    records nothing, lets the queue drop it, and leaves its keys to expire: without a ticket it runs
    nothing (its start finds no row); with one it has called the upstream at once (as a foreground
    response does), and its end, which waits for the row, finds none: its stream tells no end."""
    request = parse_create_request({"model": lab.model, "input": "taken back", "background": True})
    response_id = new_id("resp")
    response = build_response(request, response_id, int(time.time()), Status.QUEUED)
    row = store.new_row("nobody", request, response, [], 0)
    first = [encode({"type": "response.created", "response": response}, 0)]
    queue_name = lab.stack.env["RESPOOL_QUEUE"]

    async def enqueue() -> None:
        async with AsyncRedis.from_url(lab.stack.env["RESPOOL_REDIS_URL"]) as redis:
            ticket = store.ticket(row, TICKET_MAX_BYTES) if ticketed else None
            await ResponseQueue(redis, queue_name).enqueue(response_id, first, ticket=ticket)

    lab.start(f"taker-{ticketed}")
    asyncio.run(enqueue())
    wait_for(lambda: lab.redis.ttl(events_key(response_id)) > 0, timeout=30, what="its keys left to expire")
    # Then the queue drops it (its end's last round trip: the keys' expiry goes first).
    wait_for(lambda: response_id not in QueueView(lab.redis, queue_name).held(), timeout=5, what="it dropped")
    assert lab.redis.exists(queued_key(response_id), ticket_key(response_id)) == 0
    told = [fields[b"t"] for _, fields in lab.redis.xrange(events_key(response_id))]
    assert told[0] == b"response.created" and not _has_ended(lab.redis, response_id)
    assert (told == [b"response.created"]) == (not ticketed)
    with pytest.raises(openai.NotFoundError):
        lab.sdk.responses.retrieve(response_id)


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_a_ticketed_response_taken_before_its_row_landed_waits_for_it(lab: Lab, background: bool) -> None:
    """A create queues a ticketed response while it inserts the row (DESIGN.md §2.1): a worker that
    takes it first calls the upstream at once, streams as the upstream answers, and records the
    end only once the row came (the end claims it): no terminal event before."""
    # A word every 50 ms: an answer that came in one read would be told with its end (`end_turn`).
    lab.upstream.script(lab.model, {"text": "late but whole", "delay": 0.05})
    body = {"model": lab.model, "input": "row comes late", "background": background, "stream": True}
    request = parse_create_request(body)
    response_id = new_id("resp")
    response = build_response(request, response_id, int(time.time()), Status.QUEUED)
    row = store.new_row(OPEN_OWNER, request, response, [], 0)
    queue_name = lab.stack.env["RESPOOL_QUEUE"]

    async def enqueue() -> None:
        async with AsyncRedis.from_url(lab.stack.env["RESPOOL_REDIS_URL"]) as redis:
            first = [encode({"type": "response.created", "response": response}, 0)]
            await ResponseQueue(redis, queue_name).enqueue(response_id, first, ticket=store.ticket(row, 4096))

    async def insert() -> None:
        async with await psycopg.AsyncConnection.connect(
            driver_url(lab.stack.env["RESPOOL_DATABASE_URL"]), autocommit=True
        ) as conn:
            await store.insert_response(conn, row, 0)

    lab.start(f"early-{background}")
    asyncio.run(enqueue())
    wait_for(lambda: lab.upstream.requests(lab.model), timeout=30, what="the upstream called before the row")
    time.sleep(1.0)  # the end meets no row meanwhile (it is asked again and again)
    told = [fields[b"t"] for _, fields in lab.redis.xrange(events_key(response_id))]
    assert b"response.output_text.delta" in told and not _has_ended(lab.redis, response_id)
    asyncio.run(insert())
    wait_for(lambda: _has_ended(lab.redis, response_id), timeout=30, what="the response to end")
    stored = lab.sdk.responses.retrieve(response_id)
    assert (stored.status, stored.output_text) == ("completed", "late but whole")
    assert len(lab.upstream.requests(lab.model)) == 1  # called once, before the row, never again
