"""Prometheus metrics: a scrape after known traffic counts exactly that traffic (issue 5)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import make_sdk, own_stack
from tests.support.stack import Servers, Stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def idle_api(backing: Servers, session_dir: Path, stack: Stack) -> Iterator[Stack]:
    """An API of its own whose queue no worker serves, so its traffic and its queue are known."""
    running = own_stack(backing, session_dir, "metrics")
    running.start_api()
    yield running
    running.stop_all()


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, by name and labels."""
    answer = httpx.get(url + "/metrics", timeout=10)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
    }


def test_a_scrape_counts_the_traffic_it_saw(idle_api: Stack) -> None:
    """3 creates, 2 unknown ids and 1 bad request appear as such, by route template; the queue holds the 3."""
    with make_sdk(idle_api.url, "unused") as sdk:
        for _ in range(3):
            sdk.responses.create(model="synthetic", input="x", background=True)
        for _ in range(2):
            with pytest.raises(openai.NotFoundError):
                sdk.responses.retrieve("resp_unknown")
        with pytest.raises(openai.BadRequestError):
            sdk.responses.create(model="synthetic", input="x", temperature=9)
    samples = _samples(idle_api.url)

    def answers(route: str, method: str, status: int) -> float:
        labels = (("method", method), ("route", route), ("status", str(status)))
        return samples.get(("respool_http_requests_total", labels), 0.0)

    assert answers("/v1/responses", "POST", 200) == 3
    assert answers("/v1/responses", "POST", 400) == 1
    assert answers("/v1/responses/{response_id}", "GET", 404) == 2
    assert samples[("respool_queue_depth", ())] == 3
