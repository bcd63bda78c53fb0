"""The worker process: many responses at once on one event loop, the queue's records kept true."""

from __future__ import annotations

import base64
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from redis import Redis
from rq.job import Job

from tests.conftest import make_sdk, own_stack
from tests.support.faults import lease_holders, wait_until_ended, worker_name
from tests.support.queue import QueueView
from tests.support.stack import Servers, Stack, wait_for
from tests.support.upstream_process import ScriptedUpstream
from tests.support.webhook_receiver import Receiver

pytestmark = [pytest.mark.integration, pytest.mark.once]

HELD = 200
WEBHOOK_SECRET = "whsec_" + base64.b64encode(b"the worker tests' endpoint").decode()


def test_one_worker_holds_200_responses_at_once(
    client: openai.OpenAI,
    upstream: ScriptedUpstream,
    stack: Stack,
    model: str,
    queue_view: Callable[[Stack], QueueView],
) -> None:
    """One worker process streams 200 responses concurrently from a slow upstream; the queue holds
    them as running (with a deadline), each leased by that worker, and lets them go as they end."""
    upstream.script(model, {"text": " ".join(["slow"] * 12), "delay": 0.5})
    with ThreadPoolExecutor(16) as pool:
        created = list(
            pool.map(
                lambda n: client.responses.create(model=model, input=f"n{n}", background=True), range(HELD)
            )
        )
    assert upstream.stats(until_active=HELD, timeout=60)["active"] == HELD
    queue = queue_view(stack)
    ids = {response.id for response in created}
    assert ids <= queue.running()
    assert not ids & set(queue.waiting())
    holder = worker_name(queue.redis, stack, "worker")
    assert set(lease_holders(queue.redis, sorted(ids)).values()) == {holder}
    wait_for(lambda: not ids & set(queue.held()), timeout=90, what="all 200 responses out of the queue")
    statuses = {client.responses.retrieve(response.id).status for response in created}
    assert statuses == {"completed"}
    assert queue.taking(holder) == []


def test_responses_that_end_while_their_leases_are_renewed_are_not_told_lost(
    backing: Servers, session_dir: Path, stack: Stack, upstream: ScriptedUpstream, model: str
) -> None:
    """A worker renewing its leases every 20 ms while 150 responses end together: a lease given back
    by a response that ended during a renewal is not "lost" (that would fence a response that is
    already over, and say so in the log)."""
    running = own_stack(
        backing,
        session_dir,
        "renewals",
        RESPOOL_UPSTREAM_URL=upstream.url,
        RESPOOL_UPSTREAM_API="chat",
        RESPOOL_HEARTBEAT_SECONDS="0.02",
    )
    running.start_api()
    running.start_worker()
    try:
        upstream.script(model, {"text": "fine", "first_delay": 1.0})  # created first, ending together
        with make_sdk(running.url, "unused") as sdk:
            created = _created_in_background(sdk, model, 150)
            assert set(wait_until_ended(sdk, created, timeout=90).values()) == {"completed"}
        assert "lease lost" not in running.log("worker")
    finally:
        running.stop_all()


def test_a_response_leaves_no_record_in_the_queue_once_it_ended(
    client: openai.OpenAI,
    upstream: ScriptedUpstream,
    stack: Stack,
    model: str,
    queue_view: Callable[[Stack], QueueView],
) -> None:
    """A response waits in the queue, is held while it runs, and once it ended nothing of it is
    left in the queue (nor any RQ job of it: responses are no RQ jobs); its lease is given back."""
    queue = queue_view(stack)
    upstream.script(model, {"text": "done", "first_delay": 1.0})
    response = client.responses.create(model=model, input="x", background=True)
    wait_for(lambda: response.id in queue.running(), timeout=30, what="the response taken")
    wait_until_ended(client, [response.id], timeout=30)
    assert client.responses.retrieve(response.id).status == "completed"
    wait_for(lambda: response.id not in queue.held(), timeout=10, what="the response out of the queue")
    assert response.id not in queue.waiting()
    assert lease_holders(queue.redis, [response.id]) == {response.id: None}
    assert not queue.redis.exists(Job.key_for(response.id))


def test_deliveries_ending_while_executions_are_renewed_leave_no_job_records(
    backing: Servers, session_dir: Path, stack: Stack, upstream: ScriptedUpstream, model: str
) -> None:
    """A worker renewing its executions every 20 ms while 150 webhook deliveries end: RQ keeps no
    record of a delivery once it is sent (its row is the record), and no renewal that took a
    delivery as running writes its heartbeat after the end (that left a hash of one field, which
    RQ cannot read, behind for good)."""
    with Receiver.start() as receiver:
        running = own_stack(
            backing,
            session_dir,
            "delivery-renewals",
            RESPOOL_UPSTREAM_URL=upstream.url,
            RESPOOL_UPSTREAM_API="chat",
            RESPOOL_HEARTBEAT_SECONDS="0.02",
            RESPOOL_WEBHOOK_URL=receiver.url,
            RESPOOL_WEBHOOK_SECRET=WEBHOOK_SECRET,
            RESPOOL_OUTBOUND_ALLOWLIST=receiver.host_port,
        )
        running.start_api()
        running.start_worker()
        try:
            upstream.script(model, {"text": "fine"})
            with make_sdk(running.url, "unused") as sdk:
                wait_until_ended(sdk, _created_in_background(sdk, model, 150), timeout=90)
            sent = {delivery.headers["webhook-id"] for delivery in receiver.wait_for(150, timeout=90)}
            assert len(sent) == 150
            with Redis.from_url(backing.redis_url) as connection:
                keys = [Job.key_for(delivery_id) for delivery_id in sorted(sent)]
                wait_for(
                    lambda: connection.exists(*keys) == 0, timeout=30, what="the deliveries' job records gone"
                )
        finally:
            running.stop_all()


def _created_in_background(sdk: openai.OpenAI, model: str, count: int) -> list[str]:
    """The ids of `count` background responses, created 16 at a time."""
    with ThreadPoolExecutor(16) as pool:
        return list(
            pool.map(lambda _: sdk.responses.create(model=model, input="x", background=True).id, range(count))
        )
