"""A Redis outage within RESPOOL_REDIS_OUTAGE_SECONDS fails no response.

Redis is SIGKILLed under load and started again on its AOF ten seconds later (longer than a lease
lives, and than a worker's deadline): the workers keep generating and hold what they cannot append,
take their lapsed leases back by compare-and-set on the attempt, and nobody takes their responses
over; streams followed through the SDK stay open across the outage (heartbeats) and go on where they
were. Every response then completes once, its stream gapless, its one attempt the only one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from redis import Redis

from tests.conftest import KEY_A, _env, make_sdk
from tests.support.outages import Restartable
from tests.support.stack import Stack, running_stack, wait_for
from worker.keys import attempt_key

pytestmark = [pytest.mark.integration, pytest.mark.faults]

OUTAGE_SECONDS = 10.0
FOLLOWED = POLLED = 20
SETTLE_SECONDS = 120.0


@pytest.fixture(scope="module")
def stack(servers: Restartable, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """An API and two workers; the synthetic model says a word every 0.1 s."""
    env = _env(
        servers,  # type: ignore[arg-type]  # has the two URLs Servers has
        RESPOOL_API_KEYS=f"{KEY_A}:tenant-a",
        RESPOOL_SYNTHETIC_DELAY_SECONDS="0.1",
        RESPOOL_REDIS_TIMEOUT_SECONDS="2",
        RESPOOL_SSE_HEARTBEAT_SECONDS="2",
    )
    with running_stack(env, tmp_path_factory.mktemp("redis-outage-logs"), "worker-1", "worker-2") as running:
        yield running


def words(count: int, tag: str) -> str:
    return " ".join(f"{tag}w{n}" for n in range(count))


def follow(sdk: openai.OpenAI, text: str, started: threading.Event) -> list[ResponseStreamEvent]:
    """A background response created with `stream=True`, read to its end."""
    events = []
    for event in sdk.responses.create(model="synthetic", input=text, background=True, stream=True):
        events.append(event)
        if event.type == "response.output_text.delta":
            started.set()
    return events


@pytest.fixture
def sdk(stack: Stack) -> Iterator[openai.OpenAI]:
    """The SDK as tenant A, for the stack's API; its connections closed afterwards."""
    with make_sdk(stack.url, KEY_A) as client:
        yield client


def test_a_redis_killed_for_ten_seconds_fails_no_response(
    servers: Restartable, stack: Stack, sdk: openai.OpenAI
) -> None:
    patient = sdk.with_options(timeout=90.0)
    sdk = sdk.with_options(timeout=10.0)
    texts = {f"f{n}": words(120 + 5 * n, f"f{n}") for n in range(FOLLOWED)}
    with ThreadPoolExecutor(FOLLOWED) as pool:
        starts = {tag: threading.Event() for tag in texts}
        followers = {tag: pool.submit(follow, patient, text, starts[tag]) for tag, text in texts.items()}
        polled = {
            f"p{n}": sdk.responses.create(
                model="synthetic", input=words(120 + 5 * n, f"p{n}"), background=True
            )
            for n in range(POLLED)
        }
        for tag, started in starts.items():
            assert started.wait(60), f"{tag}'s stream told no output"
        wait_for(
            lambda: all(sdk.responses.retrieve(r.id).status == "in_progress" for r in polled.values()),
            timeout=60,
            what="the polled responses to start",
        )
        servers.kill_redis()
        time.sleep(OUTAGE_SECONDS)
        servers.start_redis()
        streams = {tag: follower.result(timeout=SETTLE_SECONDS) for tag, follower in followers.items()}

    ids = [events[0].response.id for events in streams.values()]  # type: ignore[union-attr]
    for tag, events in streams.items():
        numbers = [event.sequence_number for event in events]
        assert numbers == list(range(len(events))), f"{tag}'s stream has a gap or a repeat"
        assert [event.type for event in events].count("response.completed") == 1
        assert events[-1].type == "response.completed", f"{tag} ended {events[-1].type}: {events[-1]}"
        assert events[-1].response.output_text.endswith(f'{texts[tag]}"')  # type: ignore[union-attr]

    def ended(response_id: str) -> openai.types.responses.Response | None:
        response = sdk.responses.retrieve(response_id)
        return None if response.status in {"queued", "in_progress"} else response

    for tag, created in polled.items():
        final = wait_for(lambda rid=created.id: ended(rid), timeout=SETTLE_SECONDS, interval=0.5, what=tag)
        assert final.status == "completed", f"{tag}: {final.error}"
        ids.append(created.id)
    for response_id in ids:  # each stored stream whole, with one end
        replay = list(sdk.responses.retrieve(response_id, stream=True))
        assert [event.sequence_number for event in replay] == list(range(len(replay)))
        assert [event.type for event in replay].count("response.completed") == 1
    assert servers.redis is not None
    with Redis.from_url(servers.redis_url) as redis:  # no worker took any of them over
        assert {int(redis.get(attempt_key(rid)) or 0) for rid in ids} == {1}
    for name in ("worker-1", "worker-2"):
        assert stack.processes[name].poll() is None
        assert "fenced" not in stack.log(name)


def test_past_the_bound_a_response_fails_saying_redis_was_unreachable(
    servers: Restartable, stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A worker whose RESPOOL_REDIS_OUTAGE_SECONDS (3) an outage outlasts ends its responses
    `failed`, saying Redis was unreachable for 3 s (no worker death is claimed), and their streams
    are told that end once Redis is back."""
    impatient = Stack(
        {
            **stack.env,
            "RESPOOL_QUEUE": stack.env["RESPOOL_QUEUE"] + "-impatient",
            "RESPOOL_REDIS_OUTAGE_SECONDS": "3",
        },
        tmp_path_factory.mktemp("redis-outage-impatient-logs"),
    )
    try:
        impatient.start_api()
        impatient.start_worker()
        base = make_sdk(impatient.url, KEY_A)
        sdk = base.with_options(timeout=10.0)
        created = [
            sdk.responses.create(model="synthetic", input=words(200, f"b{n}"), background=True)
            for n in range(2)
        ]
        wait_for(
            lambda: all(sdk.responses.retrieve(r.id).status == "in_progress" for r in created),
            timeout=60,
            what="the responses to start",
        )
        servers.kill_redis()
        time.sleep(8)
        servers.start_redis()
        for response in created:

            def ended(rid: str = response.id) -> openai.types.responses.Response | None:
                found = sdk.responses.retrieve(rid)
                return None if found.status in {"queued", "in_progress"} else found

            final = wait_for(ended, timeout=SETTLE_SECONDS, interval=0.5, what=f"{response.id} to end")
            assert final.status == "failed"
            assert final.error is not None and "could not reach its Redis for 3 s" in final.error.message
            told = wait_for(
                lambda rid=response.id: (
                    (events := list(sdk.responses.retrieve(rid, stream=True)))
                    and events[-1].type == "response.failed"
                    and events
                ),
                timeout=SETTLE_SECONDS,
                interval=1.0,
                what=f"{response.id}'s stream to tell its end",
            )
            assert [event.sequence_number for event in told] == list(range(len(told)))
        assert "stopped after it had started streaming" not in impatient.log("worker")
        base.close()
    finally:
        impatient.stop_all()
