"""The worker process: many responses at once on one event loop, with RQ's registries kept true."""

from __future__ import annotations

import base64
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from redis import Redis
from rq import Queue, Worker
from rq.job import Job, JobStatus
from rq.registry import FinishedJobRegistry, StartedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer

from tests.conftest import make_sdk, own_stack
from tests.support.faults import wait_until_ended
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
    rq_queue: Callable[[Stack], Queue],
) -> None:
    """One worker process streams 200 responses concurrently from a slow upstream, and RQ shows them running."""
    upstream.script(model, {"text": " ".join(["slow"] * 12), "delay": 0.5})
    with ThreadPoolExecutor(16) as pool:
        created = list(
            pool.map(
                lambda n: client.responses.create(model=model, input=f"n{n}", background=True), range(HELD)
            )
        )
    assert upstream.stats(until_active=HELD, timeout=60)["active"] == HELD
    queue = rq_queue(stack)
    running = set(StartedJobRegistry(queue=queue).get_job_ids())
    assert {response.id for response in created} <= running
    finished = FinishedJobRegistry(queue=queue)
    wait_for(
        lambda: {r.id for r in created} <= set(finished.get_job_ids()),
        timeout=90,
        what="all 200 jobs finished",
    )
    statuses = {client.responses.retrieve(response.id).status for response in created}
    assert statuses == {"completed"}


def test_jobs_name_the_job_function_by_a_path_every_release_resolves() -> None:
    """RQ keeps a job's function as a dotted path: new jobs, and jobs queued before the runner was a
    package, name `worker.runner.run_job`, which resolves to the job function."""
    from rq.utils import import_attribute

    from worker.queue import JOB_FUNCTION
    from worker.runner.attempt import run_job

    assert JOB_FUNCTION == "worker.runner.run_job"
    assert import_attribute(JOB_FUNCTION) is run_job


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


def test_a_response_that_ended_leaves_the_records_rq_would(
    client: openai.OpenAI,
    upstream: ScriptedUpstream,
    stack: Stack,
    model: str,
    rq_queue: Callable[[Stack], Queue],
) -> None:
    """The worker writes a finished job's RQ records itself, in one round trip: the job finished
    with a successful result, in the finished registry, out of the started one, with no execution
    left, and the worker's count of successful jobs up by one."""
    upstream.script(model, {"text": "done"})
    queue = rq_queue(stack)
    wait_for(lambda: Worker.all(queue=queue), timeout=30, what="the worker registered with RQ")
    workers = Worker.all(queue=queue)
    before = sum(worker.successful_job_count for worker in workers)
    response = client.responses.create(model=model, input="x", background=True)
    job = Job.fetch(response.id, connection=queue.connection, serializer=JSONSerializer)
    wait_for(lambda: job.get_status(refresh=True) == JobStatus.FINISHED, timeout=30, what="the job finished")
    assert client.responses.retrieve(response.id).status == "completed"
    assert response.id in FinishedJobRegistry(queue=queue).get_job_ids()
    assert response.id not in StartedJobRegistry(queue=queue).get_job_ids()
    result = job.latest_result()
    assert result is not None and result.type == Result.Type.SUCCESSFUL
    job.refresh()
    assert job.ended_at is not None and job.started_at is not None and job.ended_at >= job.started_at
    assert job.get_executions() == []
    for worker in workers:
        worker.refresh()
    assert sum(worker.successful_job_count for worker in workers) == before + 1


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
