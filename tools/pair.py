"""A/B two builds of respool on one machine at one time: the CPU each costs, by role (a developer's
tool, issue 20; `respool bench` is the user's).

    .venv/bin/python tools/pair.py A_TREE B_TREE [--rounds 3] [--scen s30,s100,short,bg,ttft]
                                              [--env A_NAME=value ...] [--env B_NAME=value ...]

A tree is a checkout (a `git worktree add -f /tmp/base <sha> --detach` for the build before); both
run on this checkout's virtualenv, each with its own tree first on PYTHONPATH, against one shared
embedded Redis and Postgres and one paced upstream, each with an API and one worker of its own.
Rounds alternate which tree goes first; each scenario's CPU is read from /proc for the tree's API,
its worker, Redis and Postgres (user and system apart), with Redis's own count of commands. The
figures printed are medians over the rounds, and B's change against A.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import redis
import uvloop

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

from api.bench import load, stats  # noqa: E402
from api.bench.load import Api, Target  # noqa: E402
from api.bench.procs import Children, wait_until  # noqa: E402
from api.up.embedded import EmbeddedPostgres, EmbeddedRedis  # noqa: E402

SCENARIOS = {
    # name: (kind, concurrency, count, tokens, pace_ms)
    "s30": ("streams", 30, 30, 150, 20),
    "s100": ("streams", 100, 100, 150, 20),
    "short": ("short", 16, 400, 8, 0),
    "short1t": ("short", 16, 400, 1, 0),  # "short" with one token (what a chunk costs, against "short")
    "bg1t": ("bg", 16, 400, 1, 0),  # "bg" with one token
    "short2k": ("short", 16, 2000, 8, 0),  # for --spy: enough samples of a response's path
    "s30long": ("streams", 30, 150, 150, 20),  # for --spy: s30 five times over
    "s30x600": ("streams", 30, 30, 600, 20),  # s30's streams four times as long: a response's share apart
    "bg": ("bg", 16, 400, 8, 0),
    "bg2k": ("bg", 16, 2000, 8, 0),  # for --spy
    "bg1s": ("bg", 64, 400, 8, 1000),  # each polled once, a second on (pace: the poll interval, ms)
    "poll": ("poll", 16, 2000, 8, 0),  # polls of one ended response (what a poll costs)
    "poll10k": ("poll", 16, 10000, 8, 0),  # for --spy
    "ttft": ("streams", 1, 40, 32, 10),
    "one": ("streams", 1, 10, 4, 10),  # ten streams, one at a time (for --strace)
    "short1": ("short", 1, 10, 8, 0),  # ten short requests, one at a time (for --strace)
    "bg1": ("bg", 1, 10, 8, 250),  # ten background responses, one at a time (for --strace)
    "bg1x": ("bg", 1, 200, 8, 20),  # background responses one at a time (a lone one's cost)
    "idle": ("idle", 0, 5, 0, 0),  # five seconds of nothing: a unit a second
    "idle30": ("idle", 0, 30, 0, 0),  # thirty: a process's CPU past /proc's 10 ms resolution
    # foreground short requests at a background response's rate in "bg" (each client waits 250 ms
    # after each, as a background one's client waits for its poll): what a response costs at that rate
    "short250": ("paced", 16, 400, 8, 250),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def times(process: psutil.Process, children: bool = False) -> tuple[float, float]:
    try:
        t = process.cpu_times()
    except psutil.Error:
        return 0.0, 0.0
    user, system = t.user, t.system
    if children:
        user += t.children_user
        system += t.children_system
    return user, system


def _switches(process: psutil.Process) -> int:
    """How many times the process's threads have been switched out (each a wake-up to come back)."""
    total = 0
    for task in Path(f"/proc/{process.pid}/task").glob("*"):
        try:
            text = (task / "status").read_text()
        except OSError:
            continue
        total += sum(int(line.split()[1]) for line in text.splitlines() if "ctxt_switches:" in line)
    return total


def tree_times(root: psutil.Process) -> tuple[float, float]:
    user, system = times(root, True)
    try:
        family = root.children(recursive=True)
    except psutil.Error:
        family = []
    for child in family:
        u, s = times(child, True)
        user, system = user + u, system + s
    return user, system


class Build:
    def __init__(
        self, name: str, tree: Path, env: dict[str, str], children: Children, python: str | None = None
    ) -> None:
        self.name, self.tree, self.env, self.children = name, tree, env, children
        self.python = python or str(HERE / ".venv/bin/python")  # its API's and worker's interpreter
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.target = Target(name, self.url, Api.RESPONSES)
        self.polled: str | None = None  # the ended response the "poll" scenario polls

    def start(self) -> None:
        # The tree's own packages, not the checkout's (`python -m` puts the working dir first on
        # sys.path, before PYTHONPATH).
        tree = str(self.tree)
        run = f"import runpy, sys; sys.path[0] = {tree!r}; runpy.run_module('api', run_name='__main__', alter_sys=True)"
        py_m = [self.python, "-c", run]
        self.api = self.children.spawn(
            f"{self.name}-api",
            [*py_m, "api", "--host", "127.0.0.1", "--port", str(self.port)],
            self.env,
        )
        self.worker = self.children.spawn(f"{self.name}-worker", [*py_m, "worker"], self.env)
        log = self.children.log_dir / f"{self.name}-worker.log"
        wait_until(
            lambda: "ready: taking responses" in log.read_text(errors="replace"), 90, "worker", self.worker
        )
        wait_until(lambda: _ready(self.port), 90, "api", self.api)
        self.roles = {"api": psutil.Process(self.api.pid), "worker": psutil.Process(self.worker.pid)}


def _ready(port: int) -> bool:
    import httpx2

    try:
        return httpx2.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
    except httpx2.HTTPError:
        return False


def read_all(build: Build, servers: dict[str, psutil.Process], r: redis.Redis) -> dict[str, float]:
    out: dict[str, float] = {}
    for role, process in build.roles.items():
        out[role + ".usr"], out[role + ".sys"] = times(process)
        out[role + ".wakes"] = float(_switches(process))
    for role, process in servers.items():
        # Each server with its reaped children (a Redis snapshot, an AOF rewrite), as `respool bench` counts them.
        out[role + ".usr"], out[role + ".sys"] = tree_times(process)
    stats_ = r.info("commandstats")
    out["redis.calls"] = float(sum(v["calls"] for v in stats_.values()))
    for command, value in stats_.items():
        out["cmd." + command.removeprefix("cmdstat_")] = float(value["calls"])
        out["usec." + command.removeprefix("cmdstat_")] = float(value["usec"])
    out["at"] = time.monotonic()
    return out


async def scenario(build: Build, name: str) -> tuple[int, dict[str, Any]]:
    kind, concurrency, count, tokens, pace = SCENARIOS[name]
    if kind == "streams":
        samples = await load.streams(
            build.target, concurrency=concurrency, count=count, tokens=tokens, pace_ms=pace
        )
        summary = stats.summarize(samples, tokens)
        return summary["tokens"], summary
    if kind == "idle":
        await asyncio.sleep(count)
        return count, {}
    if kind == "poll":
        if build.polled is None:
            first = await load.short_count(
                build.target,
                background=False,
                count=1,
                concurrency=1,
                model=load.model_name(tokens, 0),
                poll_seconds=0,
            )
            build.polled = first.response_ids[0]
        polled = await load.polls(build.target, build.polled, count=count, concurrency=concurrency)
        return polled.polls, {"errors": polled.errors, "first_error": polled.first_error}
    paced = kind == "paced"
    done = await load.short_count(
        build.target,
        background=kind == "bg",
        count=count,
        concurrency=concurrency,
        model=load.model_name(tokens, 0),
        poll_seconds=pace / 1000 if pace and not paced else 0.25,
        pause_seconds=pace / 1000 if paced else 0.0,
    )
    return done.completed, {"errors": done.errors, "polls": done.polls, "first_error": done.first_error}


async def main_async(args: argparse.Namespace) -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="pair-"))
    log_dir = data_dir / "logs"
    log_dir.mkdir()
    children = Children(log_dir)
    rds = EmbeddedRedis.start(data_dir, args.redis)
    pg = EmbeddedPostgres.start(data_dir)
    own_redis = {"A": rds, "B": rds}
    try:
        from worker.postgres.migrate import migrate

        migrate(pg.url)
        if args.pg_log:  # every statement into Postgres's log (in the kept data dir)
            import psycopg

            with psycopg.connect(
                pg.url.replace("postgresql+psycopg", "postgresql"), autocommit=True
            ) as connection:
                connection.execute("ALTER SYSTEM SET log_statement = 'all'")
                connection.execute("SELECT pg_reload_conf()")
        if args.redis_env or args.redis_b:  # B's own Redis (`--redis-b`), with these in its environment
            saved = dict(os.environ)
            os.environ.update(item.partition("=")[::2] for item in args.redis_env)
            try:
                own_redis["B"] = EmbeddedRedis.start(data_dir / "b", args.redis_b or args.redis)
            finally:
                os.environ.clear()
                os.environ.update(saved)
        base_env = {**os.environ, "RESPOOL_REDIS_URL": rds.url, "RESPOOL_DATABASE_URL": pg.url}
        for key in ("RESPOOL_API_KEYS", "RESPOOL_WEBHOOK_URL", "RESPOOL_CONFIG", "RESPOOL_MAX_QUEUE_DEPTH"):
            base_env.pop(key, None)
        upstream = children.spawn(
            "upstream", [str(HERE / ".venv/bin/python"), "-m", "api.bench.upstream", "--port", "0"], base_env
        )
        assert upstream.stdout is not None
        upstream_url = upstream.stdout.readline().decode().split()[1] + "/v1"
        builds = []
        for name, tree in (("A", args.a), ("B", args.b)):
            env = {
                **base_env,
                "PYTHONPATH": tree,
                "RESPOOL_UPSTREAM_URL": upstream_url,
                "RESPOOL_UPSTREAM_API": "chat",
                "RESPOOL_QUEUE": f"pair-{name}",
                "RESPOOL_ACCESS_LOG": "false",
                "RESPOOL_REDIS_URL": own_redis[name].url,
            }
            if args.perf:
                env["PYTHONPERFSUPPORT"] = "1"
            for item in args.env:
                prefix, _, assignment = item.partition("_")
                if prefix == name:
                    key, _, value = assignment.partition("=")
                    env[key] = value
            python = args.python_b if name == "B" else None
            builds.append(Build(name, Path(tree), env, children, python))
        for build in builds:
            build.start()
        clients = {name: redis.Redis.from_url(server.url) for name, server in own_redis.items()}
        servers = {
            name: {"redis": psutil.Process(server.process.pid), "pg": psutil.Process(pg.process.pid)}
            for name, server in own_redis.items()
        }
        direct = Target("direct", upstream_url, Api.CHAT)
        for build in builds:  # warm up
            # As many at once as the largest scenario: every pool has grown before anything is measured.
            await load.streams(build.target, concurrency=100, count=100, tokens=4, pace_ms=1)
            await load.short_count(
                build.target,
                background=False,
                count=20,
                concurrency=4,
                model=load.model_name(8, 0),
                poll_seconds=0.25,
            )
        results: dict[tuple[str, str], list[dict[str, float]]] = {}
        for round_ in range(args.rounds):
            order = builds if round_ % 2 == 0 else builds[::-1]
            for name in args.scen.split(","):
                direct_ttft = None
                if name == "ttft":
                    summary = stats.summarize(
                        await load.streams(direct, concurrency=1, count=40, tokens=32, pace_ms=10), 32
                    )
                    direct_ttft = summary["ttft_ms"]["p50"]
                for build in order:
                    await asyncio.sleep(0.5)
                    spies = _spy(args, build, name) if round_ == 0 and build.name == "A" else []
                    if spies:
                        await asyncio.sleep(1.0)  # attached
                    before = read_all(build, servers[build.name], clients[build.name])
                    units, summary = await scenario(build, name)
                    after = read_all(build, servers[build.name], clients[build.name])
                    for spy in spies:
                        spy.send_signal(
                            signal.SIGINT if not (args.strace or args.strace_count) else signal.SIGTERM
                        )
                        spy.wait()
                    row = {key: after[key] - before.get(key, 0.0) for key in after}
                    row["units"] = units
                    row["polls"] = float(summary.get("polls") or 0)
                    if name == "ttft" and direct_ttft is not None:
                        row["added_ttft_ms"] = summary["ttft_ms"]["p50"] - direct_ttft
                        row["ttft_p99_ms"] = summary["ttft_ms"]["p99"]
                    if SCENARIOS[name][0] == "streams":
                        row["gap_p99_ms"] = summary["gap_ms"]["p99"] or 0.0
                    if summary.get("first_error"):
                        print(f"  {build.name} {name}: error {summary['first_error']}", flush=True)
                    results.setdefault((build.name, name), []).append(row)
                    print(f"  round {round_ + 1} {build.name} {name}: {_line(name, row)}", flush=True)
        print("\nmedians over rounds (per token: µs; per response: ms)")
        kept: dict[tuple[str, str], dict[str, float]] = {}
        for name in args.scen.split(","):
            medians = {}
            for build in builds:
                rows = results[(build.name, name)]
                keys = set().union(*rows)
                medians[build.name] = {
                    key: statistics.median(row.get(key, 0.0) for row in rows) for key in keys
                }
                kept[(build.name, name)] = medians[build.name]
                print(f"{name:6} {build.name}: {_line(name, medians[build.name])}")
                if args.commands:
                    units = max(1.0, medians[build.name]["units"])
                    counts = sorted(
                        (
                            (value / units, key[4:])
                            for key, value in medians[build.name].items()
                            if key.startswith("cmd.")
                        ),
                        reverse=True,
                    )
                    print(
                        "        "
                        + "  ".join(f"{command} {count:.2f}" for count, command in counts if count >= 0.01)
                    )
                    spent = sorted(
                        (
                            (value / units * _scale(name) / 1e6, key[5:])
                            for key, value in medians[build.name].items()
                            if key.startswith("usec.")
                        ),
                        reverse=True,
                    )
                    print(  # Redis's own time in each command (a script's includes its calls')
                        "        time: "
                        + "  ".join(f"{command} {spent_:.1f}" for spent_, command in spent[:8] if spent_ > 0)
                    )
            a, b = _total(name, medians["A"]), _total(name, medians["B"])
            print(f"{name:6} B/A: {b / a:.3f}" if a else "")
        scenarios = args.scen.split(",")
        for name in scenarios:
            if SCENARIOS[name][0] != "bg" or "poll" not in scenarios:
                continue
            # As the bench reads a background response: its polls' cost (the poll scenario's) out.
            alone = {}
            for build in builds:
                row, per_poll = kept[(build.name, name)], _total("poll", kept[(build.name, "poll")])
                polls = row["polls"] / max(1.0, row["units"])
                alone[build.name] = _total(name, row) - polls * per_poll
                print(
                    f"{name:6} {build.name}: {alone[build.name]:.2f} without its polls "
                    f"({polls:.2f} a response, {per_poll:.3f} each)"
                )
            print(f"{name:6} without its polls, B/A: {alone['B'] / alone['A']:.3f}")
    finally:
        children.stop_all()
        pg.stop()
        if own_redis["B"] is not rds:
            own_redis["B"].stop()
        rds.stop()
        if not args.keep:
            shutil.rmtree(data_dir, ignore_errors=True)
        else:
            print("kept", data_dir)


ROLES = ("api", "worker", "redis", "pg")


def _spy(args: argparse.Namespace, build: Build, name: str) -> list[subprocess.Popen[bytes]]:
    """A profiler on the build's API and worker for one scenario (`--spy DIR`): py-spy's raw stacks
    (folded), or perf's record (`--perf`), or strace's lines (`--strace`)."""
    if not args.spy:
        return []
    Path(args.spy).mkdir(parents=True, exist_ok=True)
    if args.strace_count:  # every system call, counted (a summary at the end)
        tool, suffix = ["strace", "-f", "-c", "-o"], "count"
    elif args.strace:
        calls = os.environ.get(
            "PAIR_STRACE_CALLS", "trace=%network,read,write,epoll_wait,epoll_pwait,poll,writev"
        )
        tool, suffix = ["strace", "-f", "-tt", "-e", calls, "-s", "64", "-o"], "strace"
    elif args.perf:
        freq = str(args.freq or (149 if args.dwarf else 499))
        graph = ["--call-graph", "dwarf,32768", "-F", freq] if args.dwarf else ["-g", "-F", freq]
        tool, suffix = ["perf", "record", *graph, "-o"], "perf"
    else:
        how = ["--native"] if args.native else ["--nonblocking", *(["--gil"] if args.gil else [])]
        tool, suffix = [args.py_spy, "record", "-r", "250", "-f", "raw", *how, "-o"], "txt"
    return [
        subprocess.Popen(
            [*tool, f"{args.spy}/{name}-{role}.{suffix}", "-p", str(process.pid)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for role, process in build.roles.items()
    ]


def _scale(name: str) -> float:
    return 1e6 if SCENARIOS[name][0] == "streams" else 1e3


def _total(name: str, row: dict[str, float]) -> float:
    units = max(1.0, row["units"])
    return sum(row[f"{role}.usr"] + row[f"{role}.sys"] for role in ROLES) / units * _scale(name)


def _line(name: str, row: dict[str, float]) -> str:
    units = max(1.0, row["units"])
    scale = _scale(name)
    parts = [f"total {_total(name, row):7.1f}"]
    for role in ROLES:
        usr, sys_ = row[f"{role}.usr"] / units * scale, row[f"{role}.sys"] / units * scale
        parts.append(f"{role} {usr + sys_:6.1f} ({sys_:5.1f}s)")
    parts.append(f"cmds/unit {row['redis.calls'] / units:5.2f}")
    if "api.wakes" in row:
        wakes = (row["api.wakes"] / units, row["worker.wakes"] / units)
        parts.append("wakes/unit api {:4.1f} worker {:4.1f}".format(*wakes))
    if "gap_p99_ms" in row:
        parts.append(f"gap99 {row['gap_p99_ms']:.1f}")
    if "added_ttft_ms" in row:
        parts.append(f"+ttft {row['added_ttft_ms']:.2f}")
    if "ttft_p99_ms" in row:
        parts.append(f"ttft99 {row['ttft_p99_ms']:.1f}")
    return "  ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scen", default="s30,s100,short,bg")
    parser.add_argument("--env", action="append", default=[])
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--spy", help="py-spy A's API and worker in round 1 into this dir")
    parser.add_argument("--py-spy", default="/tmp/tools/bin/py-spy")
    parser.add_argument(
        "--perf", action="store_true", help="with --spy: perf, not py-spy (PYTHONPERFSUPPORT set)"
    )
    parser.add_argument("--native", action="store_true", help="with --spy: py-spy --native")
    parser.add_argument(
        "--gil",
        action="store_true",
        help="with --spy: py-spy --gil (samples only the thread holding the GIL: on-CPU Python)",
    )
    parser.add_argument("--pg-log", action="store_true", help="log every Postgres statement (with --keep)")
    parser.add_argument(
        "--dwarf",
        action="store_true",
        help="with --perf: unwind by DWARF (Python's frames through libpython)",
    )
    parser.add_argument(
        "--redis-env",
        action="append",
        default=[],
        help="NAME=value: B gets a Redis of its own, started with this in its environment",
    )
    parser.add_argument(
        "--redis", default="auto", help="the shared Redis: auto, bundled or a path (RESPOOL_REDIS_SERVER)"
    )
    parser.add_argument("--redis-b", help="B gets a Redis of its own: auto, bundled or a path")
    parser.add_argument("--freq", type=int, help="with --perf: samples a second (149 with --dwarf, else 499)")
    parser.add_argument("--strace", action="store_true", help="with --spy: strace A's API and worker")
    parser.add_argument(
        "--strace-count", action="store_true", help="with --spy: count A's API's and worker's system calls"
    )
    parser.add_argument("--commands", action="store_true", help="Redis commands per unit, by command")
    parser.add_argument(
        "--python-b",
        help="B's API and worker on this interpreter (a virtualenv's python with the locked packages)",
    )
    args = parser.parse_args()
    args.a, args.b = str(Path(args.a).resolve()), str(Path(args.b).resolve())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main_async(args))


if __name__ == "__main__":
    main()
