"""Workers that die, freeze or stop under load: every response still ends exactly once (DESIGN.md §4)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import openai
import psutil
import psycopg
import pytest
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from api.auth import OPEN_OWNER
from tests.conftest import make_sdk, own_stack
from tests.support.faults import (
    CONT,
    KILL,
    STOP,
    check_ended,
    lease_holders,
    signal_process,
    wait_until_ended,
    worker_name,
)
from tests.support.queue import QueueView
from tests.support.stack import Servers, Stack, wait_for
from tests.support.upstream_process import ScriptedUpstream
from worker.events.stream import encode
from worker.ids import new_id
from worker.keys import events_key, queued_key, ticket_key, workers_key
from worker.postgres import store
from worker.postgres.direct import driver_url
from worker.protocol.request import parse_create_request
from worker.protocol.response import Status, build_response
from worker.queue import TICKET_MAX_BYTES, ResponseQueue
from worker.runner.attempt import WORKER_LOST
from worker.runner.recovery import GIVEN_UP

# Each test starts and kills several processes: on a loaded 2-core machine that takes a while.
pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def faults(backing: Servers, upstream: ScriptedUpstream, session_dir: Path, stack: Stack) -> Iterator[Stack]:
    """An API of this module's own; each test starts the workers it kills."""
    running = own_stack(
        backing,
        session_dir,
        "faults",
        RESPOOL_UPSTREAM_URL=upstream.url,
        RESPOOL_UPSTREAM_API="chat",
        RESPOOL_DRAIN_SECONDS="60",
    )
    running.start_api()
    yield running
    running.stop_all()


@dataclass
class Lab:
    """What a fault test drives: the module's stack, the SDK, the upstream, Redis, its own workers."""

    stack: Stack
    sdk: openai.OpenAI
    upstream: ScriptedUpstream
    redis: Redis
    model: str
    workers: list[str] = field(default_factory=list)

    def start(self, name: str, env: dict[str, str] | None = None) -> str:
        """Start a worker and wait until it takes jobs (and a SIGTERM would drain it); its RQ name."""
        self.stack.start_worker(name, env=env)
        self.workers.append(name)
        return worker_name(self.redis, self.stack, name)

    def create(
        self, model: str, count: int, sdk: openai.OpenAI | None = None, *, seen: bool = False
    ) -> list[str]:
        """`count` background responses; `seen` ones are streamed to a client from their start (which
        stops reading at once), the rest are only polled: nobody sees their output until they end."""
        client = sdk or self.sdk
        if not seen:
            return [client.responses.create(model=model, input="x", background=True).id for _ in range(count)]
        created = []
        for _ in range(count):
            with client.responses.create(model=model, input="x", background=True, stream=True) as stream:
                created.append(next(iter(stream)).response.id)
        return created

    def held_by(self, response_ids: list[str], holder: str) -> None:
        """Wait until `holder` holds every one of the responses."""
        wait_for(
            lambda: set(lease_holders(self.redis, response_ids).values()) == {holder},
            timeout=60,
            what=f"{len(response_ids)} leases",
        )

    def streamed(self, response_ids: list[str]) -> None:
        """Wait until every one of the responses has streamed output to clients."""
        wait_for(lambda: all(_has_output(self.redis, rid) for rid in response_ids), timeout=30, what="output")


@pytest.fixture
def lab(faults: Stack, upstream: ScriptedUpstream, backing: Servers, model: str) -> Iterator[Lab]:
    with make_sdk(faults.url, "unused") as sdk, Redis.from_url(backing.redis_url) as redis:
        running = Lab(faults, sdk, upstream, redis, model)
        yield running
        for name in running.workers:
            if name in faults.processes:
                faults.stop(name, KILL)


def _has_output(redis: Redis, response_id: str) -> bool:
    return any(fields[b"t"].endswith(b".delta") for _, fields in redis.xrange(events_key(response_id)))


def test_kill_9_with_100_responses_in_flight(lab: Lab) -> None:
    """A worker killed with 100 responses: those with no output yet, and those whose output no client
    has seen, run again to completion; those whose output a client saw fail saying the worker stopped;
    none stays live, every stream stays whole and tells only the run that counted."""
    quiet, talking = f"{lab.model}-quiet", f"{lab.model}-talking"
    # 30 s of tokens: on a slow machine the first talking responses were created 10 s before the
    # kill (100 creates, the survivor's start), and a 10 s text ended before it.
    text = " ".join(f"w{n}" for n in range(300))
    # The first run of each quiet response never gets an answer; the second does at once.
    lab.upstream.script(
        quiet, {"times": 50, "first_delay": 300, "text": "never", "then": {"text": "quiet answer"}}
    )
    lab.upstream.script(talking, {"text": text, "delay": 0.1})
    doomed = lab.start("doomed")
    quiet_ids = lab.create(quiet, 50)
    seen_ids, unseen_ids = lab.create(talking, 25, seen=True), lab.create(talking, 25)
    every = quiet_ids + seen_ids + unseen_ids
    lab.held_by(every, doomed)
    lab.streamed(seen_ids + unseen_ids)
    lab.start("survivor")
    killed_at = time.monotonic()
    signal_process(lab.stack, "doomed", KILL)
    statuses = wait_until_ended(lab.sdk, every, timeout=120)
    print(f"kill -9: 100 responses ended {time.monotonic() - killed_at:.1f} s after the kill")
    assert {statuses[rid] for rid in quiet_ids + unseen_ids} == {"completed"}
    assert {statuses[rid] for rid in seen_ids} == {"failed"}
    for response_id in every:
        stored = check_ended(lab.sdk, response_id)
        if response_id in seen_ids:
            assert stored["error"] == {"code": "server_error", "message": WORKER_LOST, "type": "server_error"}
            # What had been streamed is kept, closed as incomplete: the stream and the record agree.
            (message,) = stored["output"]
            assert message["status"] == "incomplete"
            assert text.startswith(message["content"][0]["text"])
        elif response_id in unseen_ids:
            # The dead run's output is gone from the stream: one message, the whole text, once.
            events = list(lab.sdk.responses.retrieve(response_id, stream=True))
            added = [event for event in events if event.type == "response.output_item.added"]
            deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
            assert (len(added), deltas) == (1, text)
            assert stored["output"][0]["content"][0]["text"] == text
        else:
            assert stored["output"][0]["content"][0]["text"] == "quiet answer"
    assert len(lab.upstream.requests(quiet)) == 100  # each quiet response was asked for exactly twice
    assert len(lab.upstream.requests(talking)) == 75  # the unseen ones twice, the seen ones once


def test_a_frozen_worker_writes_nothing_after_its_responses_were_taken_over(lab: Lab) -> None:
    """SIGSTOP past the lease, takeover, SIGCONT: the zombie's later output is fenced out everywhere."""
    quiet, talking = f"{lab.model}-quiet", f"{lab.model}-talking"
    lab.upstream.script(
        quiet, {"times": 10, "first_delay": 20, "text": "late", "then": {"text": "quiet answer"}}
    )
    lab.upstream.script(talking, {"text": " ".join(f"w{n}" for n in range(60)), "delay": 0.1})
    frozen = lab.start("frozen")
    quiet_ids, talking_ids = lab.create(quiet, 10), lab.create(talking, 10, seen=True)
    every = quiet_ids + talking_ids
    lab.held_by(every, frozen)
    lab.streamed(talking_ids)
    signal_process(lab.stack, "frozen", STOP)
    try:
        lab.start("rescuer")
        statuses = wait_until_ended(lab.sdk, every, timeout=120)
    finally:
        signal_process(lab.stack, "frozen", CONT)
    ended = {rid: check_ended(lab.sdk, rid) for rid in every}
    # The zombie wakes with upstream streams still open; it must notice its leases are gone: its
    # heartbeat finds them lost, or (first, on a loaded machine) its appends are fenced out.
    noticed = lambda: any(line in lab.stack.log("frozen") for line in ("lease lost", "was fenced out"))  # noqa: E731
    wait_for(noticed, timeout=30, what="the zombie to notice")
    for response_id in every:
        assert check_ended(lab.sdk, response_id) == ended[response_id]  # unchanged after the zombie woke
    assert {statuses[rid] for rid in quiet_ids} == {"completed"}
    assert {statuses[rid] for rid in talking_ids} == {"failed"}
    fresh = lab.create(quiet, 1)  # the woken worker (or the rescuer) still serves new work
    assert wait_until_ended(lab.sdk, fresh, timeout=60) == {fresh[0]: "completed"}


def test_rolling_restart_fails_no_response(lab: Lab) -> None:
    """SIGTERM one worker after another under load: each drains what it runs, and every response completes."""
    lab.upstream.script(lab.model, {"text": " ".join(f"w{n}" for n in range(20)), "delay": 0.1})
    lab.start("old-1")
    lab.start("old-2")
    created = lab.create(lab.model, 30)
    leased = lambda: sum(1 for holder in lease_holders(lab.redis, created).values() if holder) >= 10  # noqa: E731
    wait_for(leased, timeout=60, what="load")
    lab.start("new-1")
    assert lab.stack.stop("old-1") == 0
    created += lab.create(lab.model, 10)
    lab.start("new-2")
    assert lab.stack.stop("old-2") == 0
    created += lab.create(lab.model, 10)
    statuses = wait_until_ended(lab.sdk, created, timeout=120)
    assert set(statuses.values()) == {"completed"}
    for response_id in created:
        check_ended(lab.sdk, response_id)


def test_a_drain_deadline_requeues_what_is_left(lab: Lab) -> None:
    """Past the drain deadline a stopping worker puts responses without output back in the queue; another runs them."""
    lab.upstream.script(
        lab.model, {"times": 5, "first_delay": 300, "text": "never", "then": {"text": "late answer"}}
    )
    lab.stack.env["RESPOOL_DRAIN_SECONDS"] = "1"
    try:
        stopping = lab.start("stopping")
    finally:
        lab.stack.env["RESPOOL_DRAIN_SECONDS"] = "60"
    created = lab.create(lab.model, 5)
    lab.held_by(created, stopping)
    assert lab.stack.stop("stopping") == 0
    assert "requeued for another worker" in lab.stack.log("stopping")
    lab.start("next")
    statuses = wait_until_ended(lab.sdk, created, timeout=60)
    assert set(statuses.values()) == {"completed"}
    for response_id in created:
        check_ended(lab.sdk, response_id)


def test_a_response_whose_workers_keep_dying_is_given_up(lab: Lab) -> None:
    """After max_attempts workers died under it, the sweep ends the response failed instead of leaving it live."""
    lab.upstream.script(lab.model, {"first_delay": 300, "text": "never"})
    created = lab.create(lab.model, 1)
    victim = lab.start("victim")
    lab.held_by(created, victim)
    signal_process(lab.stack, "victim", KILL)
    lab.stack.env["RESPOOL_MAX_ATTEMPTS"] = "1"  # read by the sweep, in the workers
    try:
        lab.start("sweeper")
    finally:
        lab.stack.env["RESPOOL_MAX_ATTEMPTS"] = "3"
    assert wait_until_ended(lab.sdk, created, timeout=90) == {created[0]: "failed"}
    stored = check_ended(lab.sdk, created[0])
    assert stored["error"]["message"] == GIVEN_UP


def test_a_conversation_gets_each_response_once_whatever_dies(lab: Lab) -> None:
    """Responses on a conversation whose worker is killed -9 mid-output run again on another and
    complete: the conversation holds each one's input and output exactly once (DESIGN.md §11)."""
    conversation = lab.sdk.conversations.create(
        items=[{"type": "message", "role": "user", "content": "start"}]  # type: ignore[list-item]
    )
    talking = f"{lab.model}-conversation"
    text = " ".join(f"w{n}" for n in range(30))
    lab.upstream.script(talking, {"text": text, "delay": 0.1})
    doomed = lab.start("doomed")
    created = [
        lab.sdk.responses.create(
            model=talking, input=f"q{n}", conversation=conversation.id, background=True
        ).id
        for n in range(5)
    ]
    lab.held_by(created, doomed)
    lab.streamed(created)
    lab.start("survivor")
    signal_process(lab.stack, "doomed", KILL)
    statuses = wait_until_ended(lab.sdk, created, timeout=120)
    assert set(statuses.values()) == {"completed"}  # nobody saw their output: each ran again
    items = list(lab.sdk.conversations.items.list(conversation.id, order="asc", limit=100))
    texts = [part.text for item in items for part in item.content]  # type: ignore[union-attr]
    assert len({item.id for item in items}) == len(items) == 1 + 2 * len(created)
    assert sorted(texts[1:]) == sorted([f"q{n}" for n in range(5)] + [text] * 5)
    for response_id in created:
        check_ended(lab.sdk, response_id)


def test_an_api_killed_mid_create_leaves_each_response_on_its_conversation_once(
    lab: Lab, backing: Servers
) -> None:
    """An API killed -9 while creates on one conversation are in flight: whatever each had reached
    (nothing recorded; recorded but not queued; queued, its client never told), every response
    recorded on the conversation ends, and the conversation holds the input and output of each that
    completed exactly once, and nothing of the others (DESIGN.md §11)."""
    conversation = lab.sdk.conversations.create()
    talking = f"{lab.model}-mid-create"
    lab.upstream.script(talking, {"text": "the answer"})
    lab.start("steady")
    doomed_url = lab.stack.start_api("api-doomed")

    def create(n: int) -> str | None:
        with make_sdk(doomed_url, "unused") as doomed:
            try:
                return doomed.responses.create(
                    model=talking, input=f"q{n}", conversation=conversation.id, background=True
                ).id
            except (openai.APIConnectionError, openai.InternalServerError):
                return None  # the API died under it

    with ThreadPoolExecutor(32) as pool:  # many creates in flight, at every step, when the API dies
        answers = [pool.submit(create, n) for n in range(120)]
        wait_for(lambda: len(_on_conversation(backing, conversation.id)) >= 20, timeout=60, what="creates")
        signal_process(lab.stack, "api-doomed", KILL)
        answered = {future.result() for future in answers} - {None}
    recorded = _on_conversation(backing, conversation.id)
    assert answered <= set(recorded) and len(answered) < 120  # some creates were cut
    statuses = wait_until_ended(lab.sdk, recorded, timeout=180)
    completed = {rid for rid, status in statuses.items() if status == "completed"}
    inputs = {rid: lab.sdk.responses.input_items.list(rid).data[0].content[0].text for rid in recorded}  # type: ignore[union-attr]
    # Iterating the page follows its cursor through every page.
    items = list(lab.sdk.conversations.items.list(conversation.id, order="asc", limit=100))
    texts = [part.text for item in items for part in item.content]  # type: ignore[union-attr]
    assert len({item.id for item in items}) == len(items) == 2 * len(completed)
    assert sorted(text for text in texts if text != "the answer") == sorted(inputs[rid] for rid in completed)
    assert texts.count("the answer") == len(completed)
    ended = sorted(statuses.values())
    print(f"API killed mid-create: {len(recorded)} recorded, {len(answered)} answered; ended {ended}")


def _on_conversation(backing: Servers, conversation_id: str) -> list[str]:
    engine = create_engine(backing.database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            found = conn.execute(
                text("SELECT id FROM response WHERE conversation_id = :c"), {"c": conversation_id}
            )
            return list(found.scalars())
    finally:
        engine.dispose()


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


def test_a_response_cancelled_after_its_worker_popped_it_appends_nothing_from_its_ticket(lab: Lab) -> None:
    """A worker frozen inside its pops is handed a response, started on its behalf with its ticket
    (the row as recorded), and the response is cancelled before the worker thaws: Postgres records
    the cancel; the queue no longer holds it to remove. Thawed, the worker starts it from its ticket, calling the upstream
    while Postgres refuses the attempt: nothing the upstream sent reaches the stream, which ends as
    the cancelled row."""
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
    assert types == ["response.created", "response.queued", "response.failed"]
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
    tests/api/test_outages.py): the queue holds a response with no row. The worker that takes it,
    from its ticket or not, runs nothing, lets the queue drop it, and leaves its keys to expire."""
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
    assert response_id not in QueueView(lab.redis, queue_name).held()
    assert lab.redis.exists(queued_key(response_id), ticket_key(response_id)) == 0
    assert [fields[b"t"] for _, fields in lab.redis.xrange(events_key(response_id))] == [b"response.created"]


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_a_ticketed_response_taken_before_its_row_landed_waits_for_it(lab: Lab, background: bool) -> None:
    """A create queues a ticketed response while it inserts the row (DESIGN.md §2.1): a worker that
    takes it first calls the upstream at once and records the end only after the row came and it
    claimed it; a background one tells nothing before that (it may have been cancelled meanwhile),
    a foreground one streams as the upstream answers."""
    lab.upstream.script(lab.model, {"text": "late but whole"})
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
            await store.insert_response(conn, row, [])

    lab.start(f"early-{background}")
    asyncio.run(enqueue())
    wait_for(lambda: lab.upstream.requests(lab.model), timeout=30, what="the upstream called before the row")
    time.sleep(1.0)  # the claim meets no row meanwhile (it is asked again and again)
    told = [fields[b"t"] for _, fields in lab.redis.xrange(events_key(response_id))]
    assert (told == [b"response.created"]) == background
    asyncio.run(insert())
    wait_for(lambda: _has_ended(lab.redis, response_id), timeout=30, what="the response to end")
    stored = lab.sdk.responses.retrieve(response_id)
    assert (stored.status, stored.output_text) == ("completed", "late but whole")
    assert len(lab.upstream.requests(lab.model)) == 1  # called once, before the row, never again
