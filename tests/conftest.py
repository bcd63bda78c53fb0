"""Session fixtures: real servers, the scripted upstream, and respool's own processes."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from redis import Redis
from rq import Queue

from tests.support.stack import Servers, Stack, servers
from tests.support.upstream_process import ScriptedUpstream

KEY_A, KEY_B = "sk-tenant-a-key", "sk-tenant-b-key"
NATIVE_MODEL = "scripted-native"


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("respool")


@pytest.fixture(scope="session")
def backing() -> Iterator[Servers]:
    """Redis and a fresh Postgres database (the machine's when RESPOOL_* name them, else embedded)."""
    with servers() as found:
        yield found


@pytest.fixture(scope="session")
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream.start() as scripted:
        yield scripted


def _env(backing: Servers, **extra: str) -> dict[str, str]:
    import os

    env = {key: value for key, value in os.environ.items() if not key.startswith("RESPOOL_")}
    env.update(
        RESPOOL_REDIS_URL=backing.redis_url,
        RESPOOL_DATABASE_URL=backing.database_url,
        RESPOOL_QUEUE=f"respool-test-{uuid.uuid4().hex[:8]}",
        **extra,
    )
    return env


@pytest.fixture(scope="session")
def stack(backing: Servers, upstream: ScriptedUpstream, session_dir: Path) -> Iterator[Stack]:
    """Migrated schema, one API process with two tenants' keys, one worker; unknown models go upstream."""
    config = session_dir / "respool.toml"
    config.write_text(f'[models."{NATIVE_MODEL}"]\nbase_url = "{upstream.url}"\napi = "responses"\n')
    logs = session_dir / "logs"
    logs.mkdir()
    env = _env(
        backing,
        RESPOOL_API_KEYS=f"{KEY_A}:tenant-a,{KEY_B}:tenant-b",
        RESPOOL_UPSTREAM_URL=upstream.url,
        RESPOOL_UPSTREAM_API="chat",
        RESPOOL_CONFIG=str(config),
    )
    running = Stack(env, logs)
    running.run("migrate")
    running.start_api()
    running.start_worker()
    yield running
    running.stop_all()


@pytest.fixture(scope="session")
def queue_only(backing: Servers, session_dir: Path, stack: Stack) -> Iterator[Stack]:
    """An API with no worker on its queue, no keys and no upstream: responses stay queued."""
    logs = session_dir / "logs-queue-only"
    logs.mkdir()
    running = Stack(_env(backing, RESPOOL_SSE_HEARTBEAT_SECONDS="0.2"), logs)
    running.start_api("api-queue-only")
    yield running
    running.stop_all()


@pytest.fixture(scope="session")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    """The official SDK as tenant A, retries off so every answer is seen as sent."""
    with openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY_A, max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="session")
def other_client(stack: Stack) -> Iterator[openai.OpenAI]:
    """The official SDK as tenant B."""
    with openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY_B, max_retries=0) as sdk:
        yield sdk


@pytest.fixture
def open_client(queue_only: Stack) -> Iterator[openai.OpenAI]:
    """The SDK against the API that has no keys and no worker."""
    with openai.OpenAI(base_url=queue_only.url + "/v1", api_key="anything", max_retries=0) as sdk:
        yield sdk


@pytest.fixture
def rq_queue(backing: Servers) -> Iterator[Callable[[Stack], Queue]]:
    """RQ's view of a stack's queue, on a connection closed after the test."""
    with Redis.from_url(backing.redis_url) as connection:
        yield lambda running: Queue(running.env["RESPOOL_QUEUE"], connection=connection)


@pytest.fixture
def model(upstream: ScriptedUpstream) -> str:
    """A model name of this test's own, so its upstream requests can be told apart."""
    return f"test-model-{uuid.uuid4().hex[:8]}"
