"""Webhooks (DESIGN.md §12): what a background response's end tells its owner's endpoints,
and how a delivery is signed and retried. Pure: no I/O.

- Events: `response.completed`, `response.failed`, `response.cancelled`, `response.incomplete`, one
  per background response's end, in OpenAI's shape `{id: "evt_…", object: "event", created_at,
  type, data: {id: "resp_…"}}` (the SDK's `Response*WebhookEvent`).
- Signed per Standard Webhooks (the `standardwebhooks` package): `webhook-id` (the event's id, the
  same on every retry), `webhook-timestamp` (the attempt's time), `webhook-signature: v1,<base64
  HMAC-SHA256 of id.timestamp.body>`, one signature per secret the endpoint has (two while a secret
  is rotated: a receiver holding either verifies). Secrets are `whsec_<base64>`, as the SDK's
  `client.webhooks.unwrap()` reads them.
- Retries: exponential backoff with full jitter (`backoff`), the receiver's `retry-after` honoured on
  429 and 503 (within the cap), for up to `max_age` after the event; then the delivery is given up.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import orjson
from standardwebhooks import Webhook

EVENT_TYPES = ("response.completed", "response.failed", "response.cancelled", "response.incomplete")
SECRET_PREFIX = "whsec_"


@dataclass(frozen=True)
class Endpoint:
    """An endpoint the operator configured: where, with which secrets, for whom and what."""

    name: str
    url: str
    secret_env: str  # the env var holding its secret(s), comma-separated while rotating
    owners: frozenset[str] | None = None  # None: every owner
    events: frozenset[str] = field(default_factory=lambda: frozenset(EVENT_TYPES))

    def wants(self, owner: str, event_type: str) -> bool:
        return (self.owners is None or owner in self.owners) and event_type in self.events


def event_type(status: str) -> str | None:
    """The event a response ending with `status` sends (None for a status that is no end)."""
    kind = f"response.{status}"
    return kind if kind in EVENT_TYPES else None


def event_body(event_id: str, kind: str, response_id: str, created_at: int) -> str:
    """The event as sent: its JSON text, the same bytes on every attempt."""
    event = {
        "id": event_id,
        "object": "event",
        "created_at": created_at,
        "type": kind,
        "data": {"id": response_id},
    }
    return orjson.dumps(event).decode()


def check_secrets(value: str, where: str) -> list[str]:
    """The secrets an endpoint's env var holds (comma-separated); `ValueError` naming `where` unless
    each is a `whsec_` secret of base64."""
    secrets = [secret.strip() for secret in value.split(",") if secret.strip()]
    if not secrets:
        raise ValueError(f"{where} is empty: set it to the endpoint's whsec_ secret")
    for secret in secrets:
        if not secret.startswith(SECRET_PREFIX):
            raise ValueError(f"{where}: a webhook secret starts with {SECRET_PREFIX!r}")
        try:
            Webhook(secret)
        except Exception as exc:
            raise ValueError(f"{where}: not a {SECRET_PREFIX}<base64> secret") from exc
    return secrets


def headers(event_id: str, body: str, secrets: Sequence[str], now: datetime | None = None) -> dict[str, str]:
    """The Standard Webhooks headers of one attempt: a signature per secret."""
    at = now or datetime.now(tz=UTC)
    signatures = " ".join(Webhook(secret).sign(event_id, at, body) for secret in secrets)
    return {
        "content-type": "application/json",
        "webhook-id": event_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": signatures,
    }


@dataclass(frozen=True)
class RetryPolicy:
    """When a failed delivery is tried again: `base * 2**(attempt-1)` seconds at most `cap`, fully
    jittered; never past `max_age` seconds after the event."""

    base_seconds: float = 5.0
    cap_seconds: float = 3600.0
    max_age_seconds: float = 3 * 24 * 3600.0

    def backoff(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds before the attempt after number `attempt` (from 1)."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.cap_seconds)
        ceiling = min(self.cap_seconds, self.base_seconds * 2 ** min(attempt - 1, 30))
        return random.uniform(self.base_seconds / 2, max(self.base_seconds / 2, ceiling))
