"""The shortest path through every part: SDK → API → Redis/RQ → worker → upstream → Postgres."""

from __future__ import annotations

import openai
import pytest

from tests.support.stack import wait_for

pytestmark = pytest.mark.integration


def test_background_response_completes(client: openai.OpenAI, model: str) -> None:
    """A background response is queued at once, then polls through to completed with the upstream's text."""
    created = client.responses.create(model=model, input="ping", background=True)
    assert created.status == "queued"
    done = wait_for(
        lambda: (r := client.responses.retrieve(created.id)).status == "completed" and r, what="completed"
    )
    assert done.output_text == "Hello from the scripted upstream. You said: ping"
