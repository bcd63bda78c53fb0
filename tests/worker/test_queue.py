"""respool's response queue (worker/queue.py) on real Redis: what each step leaves in the queue's
keys, and the leases it takes and gives back."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from tests.support.stack import Servers
from worker.connections import blocking_client
from worker.events.lease import Leases
from worker.events.stream import Event, encode, entry_id, read_events
from worker.keys import (
    announce_key,
    cancel_key,
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
from worker.queue import TICKET_SECONDS, ResponseQueue, held_by_a_queue

pytestmark = pytest.mark.integration


@pytest.fixture
async def queue(redis: Redis) -> AsyncIterator[ResponseQueue]:
    name = f"test-queue-{uuid.uuid4().hex[:8]}"
    yield ResponseQueue(redis, name, deadline_seconds=8.0)
    keys = [
        queue_key(name),
        held_key(name),
        workers_key(name),
        taking_key(name, "w1"),
        taking_key(name, "w2"),
    ]
    await redis.delete(*keys)


@pytest.fixture
async def popper(backing: Servers) -> AsyncIterator[Redis]:
    client = blocking_client(backing.redis_url, 1.0, 5.0)
    yield client
    await client.aclose()


def _ids(count: int) -> list[str]:
    return [f"resp_q{uuid.uuid4().hex[:12]}" for _ in range(count)]


async def _waiting(redis: Redis, queue: ResponseQueue) -> list[str]:
    return [raw.decode() for raw in await redis.lrange(queue.key, 0, -1)]


async def _held(redis: Redis, queue: ResponseQueue) -> dict[str, float]:
    return {raw.decode(): score for raw, score in await redis.zrange(queue.held, 0, -1, withscores=True)}


async def test_an_enqueued_response_waits_with_its_first_events_and_secrets(
    redis: Redis, queue: ResponseQueue
) -> None:
    (rid,) = _ids(1)
    first = [encode({"type": "response.created"}, 0), encode({"type": "response.queued"}, 1)]
    await queue.enqueue(rid, first, (b"sealed", 60))
    assert await _waiting(redis, queue) == [rid]
    assert await _held(redis, queue) == {rid: math.inf}
    assert [event.type for event in await read_events(redis, rid)] == ["response.created", "response.queued"]
    assert await redis.get(secrets_key(rid)) == b"sealed" and 0 < await redis.ttl(secrets_key(rid)) <= 60
    assert await queue.depth() == 1
    assert await redis.get(queued_key(rid)) == queue.name.encode()  # whatever the queue, a sweep sees it held
    assert await held_by_a_queue(redis, [rid, "resp_none"]) == [True, False]
    assert not await redis.exists(observed_key(rid))  # nobody follows it yet: it may start over
    await redis.delete(secrets_key(rid), f"respool:{{{rid}}}:events")


async def test_a_response_its_create_relays_is_observed_from_its_enqueue(
    redis: Redis, queue: ResponseQueue
) -> None:
    """A foreground or streamed create follows its response from the first event: it is marked
    observed in the enqueue's own step, as a relay's first read would mark it."""
    (rid,) = _ids(1)
    await queue.enqueue(rid, [encode({"type": "response.created"}, 0)], is_relayed=True)
    assert await redis.get(observed_key(rid)) == b"1"
    assert [event.type for event in await read_events(redis, rid)] == ["response.created"]
    await redis.delete(observed_key(rid), f"respool:{{{rid}}}:events")


async def test_a_taken_response_is_leased_with_a_deadline_and_leaves_the_taking_list(
    redis: Redis, queue: ResponseQueue, popper: Redis
) -> None:
    first, second = _ids(2)
    await queue.enqueue(first, [], ticket=b'{"row": 1}')
    await queue.enqueue(second, [])
    assert 0 < await redis.ttl(ticket_key(first)) <= TICKET_SECONDS
    assert await queue.take(popper, "w1", 1.0) == first  # in order
    assert await redis.lrange(taking_key(queue.name, "w1"), 0, -1) == [first.encode()]
    leases = Leases(redis, 6.0)
    started = await queue.start(leases, first, "w1")
    assert started is not None
    lease, newest, ticket, announced = started
    assert (lease.attempt, newest, ticket, announced) == (1, None, b'{"row": 1}', False)
    assert await redis.exists(ticket_key(first)) == 0  # taken: a later start reads the row
    assert await redis.get(lease_key(first)) == b"1:w1"
    assert await redis.llen(taking_key(queue.name, "w1")) == 0
    held = await _held(redis, queue)
    assert held[second] == math.inf and not math.isinf(held[first])
    # Another holder while the lease lives: none for it.
    assert await queue.start(leases, first, "w2") is None
    await queue.finished(leases, lease)
    assert first not in await _held(redis, queue)
    assert await held_by_a_queue(redis, [first, second]) == [False, True]
    assert await redis.exists(lease_key(first)) == 0
    assert await _waiting(redis, queue) == [second]
    await redis.delete(f"respool:{{{first}}}:attempt")


async def test_an_empty_queue_gives_nothing_after_the_wait(queue: ResponseQueue, popper: Redis) -> None:
    assert await queue.take(popper, "w1", 0.1) is None
    assert await queue.take_started(popper, Leases(popper, 6.0), "w1", 0.1) is None


async def test_a_take_that_starts_leases_what_it_popped_in_the_same_round_trip(
    redis: Redis, queue: ResponseQueue, popper: Redis
) -> None:
    """The pop and the start in one round trip (the start pipelined behind the blocking pop): the
    response leaves the taking list leased, with a deadline by Redis's clock and its ticket; one
    whose lease another holder keeps is popped and left for the normal start's wait."""
    first, second = _ids(2)
    leases = Leases(redis, 6.0)
    await queue.enqueue(first, [encode({"type": "response.created"}, 0)], ticket=b"row")
    await queue.enqueue(second, [])
    before = time.time()
    taken = await queue.take_started(popper, leases, "w1", 1.0)
    assert taken is not None
    response_id, started = taken
    assert response_id == first and started is not None
    assert (started.lease.attempt, started.ticket) == (1, b"row")
    assert started.newest is not None and started.newest[0] == b"0-1"
    assert await redis.get(lease_key(first)) == b"1:w1"
    assert await redis.llen(taking_key(queue.name, "w1")) == 0 and await redis.exists(ticket_key(first)) == 0
    deadline = (await _held(redis, queue))[first] / 1000
    assert before + queue.deadline_seconds - 1 < deadline < time.time() + queue.deadline_seconds + 1
    # Another holder's lease is alive: popped and out of the list, not started.
    await redis.set(lease_key(second), "7:w9", px=6000)
    assert await queue.take_started(popper, leases, "w2", 1.0) == (second, None)
    assert await redis.llen(taking_key(queue.name, "w2")) == 0
    assert await redis.get(lease_key(second)) == b"7:w9"
    await redis.delete(lease_key(second), f"respool:{{{first}}}:attempt", f"respool:{{{first}}}:events")


def _background_first() -> list[Event]:
    return [encode({"type": "response.created"}, 0), encode({"type": "response.queued"}, 1)]


async def test_a_take_tells_a_fresh_background_response_in_progress(
    redis: Redis, queue: ResponseQueue, popper: Redis
) -> None:
    """The `in_progress` a background create encoded beside its ticket is appended by the take that
    starts the response, under its new lease, and is the newest entry the take reports: the
    worker's own appends follow it (sequence 3)."""
    (rid,) = _ids(1)
    announce = encode({"type": "response.in_progress", "response": {"status": "in_progress"}}, 2).data
    await queue.enqueue(rid, _background_first(), ticket=b"row", announce=announce)
    assert 0 < await redis.ttl(announce_key(rid)) <= TICKET_SECONDS
    taken = await queue.take_started(popper, Leases(redis, 6.0), "w1", 1.0)
    assert taken is not None and taken[1] is not None
    started = taken[1]
    assert (started.announced, started.ticket) == (True, b"row")
    assert started.newest == (b"0-3", [b"t", b"response.in_progress", b"d", announce])
    told = await read_events(redis, rid)
    assert [(event.sequence_number, event.type) for event in told] == [
        (0, "response.created"),
        (1, "response.queued"),
        (2, "response.in_progress"),
    ]
    assert told[-1].data == announce
    assert await redis.exists(announce_key(rid), ticket_key(rid)) == 0
    await redis.delete(lease_key(rid), f"respool:{{{rid}}}:attempt", f"respool:{{{rid}}}:events")


@pytest.mark.parametrize("why", ["cancel requested", "no ticket", "stream moved on", "lease held"])
async def test_a_take_leaves_in_progress_to_the_worker_unless_the_response_is_fresh(
    redis: Redis, queue: ResponseQueue, popper: Redis, why: str
) -> None:
    """Only a fresh response is told `in_progress` by its take: not one whose cancel was asked
    before a worker took it (its worker's own first append hears of the cancel), nor one without
    its ticket, nor one whose stream holds more than its create's events, nor one another holder
    keeps; the announce key goes with the take whatever it did."""
    (rid,) = _ids(1)
    announce = encode({"type": "response.in_progress"}, 2).data
    first = _background_first()
    if why == "stream moved on":
        first.append(encode({"type": "response.in_progress"}, 2))
    await queue.enqueue(rid, first, ticket=None if why == "no ticket" else b"row", announce=announce)
    if why == "no ticket":  # a create never sends one without a ticket; a key left over is ignored
        await redis.set(announce_key(rid), announce, ex=TICKET_SECONDS)
    if why == "cancel requested":
        await redis.set(cancel_key(rid), "1")
    if why == "lease held":
        await redis.set(lease_key(rid), "7:w9", px=6000)
    taken = await queue.take_started(popper, Leases(redis, 6.0), "w1", 1.0)
    assert taken is not None and taken[0] == rid
    if why == "lease held":
        assert taken[1] is None
    else:
        assert taken[1] is not None and not taken[1].announced
        assert taken[1].newest is not None and taken[1].newest[0] == entry_id(len(first) - 1).encode()
    assert len(await read_events(redis, rid)) == len(first)
    assert await redis.exists(announce_key(rid)) == 0
    await redis.delete(
        lease_key(rid), cancel_key(rid), f"respool:{{{rid}}}:attempt", f"respool:{{{rid}}}:events"
    )


# It flushes the scripts of the Redis it runs on: never one that other sessions share (CI's second phase).
@pytest.mark.once
async def test_a_redis_that_forgot_its_scripts_still_queues_starts_and_finishes(
    redis: Redis, queue: ResponseQueue, popper: Redis
) -> None:
    """The enqueue, the start behind the pop and the finish are scripts sent by digest: a Redis that
    lost its scripts (restarted, or flushed them) gets them again, and the response is queued,
    started and finished."""
    (response_id,) = _ids(1)
    await redis.script_flush()
    await queue.enqueue(response_id, [encode({"type": "response.created"}, 0)], ticket=b"row")
    await redis.script_flush()
    leases = Leases(redis, 6.0)
    taken = await queue.take_started(popper, leases, "w1", 1.0)
    assert taken is not None
    assert taken[0] == response_id and taken[1] is not None and taken[1].ticket == b"row"
    assert await redis.llen(taking_key(queue.name, "w1")) == 0
    await redis.script_flush()
    await queue.finished(leases, taken[1].lease)
    assert response_id not in await _held(redis, queue)
    assert await redis.exists(lease_key(response_id), queued_key(response_id)) == 0
    await redis.delete(f"respool:{{{response_id}}}:attempt", f"respool:{{{response_id}}}:events")


async def test_a_finish_gives_back_only_its_own_lease(
    redis: Redis, queue: ResponseQueue, popper: Redis
) -> None:
    """A response that ends leaves what the queue holds whatever its lease; a lease that another
    attempt holds by now (this one expired and was taken over) is left to that attempt."""
    (response_id,) = _ids(1)
    await queue.enqueue(response_id, [])
    leases = Leases(redis, 6.0)
    taken = await queue.take_started(popper, leases, "w1", 1.0)
    assert taken is not None and taken[1] is not None
    await redis.set(lease_key(response_id), "2:w2", px=6000)  # taken over
    await queue.finished(leases, taken[1].lease)
    assert response_id not in await _held(redis, queue)
    assert not await redis.exists(queued_key(response_id))
    assert await redis.get(lease_key(response_id)) == b"2:w2"
    await redis.delete(lease_key(response_id), f"respool:{{{response_id}}}:attempt")


async def test_a_take_whose_start_fails_puts_what_it_popped_back(
    redis: Redis, queue: ResponseQueue, popper: Redis
) -> None:
    """Should the start behind the pop fail (here its ticket's key holds a hash), the popped
    response goes back to the front of the queue, not left in the taking list of a live worker."""
    (broken,) = _ids(1)
    await queue.enqueue(broken, [])
    await redis.hset(ticket_key(broken), "not", "a ticket")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await queue.take_started(popper, Leases(redis, 6.0), "w1", 1.0)
    assert await redis.llen(taking_key(queue.name, "w1")) == 0
    assert await _waiting(redis, queue) == [broken]
    await redis.delete(ticket_key(broken))


async def test_a_stopped_response_goes_back_to_the_front_and_its_lease_is_given_back(
    redis: Redis, queue: ResponseQueue, popper: Redis
) -> None:
    stopped, behind = _ids(2)
    await queue.enqueue(stopped, [])
    assert await queue.take(popper, "w1", 1.0) == stopped
    leases = Leases(redis, 6.0)
    started = await queue.start(leases, stopped, "w1")
    assert started is not None
    await queue.enqueue(behind, [])
    await queue.put_back(leases, started[0])
    assert await _waiting(redis, queue) == [stopped, behind]
    assert (await _held(redis, queue))[stopped] == math.inf
    assert await redis.exists(lease_key(stopped)) == 0
    await redis.delete(f"respool:{{{stopped}}}:attempt")


async def test_only_a_response_still_waiting_can_be_removed(
    redis: Redis, queue: ResponseQueue, popper: Redis
) -> None:
    waiting, taken = _ids(2)
    await queue.enqueue(taken, [])
    await queue.enqueue(waiting, [], ticket=b"{}", announce=b"{}")
    assert await queue.take(popper, "w1", 1.0) == taken
    assert await queue.remove_queued(waiting) is True
    assert await redis.exists(ticket_key(waiting), announce_key(waiting)) == 0
    assert await queue.remove_queued(taken) is False  # a worker has it: its cancel flag stops it
    assert await queue.remove_queued(waiting) is False
    assert await _waiting(redis, queue) == []
    assert await _held(redis, queue) == {taken: math.inf}
    assert await held_by_a_queue(redis, [waiting, taken]) == [False, True]


async def test_renewal_keeps_only_what_the_queue_holds_and_says_the_worker_is_alive(
    redis: Redis, queue: ResponseQueue
) -> None:
    running, gone = _ids(2)
    await redis.zadd(queue.held, {running: 1000})
    await queue.renew([running, gone], "w1", 30.0)
    held = await _held(redis, queue)
    assert set(held) == {running} and held[running] > 1000  # a response that left is not brought back
    assert await redis.zscore(queue.workers, "w1") is not None


async def test_a_worker_that_leaves_hands_back_what_it_was_taking(redis: Redis, queue: ResponseQueue) -> None:
    a, b, c = _ids(3)
    await redis.rpush(queue.key, c)
    await redis.rpush(taking_key(queue.name, "w1"), a, b)
    await queue.renew([], "w1", 30.0)
    await queue.leave("w1")
    assert await _waiting(redis, queue) == [a, b, c]
    assert await redis.zscore(queue.workers, "w1") is None


async def test_responses_an_earlier_release_queued_as_rq_jobs_are_taken_in(
    redis: Redis, queue: ResponseQueue
) -> None:
    """A rolling upgrade: ids waiting in RQ's list of the same queue name join the queue, in order,
    after what waits there already, held as waiting; RQ's list is left empty."""
    mine, old_a, old_b = _ids(3)
    await queue.enqueue(mine, [])
    await redis.rpush(f"rq:queue:{queue.name}", old_a, old_b)
    try:
        assert await queue.adopt() == 2
        assert await _waiting(redis, queue) == [mine, old_a, old_b]
        assert await _held(redis, queue) == dict.fromkeys([mine, old_a, old_b], math.inf)
        assert await held_by_a_queue(redis, [old_a, old_b]) == [True, True]
        assert await redis.exists(f"rq:queue:{queue.name}") == 0
        assert await queue.adopt() == 0
    finally:
        await redis.delete(f"rq:queue:{queue.name}")


async def test_a_response_a_worker_could_not_start_is_handed_back_once(
    redis: Redis, queue: ResponseQueue, popper: Redis
) -> None:
    """Popped, then its start failed: it goes back to the front of the queue, from the worker's
    taking list; a second hand-back (or one of a response already started) changes nothing."""
    popped, behind = _ids(2)
    await queue.enqueue(popped, [])
    assert await queue.take(popper, "w1", 1.0) == popped
    await queue.enqueue(behind, [])
    assert await queue.hand_back(popped, "w1") is True
    assert await queue.hand_back(popped, "w1") is False
    assert await _waiting(redis, queue) == [popped, behind]
    assert await redis.llen(taking_key(queue.name, "w1")) == 0
