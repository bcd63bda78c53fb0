"""Retention (DESIGN.md §2.7): finished streams expire, stored responses past retention are swept."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from redis import Redis
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from tests.conftest import make_sdk, own_stack
from tests.support.stack import Servers, Stack, wait_for
from tests.support.webhook_receiver import Receiver
from worker.keys import events_key
from worker.postgres.store import async_url

pytestmark = [pytest.mark.integration, pytest.mark.faults]

STREAM_TTL_SECONDS = 1
RETENTION_SECONDS = 12
SECRET = "whsec_" + base64.b64encode(b"retention").decode()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with Receiver.start() as running:
        yield running


@pytest.fixture(scope="module")
def short_lived_stack(
    backing: Servers, session_dir: Path, stack: Stack, receiver: Receiver
) -> Iterator[Stack]:
    """An API and a worker that keep finished events 1 s, and stored responses and webhook
    deliveries 12 s."""
    running = own_stack(
        backing,
        session_dir,
        "retention",
        RESPOOL_STREAM_TTL_SECONDS=str(STREAM_TTL_SECONDS),
        RESPOOL_RETENTION_DAYS=str(RETENTION_SECONDS / 86400),
        RESPOOL_WEBHOOK_URL=receiver.url,
        RESPOOL_WEBHOOK_SECRET=SECRET,
        RESPOOL_OUTBOUND_ALLOWLIST=receiver.host_port,
    )
    running.start_api()
    running.start_worker()
    yield running
    running.stop_all()


@pytest.fixture(scope="module")
def short_lived(short_lived_stack: Stack) -> Iterator[openai.OpenAI]:
    with make_sdk(short_lived_stack.url, "unused") as sdk:
        yield sdk


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


@pytest.mark.parametrize("starting_after", [None, 3, 100_000])
def test_an_expired_stream_is_an_explicit_error(
    short_lived: openai.OpenAI, starting_after: int | None, backing: Servers
) -> None:
    """Once a finished response's events expire, streaming it (from any offset) is a 400, never an
    empty success; replaying it past its end meanwhile (100 000) does not keep it."""
    response = short_lived.responses.create(model="synthetic", input="x")
    assert response.status == "completed"
    try:
        assert wait_for(lambda: _expired(short_lived, response.id, starting_after), timeout=10) == "stream"
    except AssertionError as exc:  # say what Redis still holds of it (each key's type and ms to live)
        with Redis.from_url(backing.redis_url) as redis:
            held = {
                key: (redis.type(key), redis.pttl(key)) for key in redis.scan_iter(match=f"*{response.id}*")
            }
            events = redis.xrange(events_key(response.id))
        raise AssertionError(f"{response.id} still held: {held}; its events: {events}") from exc
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


def _deliveries_of(stack: Stack, response_id: str) -> int:
    engine = create_engine(async_url(stack.env["RESPOOL_DATABASE_URL"]), poolclass=NullPool)
    try:
        with engine.connect() as conn:
            found = conn.execute(
                text(
                    "SELECT count(*) FROM webhook_delivery d LEFT JOIN webhook_attempt a "
                    "ON a.delivery_id = d.id WHERE d.response_id = :id"
                ),
                {"id": response_id},
            )
            return int(found.scalar_one())
    finally:
        engine.dispose()


def test_webhook_deliveries_past_retention_are_swept(
    short_lived: openai.OpenAI, short_lived_stack: Stack, receiver: Receiver
) -> None:
    """A delivered webhook's delivery and its attempts are deleted once past the retention, as the
    response they told of is (by a sweep of their own: no key ties them to it)."""
    response = short_lived.responses.create(model="synthetic", input="x", background=True)
    wait_for(
        lambda: any(json.loads(d.body)["data"]["id"] == response.id for d in receiver.acknowledged()),
        timeout=30,
        what="the webhook",
    )
    assert _deliveries_of(short_lived_stack, response.id) == 1  # the delivery, with its one attempt
    wait_for(
        lambda: _deliveries_of(short_lived_stack, response.id) == 0,
        timeout=RETENTION_SECONDS + 30,
        interval=0.5,
        what="the retention sweep",
    )
