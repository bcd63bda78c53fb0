"""What a webhook delivery carries (worker/protocol/webhooks.py): OpenAI's event shape, signed so
that the SDK's verifier accepts it with any of the endpoint's secrets; the retry policy's bounds."""

from __future__ import annotations

import base64
from datetime import UTC, datetime

import openai
import pytest
from openai.types.webhooks import ResponseCompletedWebhookEvent

from worker.protocol import webhooks
from worker.protocol.webhooks import Endpoint, RetryPolicy

ONE = "whsec_" + base64.b64encode(b"one secret").decode()
TWO = "whsec_" + base64.b64encode(b"another secret").decode()


def test_an_event_signed_with_two_secrets_verifies_with_either() -> None:
    body = webhooks.event_body("evt_1", "response.completed", "resp_1", 1_800_000_000)
    sent = webhooks.headers("evt_1", body, [ONE, TWO])
    client = openai.OpenAI(api_key="unused")
    for secret in (ONE, TWO):
        event = client.webhooks.unwrap(body, sent, secret=secret)
        assert isinstance(event, ResponseCompletedWebhookEvent)
        assert (event.id, event.data.id, event.object) == ("evt_1", "resp_1", "event")
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(body, sent, secret="whsec_" + base64.b64encode(b"wrong").decode())
    stale = webhooks.headers("evt_1", body, [ONE], now=datetime(2020, 1, 1, tzinfo=UTC))
    with pytest.raises(openai.InvalidWebhookSignatureError):  # outside the SDK's 5-minute window
        client.webhooks.unwrap(body, stale, secret=ONE)


def test_the_event_type_of_each_end() -> None:
    assert [webhooks.event_type(s) for s in ("completed", "failed", "cancelled", "incomplete")] == list(
        webhooks.EVENT_TYPES
    )
    assert webhooks.event_type("in_progress") is None


def test_an_endpoint_wants_its_owners_and_events() -> None:
    everyone = Endpoint("all", "https://x", "E")
    some = Endpoint("b", "https://x", "E", frozenset({"tenant-b"}), frozenset({"response.completed"}))
    assert everyone.wants("tenant-a", "response.failed")
    assert some.wants("tenant-b", "response.completed")
    assert not some.wants("tenant-a", "response.completed") and not some.wants("tenant-b", "response.failed")


@pytest.mark.parametrize("value", ["", "plain-secret", "whsec_***not base64***"])
def test_a_secret_that_is_not_whsec_base64_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="SECRET_ENV"):
        webhooks.check_secrets(value, "SECRET_ENV")


def test_backoff_grows_is_capped_and_honours_retry_after() -> None:
    policy = RetryPolicy(base_seconds=2, cap_seconds=60, max_age_seconds=3600)
    for attempt in range(1, 12):
        wait = policy.backoff(attempt)
        assert 1 <= wait <= min(60, 2 * 2 ** (attempt - 1))
    assert max(policy.backoff(20) for _ in range(200)) > 30  # the ceiling grew to the cap
    assert policy.backoff(3, retry_after=7.5) == 7.5
    assert policy.backoff(3, retry_after=10_000) == 60
