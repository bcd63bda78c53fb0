"""A worker's Prometheus metrics: a scrape after known traffic counts exactly that traffic (issue 5)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import make_sdk, own_stack
from tests.support.faults import wait_until_ended
from tests.support.stack import Servers, Stack, free_port, wait_for
from tests.support.upstream_process import ScriptedUpstream

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def measured(
    backing: Servers, upstream: ScriptedUpstream, session_dir: Path, stack: Stack
) -> Iterator[tuple[Stack, str]]:
    """An API and one worker serving its metrics on a port of its own; upstream failures are not retried."""
    port = free_port()
    running = own_stack(
        backing,
        session_dir,
        "worker-metrics",
        RESPOOL_UPSTREAM_URL=upstream.url,
        RESPOOL_UPSTREAM_RETRIES="0",
        RESPOOL_WORKER_METRICS_PORT=str(port),
    )
    running.start_api()
    running.start_worker()
    yield running, f"http://127.0.0.1:{port}/metrics"
    running.stop_all()


def _scrape(url: str) -> Samples | None:
    try:
        answer = httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
    }


def test_a_scrape_counts_what_the_worker_did(
    measured: tuple[Stack, str], upstream: ScriptedUpstream, model: str
) -> None:
    """Two completed, one failed by its upstream, one cancelled: finishes, errors, cancels, timings and events add up."""
    running, url = measured
    upstream.script(f"{model}-ok", {"text": "one two three"})
    upstream.script(f"{model}-bad", {"status": 500})
    upstream.script(f"{model}-slow", {"text": " ".join(f"w{n}" for n in range(200)), "delay": 0.1})
    with make_sdk(running.url, "unused") as sdk:
        ids = [sdk.responses.create(model=f"{model}-ok", input="x", background=True).id for _ in range(2)]
        ids.append(sdk.responses.create(model=f"{model}-bad", input="x", background=True).id)
        slow = sdk.responses.create(model=f"{model}-slow", input="x", background=True).id
        upstream.stats(until_active=1, timeout=30)
        sdk.responses.cancel(slow)
        wait_until_ended(sdk, [*ids, slow], timeout=60)
        # Every event but the two the API writes at create (response.created, response.queued).
        worker_events = sum(len(list(sdk.responses.retrieve(rid, stream=True))) - 2 for rid in [*ids, slow])
    samples = wait_for(
        lambda: (s := _scrape(url)) and s[("respool_responses_in_flight", ())] == 0 and s, timeout=30
    )

    def value(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    assert value("respool_responses_finished_total", status="completed") == 2
    assert value("respool_responses_finished_total", status="failed") == 1
    assert value("respool_upstream_errors_total", kind="http_500") == 1
    assert value("respool_cancels_total") == 1
    assert value("respool_response_seconds_count") == 3
    assert value("respool_time_to_first_event_seconds_count") == 2  # the failed one streamed nothing
    assert value("respool_events_total") == worker_events
