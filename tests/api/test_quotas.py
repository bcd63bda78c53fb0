"""Per-owner quotas (issue 7): a request rate and a number of open streams, kept in Redis so that
two API processes enforce them together, each refusal a 429 with `retry-after` that records
nothing; and what they do while Redis is unreachable."""

from __future__ import annotations

import math
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import make_sdk, own_stack
from tests.support.quotas import live_stream_slots, stream_slot_expiries
from tests.support.stack import Servers, Stack, free_port, rows_with_metadata, wait_for

pytestmark = pytest.mark.integration

RATE = 12  # a minute: one request every 5 s once the minute is spent
STREAMS = 2
SESSION = uuid.uuid4().hex[:8]  # quotas live in the shared Redis: owners of this session's own
TENANTS = ["rate-a", "rate-b", "other", "streams", "ends-ended", "ends-left", "ends-replayed", "crash"]
# Of a background create no worker takes: it stays queued, and its stream open.
BACKGROUND: dict[str, Any] = {"model": "m", "input": "x", "background": True}


def _key(tenant: str) -> str:
    return f"sk-{tenant}"


def _owner(tenant: str) -> str:
    return f"{tenant}-{SESSION}"


def _auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {_key(tenant)}"}


def _env(**extra: str) -> dict[str, str]:
    return {
        "RESPOOL_API_KEYS": ",".join(f"{_key(tenant)}:{_owner(tenant)}" for tenant in TENANTS),
        "RESPOOL_RATE_LIMIT_PER_MINUTE": str(RATE),
        "RESPOOL_MAX_STREAMS_PER_KEY": str(STREAMS),
        "RESPOOL_UPSTREAM_URL": "http://127.0.0.1:9/v1",
        **extra,
    }


@pytest.fixture(scope="module")
def replicas(backing: Servers, session_dir: Path, stack: Stack) -> Iterator[tuple[Stack, str, str]]:
    """Two API processes on one Redis and Postgres, with small quotas and no worker."""
    running = own_stack(backing, session_dir, "quotas", **_env())
    one, two = running.start_api("api-1"), running.start_api("api-2")
    yield running, one, two
    running.stop_all()


def _assert_refused(answer: httpx.Response, setting: str, longest_wait: int) -> None:
    """`answer` is OpenAI's 429 for a rate limit, naming `setting`, its retry-after a real wait."""
    assert answer.status_code == 429, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == ("requests", "rate_limit_exceeded", None)
    assert setting in error["message"]
    assert 1 <= int(answer.headers["retry-after"]) <= longest_wait
    assert answer.headers["x-request-id"].startswith("req_")


def _assert_rate_limited(answer: httpx.Response) -> None:
    _assert_refused(answer, "RESPOOL_RATE_LIMIT_PER_MINUTE", math.ceil(60 / RATE))


def _spend(http: httpx.Client, url: str, tenant: str) -> tuple[int, httpx.Response]:
    """Requests of `tenant` until one is refused: how many were served, and the refusal."""
    for served in range(3 * RATE):
        answer = http.get(f"{url}/v1/models", headers=_auth(tenant))
        if answer.status_code != 200:
            return served, answer
    raise AssertionError(f"{3 * RATE} requests in a row were served")


def test_requests_past_the_rate_are_429_on_every_replica(replicas: tuple[Stack, str, str]) -> None:
    """Once an owner has spent its minute on one API process, the other refuses it too, with 429
    rate_limit_exceeded and the seconds until a request is allowed; other owners, /healthz and
    /metrics are untouched."""
    _, one, two = replicas
    with httpx.Client(timeout=30) as http:
        for _ in range(2 * RATE):
            assert http.get(f"{one}/healthz").status_code == 200  # counts against nobody
        served, refusal = _spend(http, one, "rate-a")
        assert served >= RATE  # the whole minute may be spent at once
        _assert_rate_limited(refusal)
        _assert_rate_limited(http.get(f"{two}/v1/models", headers=_auth("rate-a")))
        _assert_rate_limited(
            http.get(f"{two}/v1/responses/resp_polled", headers=_auth("rate-a"))
        )  # api/hot.py
        assert http.get(f"{two}/v1/models", headers=_auth("other")).status_code == 200
        assert http.get(f"{two}/metrics").status_code == 200


def test_the_sdk_waits_out_retry_after_and_is_served(
    replicas: tuple[Stack, str, str], backing: Servers
) -> None:
    """A refused create records nothing; the openai SDK, retrying as it does by default, waits the
    retry-after it was given and is then served, by the other API process."""
    _, one, two = replicas
    marker = uuid.uuid4().hex
    body = {**BACKGROUND, "metadata": {"m": marker}}
    with httpx.Client(timeout=30) as http:
        _spend(http, one, "rate-b")
        _assert_rate_limited(http.post(f"{two}/v1/responses", json=body, headers=_auth("rate-b")))
    assert rows_with_metadata(backing, marker) == 0
    with make_sdk(two, _key("rate-b")).with_options(max_retries=2) as sdk:
        raw = sdk.responses.with_raw_response.create(**body)
    assert raw.retries_taken >= 1
    assert raw.parse().status == "queued"
    assert rows_with_metadata(backing, marker) == 1


def test_streams_past_the_limit_are_429_and_record_nothing(
    replicas: tuple[Stack, str, str], backing: Servers
) -> None:
    """With as many streams open as its limit allows (one on each API process), an owner's create
    with stream=true, or replay with stream=true, is a 429 that records nothing, while its other
    requests and other owners' streams go on; once one stream closes, the next is served."""
    _, one, two = replicas
    marker = uuid.uuid4().hex
    with make_sdk(one, _key("streams")) as first, make_sdk(two, _key("streams")) as second:
        held = [sdk.responses.create(**BACKGROUND, stream=True) for sdk in (first, second)]
        response_id = next(held[0]).response.id  # type: ignore[union-attr]
        next(held[1])
        with pytest.raises(openai.RateLimitError) as created:
            first.responses.create(**BACKGROUND, stream=True, metadata={"m": marker})
        _assert_refused(created.value.response, "RESPOOL_MAX_STREAMS_PER_KEY", 60)  # type: ignore[arg-type]
        assert rows_with_metadata(backing, marker) == 0
        with pytest.raises(openai.RateLimitError) as replayed:
            second.responses.retrieve(response_id, stream=True)
        _assert_refused(replayed.value.response, "RESPOOL_MAX_STREAMS_PER_KEY", 60)  # type: ignore[arg-type]
        assert second.responses.retrieve(response_id).status == "queued"
        with make_sdk(two, _key("other")) as other, other.responses.create(**BACKGROUND, stream=True) as own:
            assert next(own).type == "response.created"
        held[0].close()
        wait_for(
            lambda: live_stream_slots(backing.redis_url, _owner("streams")) == STREAMS - 1,
            what="the closed stream's slot to be given back",
        )
        with second.responses.create(**BACKGROUND, stream=True) as again:
            assert next(again).type == "response.created"
        held[1].close()


@pytest.mark.parametrize("end", ["ended", "left", "replayed"])
def test_a_stream_gives_its_slot_back_however_it_ends(
    replicas: tuple[Stack, str, str], backing: Servers, end: str
) -> None:
    """A stream's slot comes back when the stream reaches its terminal event, when its client
    leaves, and when a replay of a finished response has been sent."""
    _, one, _ = replicas
    owner = _owner(f"ends-{end}")
    with make_sdk(one, _key(f"ends-{end}")) as sdk:
        if end == "replayed":
            finished = sdk.responses.create(**BACKGROUND)
            sdk.responses.cancel(finished.id)
            assert [event.type for event in sdk.responses.retrieve(finished.id, stream=True)][-1] == (
                "response.failed"
            )
        else:
            stream = sdk.responses.create(**BACKGROUND, stream=True)
            created = next(stream)
            assert live_stream_slots(backing.redis_url, owner) == 1
            if end == "ended":
                sdk.responses.cancel(created.response.id)  # type: ignore[union-attr]
                assert [event.type for event in stream][-1] == "response.failed"
            else:
                stream.close()
    wait_for(lambda: live_stream_slots(backing.redis_url, owner) == 0, what="the slot to be given back")


def test_the_slots_of_a_killed_api_process_lapse(replicas: tuple[Stack, str, str], backing: Servers) -> None:
    """An API process renews the slots of its streams past their lease while it lives; killed with
    -9 it gives none back, yet they lapse after the lease and the owner can stream again."""
    running, one, _ = replicas
    owner = _owner("crash")
    doomed = running.start_api("api-doomed")
    with make_sdk(doomed, _key("crash")).with_options(timeout=10) as sdk:
        streams = [sdk.responses.create(**BACKGROUND, stream=True) for _ in range(STREAMS)]
        try:
            for stream in streams:
                next(stream)
            taken = max(stream_slot_expiries(backing.redis_url, owner))
            wait_for(lambda: min(stream_slot_expiries(backing.redis_url, owner)) > taken, what="a renewal")
            running.stop("api-doomed", signal.SIGKILL)
        finally:
            for stream in streams:
                stream.close()
    wait_for(lambda: live_stream_slots(backing.redis_url, owner) == 0, timeout=60, what="the slots to lapse")
    with make_sdk(one, _key("crash")) as sdk, sdk.responses.create(**BACKGROUND, stream=True) as stream:
        assert next(stream).type == "response.created"


@pytest.fixture(scope="module")
def without_redis(backing: Servers, session_dir: Path, stack: Stack) -> Iterator[str]:
    """An API with the same quotas whose Redis is unreachable (nothing listens on its port)."""
    running = own_stack(backing, session_dir, "quotas-no-redis", **_env())
    running.env["RESPOOL_REDIS_URL"] = f"redis://127.0.0.1:{free_port()}/0"
    url = running.start_api()
    yield url
    running.stop_all()


def test_while_redis_is_unreachable_the_quotas_answer_as_outages_do(without_redis: str) -> None:
    """Without Redis, rates go unchecked, so what needs no Redis is served past the rate as before;
    a stream, which needs Redis anyway, gets the usual 503 with retry-after, never another error."""
    with httpx.Client(base_url=without_redis, headers=_auth("rate-a"), timeout=30) as http:
        for _ in range(2 * RATE):
            assert http.get("/v1/models").status_code == 200
        assert http.get("/v1/responses/resp_unknown").status_code == 404  # Postgres answers that
        answer = http.post("/v1/responses", json={**BACKGROUND, "stream": True})
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "service_unavailable"
    assert int(answer.headers["retry-after"]) > 0
