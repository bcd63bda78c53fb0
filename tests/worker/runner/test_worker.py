"""The worker process: many responses at once on one event loop, with RQ's registries kept true."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from rq import Queue
from rq.registry import FinishedJobRegistry, StartedJobRegistry

from tests.conftest import make_sdk, own_stack
from tests.support.faults import wait_until_ended
from tests.support.stack import Servers, Stack, wait_for
from tests.support.upstream_process import ScriptedUpstream

pytestmark = [pytest.mark.integration, pytest.mark.once]

HELD = 200


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
        with make_sdk(running.url, "unused") as sdk, ThreadPoolExecutor(16) as pool:
            created = list(
                pool.map(
                    lambda n: sdk.responses.create(model=model, input="x", background=True).id, range(150)
                )
            )
            assert set(wait_until_ended(sdk, created, timeout=90).values()) == {"completed"}
        assert "lease lost" not in running.log("worker")
    finally:
        running.stop_all()
