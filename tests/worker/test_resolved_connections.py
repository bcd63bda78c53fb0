"""A TCP connection to Redis resolves its host name before it connects (worker/connections.py,
`_ResolvedFirst`): on uvloop, as respool's processes run, a connect that times out while the name
is being resolved leaves no future failing unseen, and a host name still connects."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.up.embedded import EmbeddedRedis
from tests.support.stack import ROOT
from worker.connections import connect

pytestmark = pytest.mark.integration

# A process on uvloop whose connects to a name that never resolves time out (1 ms) while it resolves.
_TIMED_OUT_WHILE_RESOLVING = """
import asyncio, gc
import uvloop
from worker.connections import connect

async def main() -> None:
    client = connect("redis://redis-unresolvable.invalid:6390/0", max_connections=4, timeout_seconds=0.001)
    for _ in range(5):
        try:
            await client.ping()
        except Exception as exc:
            print(type(exc).__name__)
    await asyncio.sleep(1)  # every resolution ends meanwhile, failing
    gc.collect()
    await asyncio.sleep(0.1)
    await client.aclose(close_connection_pool=True)

uvloop.run(main())
"""


def test_a_connect_timed_out_while_resolving_leaves_no_future_failing_unseen() -> None:
    """Connects that time out while their host name resolves fail as Redis errors, and the loop
    logs no "Future exception was never retrieved" for the resolutions left behind."""
    done = subprocess.run(
        [sys.executable, "-c", _TIMED_OUT_WHILE_RESOLVING],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "never retrieved" not in done.stderr, done.stderr
    assert set(done.stdout.split()) <= {"TimeoutError", "ConnectionError"} and done.stdout, done.stdout


@pytest.fixture(scope="module")
def local_redis() -> Iterator[EmbeddedRedis]:
    data_dir = Path(tempfile.mkdtemp(prefix="respool-resolved-"))
    redis = EmbeddedRedis.start(data_dir)
    yield redis
    redis.stop()
    shutil.rmtree(data_dir, ignore_errors=True)


async def test_a_host_name_connects(local_redis: EmbeddedRedis) -> None:
    """A URL naming Redis by host name (`localhost`) connects and answers."""
    client = connect(f"redis://localhost:{local_redis.port}/0", max_connections=2, timeout_seconds=2)
    try:
        assert await client.ping()
    finally:
        await client.aclose(close_connection_pool=True)
