"""Workers that die, freeze or stop under load: every response still ends exactly once (DESIGN.md §4)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import orjson
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from tests.conftest import make_sdk
from tests.support.faults import (
    CONT,
    KILL,
    STOP,
    check_ended,
    lease_holders,
    signal_process,
    wait_until_ended,
)
from tests.support.lab import Lab
from tests.support.stack import Servers, wait_for
from worker.keys import events_key, lease_key
from worker.runner.attempt import WORKER_LOST
from worker.runner.recovery import GIVEN_UP
from worker.translation.output import output_items
from worker.translation.replay import rebuild

# Each test starts and kills several processes: on a loaded 2-core machine that takes a while.
pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(300)]


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
    # The 50 first runs outlast the setup; the 25 runs again after the kill go at once (they took
    # another 30 s of the suite's longest file).
    lab.upstream.script(talking, {"times": 50, "text": text, "delay": 0.1, "then": {"text": text}})
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


def test_a_worker_killed_while_ends_wait_in_a_window_loses_none(lab: Lab) -> None:
    """Background responses whose ends wait in a gathering window (worker/runner/ends.py) when their
    worker is killed -9: nothing of them was recorded, nor told on their streams; each runs again on
    another worker and completes once, its stream whole."""
    lab.upstream.script(lab.model, {"text": "gathered answer"})
    doomed = "doomed"
    lab.start(doomed, env={"RESPOOL_GATHER_ENDS_MS": "1000"})  # the longest window there is
    with ThreadPoolExecutor(8) as pool:
        created = list(pool.map(lambda _: lab.create(lab.model, 1)[0], range(8)))
    # The first two ends came without company and were recorded at once; the third opened a window
    # of a second, and the rest joined it.
    wait_for(
        lambda: sum(lab.sdk.responses.retrieve(rid).status == "completed" for rid in created) >= 2,
        timeout=30,
        interval=0.01,
        what="the ends without company",
    )
    signal_process(lab.stack, doomed, KILL)
    lab.stack.processes[doomed].wait(10)
    waiting = [rid for rid in created if lab.sdk.responses.retrieve(rid).status != "completed"]
    assert len(waiting) >= 3, f"{len(waiting)} of 8 were waiting in the window"
    assert not any(_stream_ended(lab, rid) for rid in waiting)
    lab.start("survivor")
    assert set(wait_until_ended(lab.sdk, created, timeout=120).values()) == {"completed"}
    for response_id in created:
        stored = check_ended(lab.sdk, response_id)
        assert stored["output"][0]["content"][0]["text"] == "gathered answer"
    assert len(lab.upstream.requests(lab.model)) == len(created) + len(waiting)  # the waiting ones ran again


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


@pytest.mark.parametrize("reads", ["one", "apart"])
def test_an_end_committed_whose_last_append_was_lost_is_told_from_the_row(
    lab: Lab, backing: Servers, reads: str
) -> None:
    """A background response's model turn ends: its worker commits the end, then appends what the
    turn's last read brought with its terminal event (DESIGN.md §4): its whole answer when that came
    in one read (`one`), else its last word and the ends of its part and item (`apart`: a word every
    0.2 s, the words before it appended as they came). Here its lease is taken while the end's
    statement waits on the row, so that append is fenced out after the commit won. The response runs
    again: its next attempt finds the row ended and ends the stream from it, telling first what the
    stream had not told (all the output, or the rest of it). The stream adds up to the stored
    Response, and the model is asked once."""
    answer = "told from the row"
    if reads == "one":
        lab.upstream.script(lab.model, {"text": answer, "first_delay": 1.0, "together": True})
    else:
        lab.upstream.script(lab.model, {"text": answer, "delay": 0.2})
    worker = lab.start("committer")
    (response_id,) = lab.create(lab.model, 1)
    lab.held_by([response_id], worker)
    engine = create_engine(backing.database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn, conn.begin():
            conn.execute(text("SELECT 1 FROM response WHERE id = :id FOR UPDATE"), {"id": response_id})
            me = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            # The end's statement, waiting on this transaction's lock (read outside a transaction,
            # which would keep one snapshot of the activity).
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as watcher:
                blocked = text("SELECT count(*) FROM pg_stat_activity WHERE :me = ANY(pg_blocking_pids(pid))")
                wait_for(
                    lambda: watcher.execute(blocked, {"me": me}).scalar_one() > 0,
                    timeout=30,
                    what="the end's statement to wait on the row",
                )
            # the answer came; what its last read brought waits for the end (apart: the frame that
            # ends it, after its words: the item's end)
            assert _told(lab, response_id) == {"one": ("", False), "apart": (answer, False)}[reads]
            attempt = int(lab.redis.get(lease_key(response_id)).decode().partition(":")[0])
            # As a next attempt takes a lease that expired: this one's, for a second (then the sweep's).
            lab.redis.set(lease_key(response_id), f"{attempt + 1}:thief", px=1000)
    finally:
        engine.dispose()
    wait_for(lambda: "was fenced out" in lab.stack.log("committer"), timeout=30, what="the append fenced out")
    assert "lease lost" not in lab.stack.log("committer")  # fenced by its append, after its commit
    assert lab.sdk.responses.retrieve(response_id).status == "completed"
    wait_until_ended(lab.sdk, [response_id], timeout=60)
    wait_for(lambda: _stream_ended(lab, response_id), timeout=60, what="the stream to end")
    stored = check_ended(lab.sdk, response_id)
    events = [event.model_dump(mode="json") for event in lab.sdk.responses.retrieve(response_id, stream=True)]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == answer
    assert output_items(rebuild(events)) == stored["output"]
    assert len(lab.upstream.requests(lab.model)) == 1


def _told(lab: Lab, response_id: str) -> tuple[str, bool]:
    """The text the response's stream has told so far, and whether it told an item done."""
    told = [fields for _, fields in lab.redis.xrange(events_key(response_id))]
    deltas = [orjson.loads(f[b"d"])["delta"] for f in told if f[b"t"] == b"response.output_text.delta"]
    return "".join(deltas), any(f[b"t"] == b"response.output_item.done" for f in told)


def _stream_ended(lab: Lab, response_id: str) -> bool:
    newest = lab.redis.xrevrange(events_key(response_id), count=1)
    return bool(newest) and newest[0][1][b"t"] in (b"response.completed", b"response.failed")


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
