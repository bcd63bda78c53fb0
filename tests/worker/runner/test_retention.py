"""Retention (DESIGN.md §2.7): finished streams expire, stored responses past retention are swept."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import make_sdk, own_stack
from tests.support.stack import Servers, Stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.faults]

STREAM_TTL_SECONDS = 1
RETENTION_SECONDS = 12


@pytest.fixture(scope="module")
def short_lived(backing: Servers, session_dir: Path, stack: Stack) -> Iterator[openai.OpenAI]:
    """An API and a worker that keep finished events 1 s and stored responses 12 s."""
    running = own_stack(
        backing,
        session_dir,
        "retention",
        RESPOOL_STREAM_TTL_SECONDS=str(STREAM_TTL_SECONDS),
        RESPOOL_RETENTION_DAYS=str(RETENTION_SECONDS / 86400),
    )
    running.start_api()
    running.start_worker()
    with make_sdk(running.url, "unused") as sdk:
        yield sdk
    running.stop_all()


def _expired(sdk: openai.OpenAI, response_id: str, starting_after: int | None) -> str | None:
    """The 400's param once the stream has expired, else None."""
    try:
        if starting_after is None:
            list(sdk.responses.retrieve(response_id, stream=True))
        else:
            list(sdk.responses.retrieve(response_id, stream=True, starting_after=starting_after))
    except openai.BadRequestError as error:
        return error.param
    return None


@pytest.mark.parametrize("starting_after", [None, 3])
def test_an_expired_stream_is_an_explicit_error(
    short_lived: openai.OpenAI, starting_after: int | None
) -> None:
    """Once a finished response's events expire, streaming it (from any offset) is a 400, never an empty success."""
    response = short_lived.responses.create(model="synthetic", input="x")
    assert response.status == "completed"
    assert wait_for(lambda: _expired(short_lived, response.id, starting_after), timeout=10) == "stream"
    assert short_lived.responses.retrieve(response.id).status == "completed"  # the stored response remains


def test_stored_responses_past_retention_are_swept(short_lived: openai.OpenAI) -> None:
    """A stored response finished longer ago than the retention is deleted, with its input items."""
    response = short_lived.responses.create(model="synthetic", input="x")

    def is_gone() -> bool:
        try:
            short_lived.responses.retrieve(response.id)
        except openai.NotFoundError:
            return True
        return False

    wait_for(is_gone, timeout=RETENTION_SECONDS + 30, interval=0.5, what="the retention sweep")
    with pytest.raises(openai.NotFoundError):
        short_lived.responses.input_items.list(response.id)
