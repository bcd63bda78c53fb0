"""Two API processes and two workers on one Redis and Postgres (issue 5): work spreads, streams move
between API processes, and an API process that dies loses no response."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from tests.conftest import make_sdk, own_stack
from tests.support.faults import KILL, check_ended, lease_holders, wait_until_ended, worker_name
from tests.support.stack import Servers, Stack, wait_for
from tests.support.upstream_process import ScriptedUpstream

pytestmark = [pytest.mark.integration, pytest.mark.faults]


@pytest.fixture(scope="module")
def pair(
    backing: Servers, upstream: ScriptedUpstream, session_dir: Path, stack: Stack
) -> Iterator[tuple[Stack, dict[str, str]]]:
    """API processes `api-1` and `api-2`, workers `worker-1` and `worker-2`, on a queue of their own."""
    running = own_stack(backing, session_dir, "topology", RESPOOL_UPSTREAM_URL=upstream.url)
    urls = {name: running.start_api(name) for name in ("api-1", "api-2")}
    for name in ("worker-1", "worker-2"):
        running.start_worker(name)
    yield running, urls
    running.stop_all()


def test_background_work_spreads_over_both_workers(
    pair: tuple[Stack, dict[str, str]], backing: Servers, upstream: ScriptedUpstream, model: str
) -> None:
    """Responses created through both API processes are run by both workers (seen as their leases'
    holders while they run), and all complete."""
    upstream.script(model, {"text": " ".join(f"w{n}" for n in range(10)), "delay": 0.1})
    stack, urls = pair
    with Redis.from_url(backing.redis_url) as redis:
        names = {worker_name(redis, stack, name) for name in ("worker-1", "worker-2")}
        with make_sdk(urls["api-1"], "unused") as one, make_sdk(urls["api-2"], "unused") as two:
            created = [
                sdk.responses.create(model=model, input="x", background=True).id for sdk in (one, two) * 10
            ]
            ran: set[str] = set()

            def all_seen_running() -> bool:
                ran.update(holder for holder in lease_holders(redis, created).values() if holder)
                return ran == names

            wait_for(all_seen_running, timeout=30, interval=0.05, what="both workers running responses")
            assert set(wait_until_ended(one, created, timeout=60).values()) == {"completed"}


def test_killing_an_api_process_loses_no_response(
    pair: tuple[Stack, dict[str, str]], upstream: ScriptedUpstream, model: str
) -> None:
    """kill -9 of the API process a client streamed through: every response still completes, and the
    client resumes its stream through the other API process, gapless."""
    upstream.script(model, {"text": " ".join(f"w{n}" for n in range(30)), "delay": 0.1})
    stack, urls = pair
    with make_sdk(urls["api-1"], "unused") as doomed, make_sdk(urls["api-2"], "unused") as other:
        created = [doomed.responses.create(model=model, input="x", background=True).id for _ in range(10)]
        stream = doomed.responses.retrieve(created[0], stream=True)
        seen = [next(stream) for _ in range(6)]
        stack.stop("api-1", KILL)
        rest = list(
            other.responses.retrieve(created[0], stream=True, starting_after=seen[-1].sequence_number)
        )
        assert [event.sequence_number for event in seen + rest] == list(range(len(seen) + len(rest)))
        assert rest[-1].type == "response.completed"
        assert set(wait_until_ended(other, created, timeout=60).values()) == {"completed"}
        for response_id in created:
            check_ended(other, response_id)
