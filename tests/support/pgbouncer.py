"""PgBouncer (Debian's `pgbouncer`) in front of a test Postgres, for a module of its own.

Owns `PgBouncer`: its ini in a temp dir, one database entry named as the database it stands in
front of, `auth_type = trust`, a free loopback port, a small pool so that server connections really
are shared between client transactions (with a pool as large as the clients, the bug a pooler
reveals hides). As root, PgBouncer refuses to run: it runs as the Postgres socket's owner (an
embedded Postgres listens on a unix socket in a private dir) or `nobody`.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from sqlalchemy.engine import make_url

from tests.support.stack import free_port

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
_READY_SECONDS = 15.0


@dataclass
class PgBouncer:
    """A running PgBouncer; `url` reaches the database it was started for, through it."""

    url: str
    directory: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    @classmethod
    def start(cls, database_url: str, *, pool_mode: str = "transaction", pool_size: int = 5) -> PgBouncer:
        """PgBouncer in `pool_mode` in front of `database_url`'s database, up to `pool_size` server
        connections to it."""
        target = make_url(database_url)
        host = str(target.query.get("host") or target.host or "127.0.0.1")
        name, user = target.database or "postgres", target.username or "postgres"
        directory = Path(tempfile.mkdtemp(prefix="respool-pgbouncer-"))
        port = free_port()
        (directory / "users.txt").write_text(f'"{user}" ""\n')
        (directory / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"{name} = host={host} port={target.port or 5432} dbname={name} user={user}\n"
            "[pgbouncer]\n"
            f"pool_mode = {pool_mode}\n"
            f"default_pool_size = {pool_size}\n"
            "min_pool_size = 0\nreserve_pool_size = 0\nmax_client_conn = 1000\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {directory / 'users.txt'}\n"
            f"logfile = {directory / 'pgbouncer.log'}\npidfile = {directory / 'pgbouncer.pid'}\n"
            "ignore_startup_parameters = extra_float_digits,options\n"
        )
        argv = [PGBOUNCER, str(directory / "pgbouncer.ini")]
        if os.geteuid() == 0:
            account = _account(host)
            os.chown(directory, account.pw_uid, account.pw_gid)
            for path in directory.iterdir():
                os.chown(path, account.pw_uid, account.pw_gid)
            argv[1:1] = ["-u", account.pw_name]
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        bouncer = cls(f"postgresql+psycopg://{user}@127.0.0.1:{port}/{name}", directory, process)
        bouncer._wait_ready()
        return bouncer

    def log(self) -> str:
        path = self.directory / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """Stop it (SIGTERM, its immediate shutdown: SIGINT waits for its clients) and delete its dir."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _READY_SECONDS
        conninfo = make_url(self.url).set(drivername="postgresql").render_as_string(hide_password=False)
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited ({self.process.returncode}):\n{self.log()[-2000:]}")
            try:
                with psycopg.connect(conninfo, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.1)


def _account(host: str) -> pwd.struct_passwd:
    """Who PgBouncer runs as: the owner of the socket dir it connects through, else `nobody`."""
    if host.startswith("/"):
        return pwd.getpwuid(Path(host).resolve().stat().st_uid)
    return pwd.getpwnam("nobody")
