"""Webhooks whatever dies (issue 19): a worker killed with deliveries in flight, and one killed
while its response runs; every end is told, duplicates only as retries with the same webhook-id."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import make_sdk, own_stack
from tests.support.faults import KILL, signal_process, wait_until_ended
from tests.support.stack import Servers, Stack, wait_for
from tests.support.upstream_process import ScriptedUpstream
from tests.support.webhook_receiver import Receiver

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(300)]

SECRET = "whsec_" + base64.b64encode(b"faults").decode()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with Receiver.start() as running:
        yield running


@pytest.fixture(scope="module")
def faulty(
    backing: Servers, session_dir: Path, stack: Stack, upstream: ScriptedUpstream, receiver: Receiver
) -> Iterator[Stack]:
    """An API of this module's own, an endpoint for every owner; each test starts the workers it kills."""
    running = own_stack(
        backing,
        session_dir,
        "webhook-faults",
        RESPOOL_UPSTREAM_URL=upstream.url,
        RESPOOL_UPSTREAM_API="chat",
        RESPOOL_WEBHOOK_URL=receiver.url,
        RESPOOL_WEBHOOK_SECRET=SECRET,
        RESPOOL_OUTBOUND_ALLOWLIST=receiver.host_port,
        RESPOOL_WEBHOOK_BACKOFF_SECONDS="0.2",
        RESPOOL_WEBHOOK_BACKOFF_MAX_SECONDS="1",
        RESPOOL_WEBHOOK_CONNECT_SECONDS="1",
        RESPOOL_WEBHOOK_TIMEOUT_SECONDS="5",  # an attempt lasts at most 11 s, a claim holds 16
    )
    running.start_api()
    yield running
    running.stop_all()


def _start(stack: Stack, name: str) -> None:
    stack.start_worker(name)


def _heard(
    receiver: Receiver, response_ids: set[str], *, acknowledged: bool = True
) -> list[dict[str, object]]:
    deliveries = receiver.acknowledged() if acknowledged else list(receiver.deliveries)
    events = [(json.loads(d.body), d.headers["webhook-id"]) for d in deliveries]
    return [{**event, "webhook-id": hook} for event, hook in events if event["data"]["id"] in response_ids]


def _one_id_per_response(heard: list[dict[str, object]]) -> dict[str, set[object]]:
    ids: dict[str, set[object]] = {}
    for event in heard:
        ids.setdefault(str(event["data"]["id"]), set()).add(event["webhook-id"])  # type: ignore[index]
    return ids


def test_a_worker_killed_with_deliveries_in_flight(
    faulty: Stack, receiver: Receiver, upstream: ScriptedUpstream, model: str
) -> None:
    upstream.script(model, {"text": "fine"})
    receiver.delay = 3.0  # each delivery's answer is slow: the kill comes while they are in flight
    try:
        with make_sdk(faulty.url, "unused") as sdk:
            _start(faulty, "doomed")
            before = receiver.started
            created = {sdk.responses.create(model=model, input="x", background=True).id for _ in range(10)}
            wait_until_ended(sdk, sorted(created), timeout=60)
            wait_for(lambda: receiver.started - before >= 5, timeout=30, what="deliveries in flight")
            signal_process(faulty, "doomed", KILL)
            receiver.delay = 0.0
            _start(faulty, "survivor")
            wait_for(
                lambda: len(_one_id_per_response(_heard(receiver, created))) == 10,
                timeout=120,
                what="every event",
            )
    finally:
        receiver.delay = 0.0
        for name in ("doomed", "survivor"):
            if name in faulty.processes:
                faulty.stop(name, KILL)
    ids = _one_id_per_response(_heard(receiver, created, acknowledged=False))
    assert all(len(hooks) == 1 for hooks in ids.values())  # a repeat is a retry: the same webhook-id


def test_a_response_taken_over_after_its_worker_died_is_told_once(
    faulty: Stack, receiver: Receiver, upstream: ScriptedUpstream, model: str
) -> None:
    upstream.script(model, {"text": " ".join(f"w{n}" for n in range(40)), "delay": 0.1})
    try:
        with make_sdk(faulty.url, "unused") as sdk:
            _start(faulty, "doomed")
            created = {sdk.responses.create(model=model, input="x", background=True).id for _ in range(3)}
            wait_for(
                lambda: all(sdk.responses.retrieve(rid).status == "in_progress" for rid in created),
                timeout=30,
                what="the responses to run",
            )
            signal_process(faulty, "doomed", KILL)
            _start(faulty, "survivor")
            statuses = wait_until_ended(sdk, sorted(created), timeout=120)
            wait_for(lambda: len(_heard(receiver, created)) >= 3, timeout=60, what="three events")
    finally:
        for name in ("doomed", "survivor"):
            if name in faulty.processes:
                faulty.stop(name, KILL)
    heard = _heard(receiver, created, acknowledged=False)
    assert len(heard) == 3 and {event["data"]["id"] for event in heard} == created  # type: ignore[index]
    assert {str(event["type"]) for event in heard} == {f"response.{status}" for status in statuses.values()}
