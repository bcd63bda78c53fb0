"""Workers that die, freeze or stop under load: every response still ends exactly once (DESIGN.md §4)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from redis import Redis

from tests.conftest import _env, make_sdk
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
from tests.support.stack import Servers, Stack, wait_for
from tests.support.upstream_process import ScriptedUpstream
from worker.keys import events_key
from worker.recovery import GIVEN_UP
from worker.runner import WORKER_LOST

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def faults(backing: Servers, upstream: ScriptedUpstream, session_dir: Path, stack: Stack) -> Iterator[Stack]:
    """An API of this module's own; each test starts the workers it kills."""
    logs = session_dir / f"logs-faults-{uuid.uuid4().hex[:6]}"
    logs.mkdir()
    env = _env(
        backing, RESPOOL_UPSTREAM_URL=upstream.url, RESPOOL_UPSTREAM_API="chat", RESPOOL_DRAIN_SECONDS="60"
    )
    running = Stack(env, logs)  # the `stack` fixture has migrated this database
    running.start_api()
    yield running
    running.stop_all()


@pytest.fixture
def sdk(faults: Stack) -> Iterator[openai.OpenAI]:
    with make_sdk(faults.url, "unused") as client:
        yield client


@pytest.fixture
def redis(backing: Servers) -> Iterator[Redis]:
    with Redis.from_url(backing.redis_url) as connection:
        yield connection


@pytest.fixture
def workers(faults: Stack) -> Iterator[list[str]]:
    """The names of the worker processes a test started; all stopped after it."""
    started: list[str] = []
    yield started
    for name in started:
        if name in faults.processes:
            faults.stop(name, KILL)


def _start(faults: Stack, workers: list[str], name: str) -> str:
    """Start a worker and wait until it takes jobs (and a SIGTERM would drain it)."""
    faults.start_worker(name)
    workers.append(name)
    wait_for(lambda: "ready: taking responses" in faults.log(name), timeout=60, what=f"{name} to be ready")
    return name


def _create(sdk: openai.OpenAI, model: str, count: int) -> list[str]:
    return [sdk.responses.create(model=model, input="x", background=True).id for _ in range(count)]


def _has_output(redis: Redis, response_id: str) -> bool:
    return any(fields[b"t"].endswith(b".delta") for _, fields in redis.xrange(events_key(response_id)))


def test_kill_9_with_100_responses_in_flight(
    faults: Stack,
    sdk: openai.OpenAI,
    upstream: ScriptedUpstream,
    redis: Redis,
    workers: list[str],
    model: str,
) -> None:
    """A worker killed with 100 responses: those with no output yet run again to completion, those whose
    output reached clients fail saying the worker stopped; none stays live, every stream stays whole."""
    quiet, talking = f"{model}-quiet", f"{model}-talking"
    # The first run of each quiet response never gets an answer; the second does at once.
    upstream.script(
        quiet, {"times": 50, "first_delay": 300, "text": "never", "then": {"text": "quiet answer"}}
    )
    upstream.script(talking, {"text": " ".join(f"w{n}" for n in range(100)), "delay": 0.1})
    doomed = worker_name(redis, faults, _start(faults, workers, "doomed"))
    quiet_ids, talking_ids = _create(sdk, quiet, 50), _create(sdk, talking, 50)
    every = quiet_ids + talking_ids
    wait_for(lambda: set(lease_holders(redis, every).values()) == {doomed}, timeout=60, what="100 leases")
    wait_for(lambda: all(_has_output(redis, rid) for rid in talking_ids), timeout=30, what="output")
    _start(faults, workers, "survivor")
    killed_at = time.monotonic()
    signal_process(faults, "doomed", KILL)
    statuses = wait_until_ended(sdk, every, timeout=120)
    print(f"kill -9: 100 responses ended {time.monotonic() - killed_at:.1f} s after the kill")
    assert {statuses[rid] for rid in quiet_ids} == {"completed"}
    assert {statuses[rid] for rid in talking_ids} == {"failed"}
    for response_id in every:
        stored = check_ended(sdk, response_id)
        if response_id in talking_ids:
            assert stored["error"] == {"code": "server_error", "message": WORKER_LOST}
            # What had been streamed is kept, closed as incomplete: the stream and the record agree.
            (message,) = stored["output"]
            assert message["status"] == "incomplete"
            assert " ".join(f"w{n}" for n in range(100)).startswith(message["content"][0]["text"])
        else:
            assert stored["output"][0]["content"][0]["text"] == "quiet answer"
    assert len(upstream.requests(quiet)) == 100  # each quiet response was asked for exactly twice


def test_a_frozen_worker_writes_nothing_after_its_responses_were_taken_over(
    faults: Stack,
    sdk: openai.OpenAI,
    upstream: ScriptedUpstream,
    redis: Redis,
    workers: list[str],
    model: str,
) -> None:
    """SIGSTOP past the lease, takeover, SIGCONT: the zombie's later output is fenced out everywhere."""
    quiet, talking = f"{model}-quiet", f"{model}-talking"
    upstream.script(quiet, {"times": 10, "first_delay": 20, "text": "late", "then": {"text": "quiet answer"}})
    upstream.script(talking, {"text": " ".join(f"w{n}" for n in range(60)), "delay": 0.1})
    frozen = worker_name(redis, faults, _start(faults, workers, "frozen"))
    quiet_ids, talking_ids = _create(sdk, quiet, 10), _create(sdk, talking, 10)
    every = quiet_ids + talking_ids
    wait_for(lambda: set(lease_holders(redis, every).values()) == {frozen}, timeout=60, what="20 leases")
    wait_for(lambda: all(_has_output(redis, rid) for rid in talking_ids), timeout=30, what="output")
    signal_process(faults, "frozen", STOP)
    try:
        rescuer = worker_name(redis, faults, _start(faults, workers, "rescuer"))
        statuses = wait_until_ended(sdk, every, timeout=120)
    finally:
        signal_process(faults, "frozen", CONT)
    ended = {rid: check_ended(sdk, rid) for rid in every}
    # The zombie wakes with upstream streams still open; it must notice its leases are gone.
    wait_for(lambda: "lease lost" in faults.log("frozen"), timeout=30, what="the zombie to notice")
    for response_id in every:
        assert check_ended(sdk, response_id) == ended[response_id]  # unchanged after the zombie woke
    assert {statuses[rid] for rid in quiet_ids} == {"completed"}
    assert {statuses[rid] for rid in talking_ids} == {"failed"}
    fresh = _create(sdk, quiet, 1)  # the woken worker (or the rescuer) still serves new work
    assert wait_until_ended(sdk, fresh, timeout=60) == {fresh[0]: "completed"}
    assert rescuer


def test_rolling_restart_fails_no_response(
    faults: Stack,
    sdk: openai.OpenAI,
    upstream: ScriptedUpstream,
    redis: Redis,
    workers: list[str],
    model: str,
) -> None:
    """SIGTERM one worker after another under load: each drains what it runs, and every response completes."""
    upstream.script(model, {"text": " ".join(f"w{n}" for n in range(20)), "delay": 0.1})
    _start(faults, workers, "old-1")
    _start(faults, workers, "old-2")
    created = _create(sdk, model, 30)
    wait_for(
        lambda: sum(1 for h in lease_holders(redis, created).values() if h) >= 10, timeout=60, what="load"
    )
    _start(faults, workers, "new-1")
    assert faults.stop("old-1") == 0
    created += _create(sdk, model, 10)
    _start(faults, workers, "new-2")
    assert faults.stop("old-2") == 0
    created += _create(sdk, model, 10)
    statuses = wait_until_ended(sdk, created, timeout=120)
    assert set(statuses.values()) == {"completed"}
    for response_id in created:
        check_ended(sdk, response_id)


def test_a_drain_deadline_requeues_what_is_left(
    faults: Stack,
    sdk: openai.OpenAI,
    upstream: ScriptedUpstream,
    redis: Redis,
    workers: list[str],
    model: str,
) -> None:
    """Past the drain deadline a stopping worker puts responses without output back in the queue; another runs them."""
    upstream.script(model, {"times": 5, "first_delay": 300, "text": "never", "then": {"text": "late answer"}})
    faults.env["RESPOOL_DRAIN_SECONDS"] = "1"
    try:
        stopping = worker_name(redis, faults, _start(faults, workers, "stopping"))
    finally:
        faults.env["RESPOOL_DRAIN_SECONDS"] = "60"
    created = _create(sdk, model, 5)
    wait_for(lambda: set(lease_holders(redis, created).values()) == {stopping}, timeout=60, what="5 leases")
    assert faults.stop("stopping") == 0
    assert "requeued for another worker" in faults.log("stopping")
    _start(faults, workers, "next")
    statuses = wait_until_ended(sdk, created, timeout=60)
    assert set(statuses.values()) == {"completed"}
    for response_id in created:
        check_ended(sdk, response_id)


def test_a_response_whose_workers_keep_dying_is_given_up(
    faults: Stack,
    sdk: openai.OpenAI,
    upstream: ScriptedUpstream,
    redis: Redis,
    workers: list[str],
    model: str,
) -> None:
    """After max_attempts workers died under it, the sweep ends the response failed instead of leaving it live."""
    upstream.script(model, {"first_delay": 300, "text": "never"})
    faults.env["RESPOOL_MAX_ATTEMPTS"] = "1"  # read where the job is enqueued: by an API of its own
    try:
        url = faults.start_api("api-one-attempt")
    finally:
        faults.env["RESPOOL_MAX_ATTEMPTS"] = "3"
    workers.append("api-one-attempt")
    with make_sdk(url, "unused") as once:
        created = _create(once, model, 1)
    victim = worker_name(redis, faults, _start(faults, workers, "victim"))
    wait_for(lambda: lease_holders(redis, created)[created[0]] == victim, timeout=60, what="the lease")
    signal_process(faults, "victim", KILL)
    _start(faults, workers, "sweeper")
    assert wait_until_ended(sdk, created, timeout=90) == {created[0]: "failed"}
    stored = check_ended(sdk, created[0])
    assert stored["error"]["message"] == GIVEN_UP.format(attempts=1)
