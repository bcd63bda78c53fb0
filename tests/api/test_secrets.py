"""Keys stay secret (issue 7): after a run through every path, error paths most of all, no upstream
key and no respool key is in any log, row, Redis key or value (RQ jobs unpacked), metric, or answer."""

from __future__ import annotations

import base64
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel
from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from tests.conftest import make_sdk, own_stack
from tests.support.faults import wait_until_ended
from tests.support.leaks import Places, database_rows, log_files, redis_contents, scrapes, search
from tests.support.stack import Servers, Stack, free_port, wait_for
from tests.support.upstream_process import ScriptedUpstream

pytestmark = [pytest.mark.integration, pytest.mark.once]

UPSTREAM_KEY = f"sk-upstream-SECRET-{uuid.uuid4().hex}"
NATIVE_KEY = f"sk-native-SECRET-{uuid.uuid4().hex}"
API_KEY = f"sk-respool-SECRET-{uuid.uuid4().hex}"
KEYS = {"the upstream key": UPSTREAM_KEY, "the native upstream key": NATIVE_KEY, "the respool key": API_KEY}
# A key cut short or masked around its random part still gives itself away by that part.
SECRETS = KEYS | {f"{name}'s random part": key.rsplit("-", 1)[1] for name, key in KEYS.items()}
NATIVE_KEY_ENV = "SECRETS_TEST_NATIVE_KEY"

PREFIX = f"secrets-{uuid.uuid4().hex[:8]}"  # this module's models, each scripted for one path
PATHS = ("ok", "native", "native-rejected", "native-failed", "hung", "rejected", "failing", "in-band")
OK, NATIVE, NATIVE_REJECTED, NATIVE_FAILED, HUNG, REJECTED, FAILING, IN_BAND = (
    f"{PREFIX}-{p}" for p in PATHS
)


@pytest.fixture(scope="module")
def guarded(
    backing: Servers, upstream: ScriptedUpstream, session_dir: Path, stack: Stack
) -> Iterator[tuple[Stack, str]]:
    """An API and a worker (metrics served) with distinctive keys: the respool key, the pass-through
    upstream's, and a native model's (by `api_key_env`); failed upstream calls are retried once."""
    config = session_dir / f"{PREFIX}.toml"
    config.write_text(
        "".join(
            f'[models."{model}"]\nbase_url = "{upstream.url}"\napi = "responses"\n'
            f'api_key_env = "{NATIVE_KEY_ENV}"\n'
            for model in (NATIVE, NATIVE_REJECTED, NATIVE_FAILED)
        )
    )
    port = free_port()
    running = own_stack(
        backing,
        session_dir,
        "secrets",
        RESPOOL_API_KEYS=f"{API_KEY}:tenant-s",
        RESPOOL_UPSTREAM_URL=upstream.url,
        RESPOOL_UPSTREAM_API_KEY=UPSTREAM_KEY,
        RESPOOL_CONFIG=str(config),
        RESPOOL_UPSTREAM_RETRIES="1",
        RESPOOL_UPSTREAM_BACKOFF_SECONDS="0.01",
        RESPOOL_WORKER_METRICS_PORT=str(port),
        **{NATIVE_KEY_ENV: NATIVE_KEY},
    )
    running.start_api()
    running.start_worker()
    yield running, f"http://127.0.0.1:{port}/metrics"
    running.stop_all()


def _script(upstream: ScriptedUpstream) -> None:
    """Scripts for the paths, the error ones quoting the key as a careless upstream or proxy would."""
    upstream.script(OK, {"text": "fine thanks"})
    upstream.script(NATIVE, {"text": "natively fine"})
    upstream.script(HUNG, {"hang": True})
    quoted = {"message": f"Incorrect API key provided: {UPSTREAM_KEY}.", "code": "invalid_api_key"}
    upstream.script(REJECTED, {"status": 401, "error": quoted})
    upstream.script(NATIVE_REJECTED, {"status": 403, "error": {"message": f"key {NATIVE_KEY} denied"}})
    native_error = {"type": "error", "code": "invalid_api_key", "message": f"key {NATIVE_KEY} expired"}
    upstream.script(NATIVE_FAILED, {"events": [{**native_error, "param": None, "sequence_number": 0}]})
    upstream.script(FAILING, {"status": 500, "error": {"message": f"crashed on 'Bearer {UPSTREAM_KEY}'"}})
    upstream.script(IN_BAND, {"chunks": [{"choices": [], "error": {"message": f"bad key {UPSTREAM_KEY}"}}]})


def _workload(sdk: openai.OpenAI, url: str) -> tuple[list[str], list[str]]:
    """Foreground, background, streamed, chained, native, failed in five ways, cancelled; every
    response then retrieved, replayed and its input items listed; plus a few 4xx. Returns the
    response ids and everything the client was answered."""
    said: list[str] = []

    def keep[T: BaseModel](answer: T) -> T:
        said.append(answer.model_dump_json())
        return answer

    def streamed(model: str) -> str:
        events = [keep(event) for event in sdk.responses.create(model=model, input="hi", stream=True)]
        return str(events[0].model_dump()["response"]["id"])

    first = keep(sdk.responses.create(model=OK, input="hello"))
    ids = [first.id]
    ids.append(
        sdk.responses.create(model=OK, input="again", background=True, previous_response_id=first.id).id
    )
    ids.append(streamed(OK))
    ids.append(keep(sdk.responses.create(model=NATIVE, input="hello")).id)
    ids.append(keep(sdk.responses.create(model=FAILING, input="hello")).id)
    ids += [
        sdk.responses.create(model=m, input="x", background=True).id
        for m in (REJECTED, NATIVE_REJECTED, NATIVE_FAILED)
    ]
    ids.append(streamed(IN_BAND))
    hung = sdk.responses.create(model=HUNG, input="x", background=True).id
    wait_for(lambda: sdk.responses.retrieve(hung).status == "in_progress", what="the hung response to start")
    assert keep(sdk.responses.cancel(hung)).status == "cancelled"
    ids.append(hung)
    statuses = wait_until_ended(sdk, ids, timeout=60)
    assert list(statuses.values()) == ["completed"] * 4 + ["failed"] * 5 + ["cancelled"], statuses
    for response_id in ids:
        keep(sdk.responses.retrieve(response_id))
        said += [event.model_dump_json() for event in sdk.responses.retrieve(response_id, stream=True)]
        keep(sdk.responses.input_items.list(response_id))
    with make_sdk(url, "sk-wrong-key") as stranger:
        refused: list[Callable[[], Any]] = [
            lambda: sdk.responses.retrieve("resp_" + "0" * 48),
            lambda: sdk.responses.create(model=OK, input="x", previous_response_id="resp_" + "1" * 48),
            lambda: sdk.responses.cancel(ids[0]),
            lambda: stranger.responses.retrieve(ids[0]),
        ]
        for call in refused:
            with pytest.raises(openai.APIStatusError) as caught:
                call()
            said.append(caught.value.response.text)
    return ids, said


def test_no_key_is_left_anywhere_a_run_writes(
    guarded: tuple[Stack, str], backing: Servers, upstream: ScriptedUpstream
) -> None:
    """After every path, the failing ones included, the keys are in no log, row, Redis key or value,
    RQ job, metric or answer; while each of those places does hold what the run did (responses are
    no RQ jobs: their event streams are what Redis keeps of them)."""
    running, worker_metrics = guarded
    _script(upstream)
    with make_sdk(running.url, API_KEY) as sdk:
        ids, said = _workload(sdk, running.url)
    # The keys were in play: the upstream was sent them, and its error quoting them reached respool.
    sent = {
        record["headers"]["authorization"]
        for record in upstream.requests()
        if PREFIX in record.get("model", "")
    }
    assert sent == {f"Bearer {UPSTREAM_KEY}", f"Bearer {NATIVE_KEY}"}
    assert any("Incorrect API key provided" in answer for answer in said)

    places: Places = scrapes({"api": running.url + "/metrics", "worker": worker_metrics})
    with Redis.from_url(backing.redis_url) as redis:
        places |= redis_contents(redis, ids)
    places |= database_rows(backing.database_url)
    running.stop_all()  # the logs are complete, shutdown included
    places |= log_files(running.logs)
    places |= {f"answer {n} to the client": answer.encode() for n, answer in enumerate(said)}

    for where in ("log api.log", "log worker.log", "table public.response", "redis respool:{"):
        read = {place: content for place, content in places.items() if place.startswith(where)}
        assert search(read, {"a response id": ids[4]}), f"{where}: nothing of this run was read"
    assert b"respool_responses_finished_total" in places["metrics worker"]
    assert b"respool_http_requests_total" in places["metrics api"]
    leaks = search(places, SECRETS)
    assert not leaks, "keys left behind:\n" + "\n".join(leaks)


def test_the_search_finds_a_planted_key(tmp_path: Path, backing: Servers) -> None:
    """A key planted in a log file, a table row, an RQ job's zlib-packed arguments (a delivery's) and a base64'd,
    zlib-packed RQ result is found in each: the search above can fail."""
    planted = f"sk-planted-{uuid.uuid4().hex}"
    name = f"planted_{uuid.uuid4().hex[:8]}"
    (tmp_path / "worker.log").write_text(f"INFO calling the upstream with {planted}\n")
    engine = create_engine(backing.database_url, poolclass=NullPool)
    with Redis.from_url(backing.redis_url) as redis:
        queue = Queue(name, connection=redis, serializer=JSONSerializer)
        try:
            with engine.begin() as conn:
                conn.execute(text(f"CREATE TABLE {name} (body jsonb)"))
                conn.execute(text(f"INSERT INTO {name} VALUES (:body)"), {"body": f'{{"key": "{planted}"}}'})
            job = queue.enqueue_call("worker.runner.deliver_job", args=(planted,), job_id=name)
            packed = base64.b64encode(zlib.compress(f"Traceback: {planted}".encode()))
            redis.xadd(f"rq:results:{name}-planted", {"exc_string": packed})
            places = (
                log_files(tmp_path) | database_rows(backing.database_url) | redis_contents(redis, [job.id])
            )
        finally:
            queue.delete(delete_jobs=True)
            redis.delete(f"rq:results:{name}-planted")
            with engine.begin() as conn:
                conn.execute(text(f"DROP TABLE IF EXISTS {name}"))
            engine.dispose()
    assert sorted(search(places, {"planted": planted})) == [
        "planted in log worker.log",
        f"planted in redis rq:job:{name}",
        f"planted in redis rq:results:{name}-planted",
        f"planted in rq job {name}",
        f"planted in table public.{name}",
    ]
