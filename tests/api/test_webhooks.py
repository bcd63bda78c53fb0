"""Webhooks (issue 19): a background response's end reaches its owner's endpoints, signed so that
the SDK's `client.webhooks.unwrap()` and the `standardwebhooks` package verify it, and retried
until the receiver acknowledges it."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from standardwebhooks import Webhook

from tests.conftest import KEY_A, KEY_B, make_sdk, own_stack
from tests.support.faults import wait_until_ended
from tests.support.stack import Servers, Stack, wait_for
from tests.support.upstream_process import ScriptedUpstream
from tests.support.webhook_receiver import Delivery, Receiver

pytestmark = pytest.mark.integration

OLD_SECRET = "whsec_" + base64.b64encode(b"the old secret, still accepted").decode()
NEW_SECRET = "whsec_" + base64.b64encode(b"the new secret, signing first").decode()
B_SECRET = "whsec_" + base64.b64encode(b"tenant b's own endpoint").decode()
ENDPOINT_CONCURRENCY = 2


@dataclass
class Hooked:
    stack: Stack
    a: openai.OpenAI
    b: openai.OpenAI
    everyone: Receiver  # RESPOOL_WEBHOOK_URL: every owner, every event
    b_only: Receiver  # respool.toml: tenant-b's completions only


@pytest.fixture(scope="module")
def hooked(backing: Servers, session_dir: Path, stack: Stack, upstream: ScriptedUpstream) -> Iterator[Hooked]:
    with Receiver.start() as everyone, Receiver.start() as b_only:
        config = session_dir / f"webhooks-{everyone.port}.toml"
        config.write_text(
            f'[webhooks.b-only]\nurl = "{b_only.url}"\nsecret_env = "TEST_B_WEBHOOK_SECRET"\n'
            'owners = ["tenant-b"]\nevents = ["response.completed"]\n'
        )
        running = own_stack(
            backing,
            session_dir,
            "webhooks",
            RESPOOL_API_KEYS=f"{KEY_A}:tenant-a,{KEY_B}:tenant-b",
            RESPOOL_UPSTREAM_URL=upstream.url,
            RESPOOL_UPSTREAM_API="chat",
            RESPOOL_CONFIG=str(config),
            RESPOOL_WEBHOOK_URL=everyone.url,
            RESPOOL_WEBHOOK_SECRET=f"{NEW_SECRET},{OLD_SECRET}",  # a rotation under way
            TEST_B_WEBHOOK_SECRET=B_SECRET,
            RESPOOL_OUTBOUND_ALLOWLIST=f"{everyone.host_port},{b_only.host_port}",
            RESPOOL_WEBHOOK_BACKOFF_SECONDS="0.2",
            RESPOOL_WEBHOOK_BACKOFF_MAX_SECONDS="1",
            RESPOOL_WEBHOOK_ENDPOINT_CONCURRENCY=str(ENDPOINT_CONCURRENCY),
        )
        running.start_api()
        running.start_worker()
        with make_sdk(running.url, KEY_A) as a, make_sdk(running.url, KEY_B) as b:
            yield Hooked(running, a, b, everyone, b_only)
        running.stop_all()


def verified(delivery: Delivery, secret: str) -> dict[str, object]:
    """The event, verified by the SDK's `unwrap` and by `standardwebhooks` (each raises if not)."""
    event = openai.OpenAI(api_key="unused").webhooks.unwrap(delivery.body, delivery.headers, secret=secret)
    Webhook(secret).verify(delivery.body, delivery.headers)
    return event.to_dict()


def events_for(receiver: Receiver, response_ids: set[str]) -> list[Delivery]:
    return [d for d in receiver.acknowledged() if json.loads(d.body)["data"]["id"] in response_ids]


def test_each_end_of_a_background_response_is_told_signed(
    hooked: Hooked, upstream: ScriptedUpstream, model: str
) -> None:
    upstream.script(f"{model}-ok", {"text": "fine"})
    upstream.script(f"{model}-bad", {"status": 400, "error": {"message": "no such thing"}})
    upstream.script(f"{model}-long", {"text": "one two", "finish_reason": "length"})  # cut by max_tokens
    upstream.script(f"{model}-slow", {"text": "slow " * 200, "delay": 0.2})
    a = hooked.a
    ended = {
        "response.completed": a.responses.create(model=f"{model}-ok", input="x", background=True).id,
        "response.failed": a.responses.create(model=f"{model}-bad", input="x", background=True).id,
        "response.incomplete": a.responses.create(
            model=f"{model}-long", input="x", background=True, max_output_tokens=2
        ).id,
    }
    slow = a.responses.create(model=f"{model}-slow", input="x", background=True).id
    wait_for(
        lambda: a.responses.retrieve(slow).status == "in_progress", timeout=30, what="the slow one to start"
    )
    a.responses.cancel(slow)
    ended["response.cancelled"] = slow
    foreground = a.responses.create(model=f"{model}-ok", input="x").id  # foreground: no event
    wait_until_ended(a, list(ended.values()), timeout=60)

    ids = {*ended.values(), foreground}
    wait_for(lambda: len(events_for(hooked.everyone, ids)) >= 4, timeout=30, what="four events")
    got = events_for(hooked.everyone, ids)
    assert len(got) == 4
    for delivery in got:
        for secret in (NEW_SECRET, OLD_SECRET):  # both verify while the secret is rotated
            event = verified(delivery, secret)
            assert ended[str(event["type"])] == event["data"]["id"]  # type: ignore[index]
            assert event["object"] == "event" and str(event["id"]).startswith("evt_")
            assert delivery.headers["webhook-id"] == event["id"]
    assert {json.loads(d.body)["type"] for d in got} == set(ended)
    assert not events_for(hooked.b_only, ids)  # tenant-b's endpoint hears nothing of tenant-a's


def test_an_owners_own_endpoint_gets_only_what_it_asked_for(
    hooked: Hooked, upstream: ScriptedUpstream, model: str
) -> None:
    upstream.script(f"{model}-ok", {"text": "fine"})
    upstream.script(f"{model}-bad", {"status": 400})
    done = hooked.b.responses.create(model=f"{model}-ok", input="x", background=True).id
    bad = hooked.b.responses.create(model=f"{model}-bad", input="x", background=True).id
    wait_until_ended(hooked.b, [done, bad], timeout=60)
    wait_for(lambda: len(events_for(hooked.everyone, {done, bad})) == 2, timeout=30, what="both events")
    wait_for(lambda: len(events_for(hooked.b_only, {done})) == 1, timeout=30, what="tenant-b's event")
    (only,) = events_for(hooked.b_only, {done, bad})  # completions only
    assert verified(only, B_SECRET)["type"] == "response.completed"
    with pytest.raises(Exception):  # noqa: B017, PT011 (the SDK's and the package's errors differ)
        verified(only, NEW_SECRET)


def test_a_receiver_that_fails_is_retried_with_the_same_id(
    hooked: Hooked, upstream: ScriptedUpstream, model: str
) -> None:
    upstream.script(model, {"text": "fine"})
    hooked.everyone.answers = [500, 503, 200]
    response_id = hooked.a.responses.create(model=model, input="x", background=True).id
    wait_for(lambda: len(events_for(hooked.everyone, {response_id})) == 1, timeout=60, what="the event")
    tried = [d for d in hooked.everyone.deliveries if json.loads(d.body)["data"]["id"] == response_id]
    assert [d.answered for d in tried] == [500, 503, 200]
    assert len({d.headers["webhook-id"] for d in tried}) == 1  # receivers deduplicate on it
    assert len({d.body for d in tried}) == 1
    for delivery in tried:
        verified(delivery, NEW_SECRET)  # each attempt signed at its own time
    shown = _deliveries(hooked.stack, response_id)
    (delivery,) = [d for d in shown if d["endpoint"] == "default"]
    assert delivery["status"] == "delivered" and delivery["attempts"] == 3
    assert [a["status_code"] for a in delivery["attempt_log"]] == [500, 503, 200]


def test_a_receiver_down_for_a_while_gets_every_event_once_up(
    hooked: Hooked, upstream: ScriptedUpstream, model: str
) -> None:
    upstream.script(model, {"text": "fine"})
    hooked.everyone.stop()
    try:
        created = [hooked.a.responses.create(model=model, input="x", background=True).id for _ in range(5)]
        wait_until_ended(hooked.a, created, timeout=60)
        wait_for(
            lambda: all(d["attempts"] >= 2 for rid in created for d in _deliveries(hooked.stack, rid)),
            timeout=60,
            what="failed attempts while the receiver is down",
        )
    finally:
        hooked.everyone.restart()
    wait_for(lambda: len(events_for(hooked.everyone, set(created))) == 5, timeout=60, what="every event")
    got = events_for(hooked.everyone, set(created))
    assert sorted(json.loads(d.body)["data"]["id"] for d in got) == sorted(created)


def test_a_slow_receiver_holds_back_only_its_own_deliveries(
    hooked: Hooked, upstream: ScriptedUpstream, model: str
) -> None:
    """The every-owner endpoint answers 3 s late: with two workers, at most
    RESPOOL_WEBHOOK_ENDPOINT_CONCURRENCY of its deliveries are in flight at once (the bound is the
    fleet's), and before its backlog is through, tenant-b's own endpoint hears b's end and a
    foreground response completes (the slow receiver holds no response slot, and no other endpoint
    waits behind it)."""
    upstream.script(model, {"text": "fine"})
    slow = hooked.everyone
    hooked.stack.start_worker("worker-2")
    slow.delay, slow.max_active = 3.0, slow.active
    try:
        backlog = [hooked.a.responses.create(model=model, input="x", background=True).id for _ in range(8)]
        wait_until_ended(hooked.a, backlog, timeout=60)
        wait_for(lambda: slow.active >= 1, timeout=30, what="the slow receiver answering")
        told_b = hooked.b.responses.create(model=model, input="x", background=True).id
        wait_for(lambda: events_for(hooked.b_only, {told_b}), timeout=30, what="tenant-b's event")
        assert hooked.a.responses.create(model=model, input="x").status == "completed"
        assert len(events_for(slow, set(backlog))) < len(backlog)  # its backlog is not through yet
    finally:
        slow.delay = 0.0
        hooked.stack.stop("worker-2")
    every = {*backlog, told_b}
    wait_for(
        lambda: len(events_for(slow, every)) == len(every), timeout=120, what="the slow endpoint's backlog"
    )
    assert 1 <= slow.max_active <= ENDPOINT_CONCURRENCY


def _deliveries(stack: Stack, response_id: str) -> list[dict[str, object]]:
    """`respool deliveries`, the operators' view."""
    shown = subprocess.run(
        [sys.executable, "-m", "api", "deliveries", response_id],
        env=stack.env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    found: list[dict[str, object]] = json.loads(shown.stdout)
    return found


def test_200_responses_ending_at_once_each_tell_their_own_owner(
    hooked: Hooked, upstream: ScriptedUpstream, model: str
) -> None:
    """Two owners, 100 background responses each, ending together: the every-owner endpoint hears
    each end exactly once (a duplicate only as a retry with the same id), tenant-b's own endpoint
    exactly tenant-b's."""
    upstream.script(model, {"text": "fine", "first_delay": 1.0})  # created first, ending together
    a_ids = {hooked.a.responses.create(model=model, input="x", background=True).id for _ in range(100)}
    b_ids = {hooked.b.responses.create(model=model, input="x", background=True).id for _ in range(100)}
    wait_until_ended(hooked.a, sorted(a_ids), timeout=120)
    wait_until_ended(hooked.b, sorted(b_ids), timeout=120)
    every = a_ids | b_ids
    wait_for(lambda: len(events_for(hooked.everyone, every)) >= 200, timeout=120, what="200 events")
    wait_for(lambda: len(events_for(hooked.b_only, every)) >= 100, timeout=120, what="tenant-b's 100")
    heard = [json.loads(d.body) for d in events_for(hooked.everyone, every)]
    by_response: dict[str, set[str]] = {}
    for event in heard:
        by_response.setdefault(event["data"]["id"], set()).add(event["id"])
    assert set(by_response) == every and all(len(ids) == 1 for ids in by_response.values())
    assert {json.loads(d.body)["data"]["id"] for d in events_for(hooked.b_only, every)} == b_ids


def test_a_cancel_sent_to_two_api_processes_is_told_once(
    hooked: Hooked, upstream: ScriptedUpstream, model: str
) -> None:
    upstream.script(model, {"text": "slow " * 200, "delay": 0.2})
    second = hooked.stack.start_api("api-2")
    try:
        with make_sdk(second, KEY_A) as other:
            response_id = hooked.a.responses.create(model=model, input="x", background=True).id
            wait_for(lambda: hooked.a.responses.retrieve(response_id).status == "in_progress", timeout=30)
            with ThreadPoolExecutor(2) as pool:
                for done in [pool.submit(sdk.responses.cancel, response_id) for sdk in (hooked.a, other)]:
                    assert done.result().status == "cancelled"
            wait_for(lambda: events_for(hooked.everyone, {response_id}), timeout=30, what="the event")
            wait_until_ended(hooked.a, [response_id], timeout=30)
    finally:
        hooked.stack.stop("api-2")
    (recorded,) = [d for d in _deliveries(hooked.stack, response_id) if d["endpoint"] == "default"]
    assert (recorded["event_type"], recorded["status"]) == ("response.cancelled", "delivered")
    (told,) = [d for d in hooked.everyone.deliveries if json.loads(d.body)["data"]["id"] == response_id]
    assert verified(told, NEW_SECRET)["id"] == recorded["id"]
