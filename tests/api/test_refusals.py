"""What respool cannot run on is refused at start: `respool api`, `respool worker` and `respool up`
exit non-zero with a message naming the problem (a Redis Cluster, a Redis lacking a command), and a
misspelled `RESPOOL_*` variable is named with the setting it was likely meant to be."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from redis import Redis

from tests.support.stack import ROOT, free_port, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.once]  # servers of its own

REDIS_SERVER = shutil.which("redis-server", path="/usr/bin:/bin") or "redis-server"
# Never reached: each process is refused before it connects to Postgres.
DATABASE_URL = "postgresql://postgres@127.0.0.1:9/unused"


@contextmanager
def redis_with(*config: str) -> Iterator[Redis]:
    """A real redis-server of its own, started with `config` lines, stopped afterwards."""
    directory = Path(tempfile.mkdtemp(prefix="respool-refusal-"))
    port = free_port()
    (directory / "redis.conf").write_text("\n".join([f"port {port}", "bind 127.0.0.1", "save ''", *config]))
    process = subprocess.Popen(
        [REDIS_SERVER, str(directory / "redis.conf")],
        cwd=directory,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    client = Redis(port=port, socket_timeout=5)
    try:
        wait_for(lambda: _answers(client), what="the redis-server to answer")
        yield client
    finally:
        client.close()
        process.terminate()
        process.wait(10)
        shutil.rmtree(directory, ignore_errors=True)


def _answers(client: Redis) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False


@pytest.fixture(scope="module")
def cluster() -> Iterator[Redis]:
    """A one-node Redis Cluster holding every slot: a working cluster, to which respool says no."""
    # its bus on a free port of its own (by default the port plus 10000, which may be taken or past 65535)
    bus = f"cluster-port {free_port()}"
    with redis_with("cluster-enabled yes", "cluster-config-file nodes.conf", bus) as node:
        node.execute_command("CLUSTER ADDSLOTSRANGE", 0, 16383)
        wait_for(lambda: node.cluster("info")["cluster_state"] == "ok", what="the cluster to take commands")
        yield node


@pytest.fixture(scope="module")
def without_xadd() -> Iterator[Redis]:
    """A standalone Redis whose operator disabled XADD."""
    with redis_with('rename-command XADD ""') as server:
        yield server


def run_respool(redis: Redis, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`respool <args>` on `redis`, to its exit (a process that starts instead is stopped after 30 s)."""
    port = redis.connection_pool.connection_kwargs["port"]
    base = {key: value for key, value in os.environ.items() if not key.startswith("RESPOOL_")}
    return subprocess.run(
        [sys.executable, "-m", "api", *args],
        env={
            **base,
            "RESPOOL_REDIS_URL": f"redis://127.0.0.1:{port}/0",
            "RESPOOL_DATABASE_URL": DATABASE_URL,
            "RESPOOL_PORT": str(free_port()),
            "RESPOOL_DATA_DIR": tempfile.mkdtemp(prefix="respool-refusal-data-"),
            **env,
        },
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize("command", ["api", "worker", "up"])
def test_a_redis_cluster_is_refused_at_start(cluster: Redis, command: str) -> None:
    """Every process exits at once, non-zero, saying that Redis Cluster is not supported."""
    ended = run_respool(cluster, command)
    assert ended.returncode != 0
    assert "Redis Cluster is not supported yet" in ended.stderr, ended.stderr[-2000:]


@pytest.mark.parametrize("command", ["api", "worker"])
def test_a_redis_without_a_needed_command_is_refused_naming_it(without_xadd: Redis, command: str) -> None:
    """A Redis whose XADD was renamed away is refused with a message that names XADD."""
    ended = run_respool(without_xadd, command)
    assert ended.returncode != 0
    assert "lacks commands respool sends" in ended.stderr and "XADD" in ended.stderr, ended.stderr[-2000:]


def test_a_misspelled_setting_is_named_with_the_nearest_one(without_xadd: Redis) -> None:
    """A RESPOOL_* variable respool does not read is warned about at start, with the likely one."""
    ended = run_respool(without_xadd, "worker", RESPOOL_REDIS_TIMEOUT_SECODNS="3", RESPOOL_TEST_CODEX="x")
    output = ended.stdout + ended.stderr
    assert (
        "RESPOOL_REDIS_TIMEOUT_SECODNS is not a respool setting "
        "(did you mean RESPOOL_REDIS_TIMEOUT_SECONDS?)" in output
    ), output[-2000:]
    assert "RESPOOL_TEST_CODEX" not in output  # the project's own test switch is no misspelling
