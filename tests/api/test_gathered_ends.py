"""Gathered ends through the whole stack (worker/runner/ends.py; RESPOOL_GATHER_ENDS_MS): background
responses nobody follows live, ending within a window of one another, are recorded in one Postgres
transaction (one statement, as the worker's metrics count it), but the first two, which came alone;
each is polled as completed with its own output. A streamed background response and a foreground
one are never held: each ends in a transaction of its own."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from tests.conftest import make_sdk, own_stack
from tests.support.stack import Servers, Stack, free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gathering(backing: Servers, session_dir: Path, stack: Stack) -> Iterator[tuple[openai.OpenAI, str]]:
    """An API and a worker whose background ends wait up to a second for one another; the worker's
    metrics' address."""
    port = free_port()
    running = own_stack(
        backing,
        session_dir,
        "gathered-ends",
        RESPOOL_GATHER_ENDS_MS="1000",
        RESPOOL_WORKER_METRICS_PORT=str(port),
    )
    running.start_api()
    running.start_worker()
    with make_sdk(running.url, "unused") as sdk:
        yield sdk, f"http://127.0.0.1:{port}/metrics"
    running.stop_all()


def _transactions(backing: Servers, ids: list[str]) -> dict[str, str]:
    """The transaction that last wrote each response's row (`xmin`)."""
    engine = create_engine(backing.database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT id, xmin::text FROM response WHERE id = ANY(:ids)"), {"ids": ids}
            )
            return {row[0]: row[1] for row in rows}
    finally:
        engine.dispose()


def _gathered(url: str) -> tuple[float, float]:
    """The worker's gathered statements, and the ends they carried."""
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(httpx.get(url, timeout=5).text)
        for sample in family.samples
    }
    return samples["respool_gathered_ends_count"], samples["respool_gathered_ends_sum"]


def test_unfollowed_background_ends_are_recorded_together(
    gathering: tuple[openai.OpenAI, str], backing: Servers
) -> None:
    sdk, metrics = gathering
    before = _gathered(metrics)
    marker = uuid.uuid4().hex[:8]
    with ThreadPoolExecutor(6) as pool:
        polled = [
            pool.submit(sdk.responses.create, model="synthetic", input=f"{marker} {n}", background=True)
            for n in range(5)
        ]

        def streamed() -> str:
            events = list(
                sdk.responses.create(model="synthetic", input=f"{marker} s", background=True, stream=True)
            )
            assert events[-1].type == "response.completed"
            return events[-1].response.id

        followed = pool.submit(streamed)
        foreground = sdk.responses.create(model="synthetic", input=f"{marker} f")
        background_ids = [future.result().id for future in polled]
        streamed_id = followed.result()
    assert foreground.status == "completed"
    deadline = time.monotonic() + 30
    for n, response_id in enumerate(background_ids):
        while (done := sdk.responses.retrieve(response_id)).status != "completed":
            assert time.monotonic() < deadline, f"{response_id} still {done.status}"
            time.sleep(0.05)
        assert f"{marker} {n}" in done.output_text  # its own output
    written = _transactions(backing, [*background_ids, streamed_id, foreground.id])
    # The first two to end came alone, the third with company: it and the other two met in its window.
    together = Counter(written[response_id] for response_id in background_ids)
    assert sorted(together.values()) == [1, 1, 3]
    assert written[streamed_id] not in together
    assert written[foreground.id] not in together
    statements, ends = _gathered(metrics)
    assert (statements - before[0], ends - before[1]) == (1, 3)
