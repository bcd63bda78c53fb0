"""Session fixtures: real servers, the scripted upstream, and respool's own processes."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from redis import Redis

from tests.support.outages import Restartable
from tests.support.queue import QueueView
from tests.support.stack import LOG_DIRS, Servers, Stack
from tests.support.stack import servers as backing_servers
from tests.support.tool_servers import McpServerProcess, SearchServerProcess
from tests.support.upstream_process import ScriptedUpstream
from tests.support.validating import FAILURES, ValidatingTransport

pytest_plugins = ["pytester"]

KEY_A, KEY_B = "sk-tenant-a-key", "sk-tenant-b-key"
NATIVE_MODEL = "scripted-native"
MCP_TOKEN = "s3cret-token"  # the guarded MCP server's
DURATIONS = Path(__file__).parent / "durations.json"
REGISTERED_LABEL = "vault"  # the guarded MCP server, as the main stack's respool.toml registers it


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first, by the seconds each took when last measured (tests/durations.json,
    written by tools/durations.py; a file it does not name goes after those it names). With
    `-n N --dist loadfile --no-loadscope-reorder` the test processes take files in this order, so a
    file of minutes does not start last while the other processes run dry (the suite's last 90 s were
    one process finishing test_up.py: xdist's own order, most tests first, put it near the end)."""
    measured: dict[str, float] = json.loads(DURATIONS.read_text())
    root = DURATIONS.parents[1]
    items.sort(key=lambda item: -measured.get(item.path.relative_to(root).as_posix(), 0.0))  # stable


LOG_LINES = 60  # of each log, at most, in a failing test's report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Where every respool log stood as the test began (see pytest_runtest_makereport)."""
    item.stash[_LOG_SIZES] = _log_sizes()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Iterator[pytest.TestReport]:
    """A failing test's report carries what respool's processes logged while it ran (the last
    `LOG_LINES` of each log that grew): an API's 500 or a worker's traceback is in their logs, which
    a CI run's temporary folders do not outlive."""
    report: pytest.TestReport = yield
    if report.failed:
        before = item.stash.get(_LOG_SIZES, {})
        for path, size in _log_sizes().items():
            start = before.get(path, 0)
            if size > start:
                with path.open("rb") as log:
                    log.seek(start)
                    lines = log.read().decode(errors="replace").splitlines()[-LOG_LINES:]
                report.sections.append((f"respool log {path.parent.name}/{path.name}", "\n".join(lines)))
    return report


_LOG_SIZES = pytest.StashKey[dict[Path, int]]()


def _log_sizes() -> dict[Path, int]:
    return {path: path.stat().st_size for folder in LOG_DIRS for path in folder.glob("*.log")}


@pytest.fixture(autouse=True)
def wire_is_valid() -> Iterator[None]:
    """Fails the test if respool sent any of its clients an invalid Response, event or SSE frame."""
    yield
    found = list(FAILURES)
    FAILURES.clear()
    if found:
        pytest.fail("respool sent invalid output:\n" + "\n".join(found), pytrace=False)


def make_sdk(url: str, key: str) -> openai.OpenAI:
    """The official SDK on `url`, retries off so every answer is seen as sent, every answer validated."""
    return openai.OpenAI(
        base_url=url + "/v1",
        api_key=key,
        max_retries=0,
        http_client=httpx.Client(transport=ValidatingTransport()),
    )


def own_stack(backing: Servers, session_dir: Path, label: str, **env: str) -> Stack:
    """Processes of a test module's own (its own queue and log dir, `env` on top) on the session's
    servers; the `stack` fixture has migrated their database, so depend on it."""
    logs = session_dir / f"logs-{label}-{uuid.uuid4().hex[:6]}"
    logs.mkdir()
    return Stack(_env(backing, **env), logs)


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("respool")


@pytest.fixture(scope="session")
def backing() -> Iterator[Servers]:
    """Redis and a fresh Postgres database (the machine's when RESPOOL_* name them, else embedded)."""
    with backing_servers() as found:
        yield found


@pytest.fixture(scope="module")
def servers() -> Iterator[Restartable]:
    """A Redis and a Postgres of the test module's own, to stop, freeze and start again."""
    running = Restartable.start()
    yield running
    running.close()


@pytest.fixture(scope="session")
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream.start() as scripted:
        yield scripted


@pytest.fixture(scope="session")
def mcp_server() -> Iterator[McpServerProcess]:
    """A real MCP server (tests.support.mcp_server) on loopback."""
    server = McpServerProcess.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def search_server() -> Iterator[SearchServerProcess]:
    """A search backend speaking SearXNG's and Tavily's APIs (tests.support.search_server) on loopback."""
    server = SearchServerProcess.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def guarded_server() -> Iterator[McpServerProcess]:
    """A real MCP server that demands `Authorization: Bearer MCP_TOKEN`."""
    server = McpServerProcess.start("--token", MCP_TOKEN)
    yield server
    server.stop()


def _env(backing: Servers, **extra: str) -> dict[str, str]:
    import os

    env = {key: value for key, value in os.environ.items() if not key.startswith("RESPOOL_")}
    env.update(
        RESPOOL_REDIS_URL=backing.redis_url,
        RESPOOL_DATABASE_URL=backing.database_url,
        RESPOOL_QUEUE=f"respool-test-{uuid.uuid4().hex[:8]}",
        RESPOOL_SYNTHETIC_DELAY_SECONDS="0",  # its small default pace is for people trying it
    )
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def stack(
    backing: Servers,
    upstream: ScriptedUpstream,
    session_dir: Path,
    mcp_server: McpServerProcess,
    guarded_server: McpServerProcess,
) -> Iterator[Stack]:
    """Migrated schema, one API process with two tenants' keys, one worker; unknown models go
    upstream; the guarded MCP server registered by label, its token from the environment; the
    outbound allowlist opens exactly the test's MCP servers."""
    config = session_dir / "respool.toml"
    config.write_text(
        f'[models."{NATIVE_MODEL}"]\nbase_url = "{upstream.url}"\napi = "responses"\n\n'
        f'[mcp_servers.{REGISTERED_LABEL}]\nurl = "{guarded_server.url}"\n'
        'headers_env = { Authorization = "RESPOOL_TEST_VAULT_AUTHORIZATION" }\n'
    )
    logs = session_dir / "logs"
    logs.mkdir()
    env = _env(
        backing,
        RESPOOL_API_KEYS=f"{KEY_A}:tenant-a,{KEY_B}:tenant-b",
        RESPOOL_UPSTREAM_URL=upstream.url,
        RESPOOL_UPSTREAM_API="chat",
        RESPOOL_CONFIG=str(config),
        RESPOOL_OUTBOUND_ALLOWLIST=f"{mcp_server.host_port},{guarded_server.host_port}",
        RESPOOL_TEST_VAULT_AUTHORIZATION=f"Bearer {MCP_TOKEN}",
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
    """The official SDK as tenant A."""
    with make_sdk(stack.url, KEY_A) as client:
        yield client


@pytest.fixture(scope="session")
def other_client(stack: Stack) -> Iterator[openai.OpenAI]:
    """The official SDK as tenant B."""
    with make_sdk(stack.url, KEY_B) as client:
        yield client


@pytest.fixture(scope="module")
def second_api(stack: Stack) -> Iterator[openai.OpenAI]:
    """The SDK as tenant A against a second API process on the same Redis and Postgres."""
    url = stack.start_api("api-2")
    with make_sdk(url, KEY_A) as client:
        yield client
    stack.stop("api-2")


@pytest.fixture
def open_client(queue_only: Stack) -> Iterator[openai.OpenAI]:
    """The SDK against the API that has no keys and no worker."""
    with make_sdk(queue_only.url, "anything") as client:
        yield client


@pytest.fixture
def queue_view(backing: Servers) -> Iterator[Callable[[Stack], QueueView]]:
    """What a stack's response queue holds, on a connection closed after the test."""
    with Redis.from_url(backing.redis_url) as connection:
        yield lambda running: QueueView(connection, running.env["RESPOOL_QUEUE"])


@pytest.fixture
def model(upstream: ScriptedUpstream) -> str:
    """A model name of this test's own, so its upstream requests can be told apart."""
    return f"test-model-{uuid.uuid4().hex[:8]}"
