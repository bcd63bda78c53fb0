"""Back-pressure: above RESPOOL_MAX_QUEUE_DEPTH waiting responses, create answers 429 and records nothing."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import make_sdk, own_stack
from tests.support.stack import Servers, Stack, rows_with_metadata

pytestmark = pytest.mark.integration

LIMIT = 3


@pytest.fixture(scope="module")
def full_queue(backing: Servers, session_dir: Path, stack: Stack) -> Iterator[openai.OpenAI]:
    """An API whose queue no worker serves, limited to 3 waiting responses."""
    running = own_stack(backing, session_dir, "backpressure", RESPOOL_MAX_QUEUE_DEPTH=str(LIMIT))
    running.start_api()
    with make_sdk(running.url, "unused") as sdk:
        yield sdk
    running.stop_all()


def test_a_full_queue_answers_429_with_retry_after(full_queue: openai.OpenAI, backing: Servers) -> None:
    """Once the limit is reached a create is refused with 429 and retry-after, and nothing of it is recorded."""
    model = f"synthetic-{uuid.uuid4().hex[:6]}"
    for _ in range(LIMIT):
        full_queue.responses.create(model="synthetic", input="x", background=True)
    with pytest.raises(openai.RateLimitError) as caught:
        full_queue.responses.create(model="synthetic", input="x", background=True, metadata={"m": model})
    assert caught.value.code == "rate_limit_exceeded"
    assert int(caught.value.response.headers["retry-after"]) > 0
    assert "RESPOOL_MAX_QUEUE_DEPTH" in caught.value.message
    refused = rows_with_metadata(backing, model)
    assert refused == 0
