"""Backing servers a test may take down and bring back: an embedded Redis and Postgres of their own.

Owns `Restartable`: both servers on one data dir under /tmp (as root, Postgres runs as another
user, and pytest resets its own tmp tree to 0700), each stoppable and startable again on the same
data, at the same URLs, so respool's processes never need to be told anything:
- Redis comes back on the port it had (api/up/embedded.py reuses it when free), with its AOF,
  unless it is brought back empty;
- Postgres gets a fresh socket dir at every start, so the URL names a symlink to it instead.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from api.up.embedded import EmbeddedPostgres, EmbeddedRedis

_POSTGRES_PORT = 5432  # names the socket file only (api/up/embedded.py)


@dataclass
class Restartable:
    """Embedded Redis and Postgres in `data_dir`; `None` while a server is stopped."""

    data_dir: Path
    redis_url: str = ""
    redis: EmbeddedRedis | None = None
    postgres: EmbeddedPostgres | None = None

    @classmethod
    def start(cls) -> Restartable:
        servers = cls(Path(tempfile.mkdtemp(prefix="respool-outage-")))
        servers.start_redis()
        servers.start_postgres()
        return servers

    @property
    def database_url(self) -> str:
        host = quote(str(self._socket_link), safe="/")
        return f"postgresql+psycopg://postgres@/postgres?host={host}&port={_POSTGRES_PORT}"

    @property
    def _socket_link(self) -> Path:
        return self.data_dir / "pg-socket"

    def stop_redis(self) -> None:
        """Shut Redis down as SHUTDOWN does (its AOF is kept)."""
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def kill_redis(self) -> None:
        """SIGKILL Redis, as a crash or an OOM kill would (what it had written to its AOF stays)."""
        if self.redis is not None:
            self.redis.process.kill()
            self.redis.process.wait()
            self.stop_redis()

    def start_redis(self, *, is_empty: bool = False) -> None:
        """Start Redis on its data (or on none: a Redis that lost everything), at the same URL."""
        redis_dir = self.data_dir / "redis"
        if is_empty:
            for name in ("appendonly.aof", "dump.rdb", "appendonlydir"):
                path = redis_dir / name
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        assert self.redis is None, "Redis is running"
        self.redis = EmbeddedRedis.start(self.data_dir)
        if self.redis_url and self.redis.url != self.redis_url:
            raise AssertionError(f"Redis came back at {self.redis.url}, not {self.redis_url} (port taken)")
        self.redis_url = self.redis.url

    def stop_postgres(self) -> None:
        """Fast shutdown: open transactions are rolled back, clients are disconnected."""
        if self.postgres is not None:
            self.postgres.stop()
            self.postgres = None

    def start_postgres(self) -> None:
        """Start Postgres on its cluster, reachable through the same socket link."""
        self.postgres = EmbeddedPostgres.start(self.data_dir)
        self._socket_link.unlink(missing_ok=True)
        self._socket_link.symlink_to(self.postgres.socket_dir)

    def close(self) -> None:
        """Stop both and delete their data."""
        self.stop_redis()
        self.stop_postgres()
        shutil.rmtree(self.data_dir, ignore_errors=True)
