"""`respool bench`: one run, on loopback, of the paced upstream called directly, respool in front of it
(with one worker process, then two) and LiteLLM in front of it when installed; the scenarios are in
api/bench/scenarios.py, the report in api/bench/report.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import platform
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import uvloop
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from api.bench import cpu, scenarios
from api.bench import litellm as litellm_
from api.bench.load import Api, Target
from api.bench.procs import Children, start_api, start_upstream, start_worker
from api.bench.scenarios import Plan, System
from api.bench.told import Receiver
from worker.settings import Settings


@dataclass
class Respool:
    """respool's processes: the API and its workers, started afresh for each configuration measured
    (warm processes keep the memory an earlier run grew, and would hide it from the next)."""

    children: Children
    env: dict[str, str]
    port: int
    receiver: Receiver  # where its webhooks go (the "webhooks" scenario's owner only)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    server_pids: list[int] = field(default_factory=list)  # its embedded Redis and Postgres, if any

    def tree(self) -> cpu.Tree:
        """The processes whose CPU respool costs: its API, workers, and the servers it started."""
        pids = [process.pid for process in self.processes] + self.server_pids
        return cpu.Tree([psutil.Process(pid) for pid in pids])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, workers: int) -> dict[str, list[psutil.Process]]:
        """Stop what runs, start an API and `workers` workers; their processes, by role."""
        for process in self.processes:
            self.children.stop(process)
        run = f"{workers}-workers"  # log names: respool-api-2-workers.log, respool-worker-1-of-2-workers.log
        api = start_api(self.children, self.env, self.port, f"respool-api-{run}")
        started = [
            start_worker(self.children, self.env, f"respool-worker-{index + 1}-of-{run}")
            for index in range(workers)
        ]
        self.processes = [api, *started]
        return {
            "api": [psutil.Process(api.pid)],
            "workers": [psutil.Process(process.pid) for process in started],
        }


def run(
    plan: Plan,
    out_dir: Path,
    litellm_path: str | None,
    servers: tuple[str, str] | None,
    redis_server: str = "auto",
) -> dict[str, Any]:
    """Run every scenario; write `result.json`, `latency.png` and `cpu.png` into `out_dir`; return the result."""
    # The load generator's own client must not log a line a request (httpx does at INFO): that
    # would cost more CPU than a request, on the machine under test.
    for name in ("httpx", "httpx2", "httpcore", "httpcore2", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = out_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    children = Children(log_dir)
    with (
        _servers(servers, redis_server) as (redis_url, database_url, server_pids, redis),
        _stopping(children),
    ):
        upstream_env = {**os.environ}
        _, upstream_url = start_upstream(children, upstream_env)
        respool = _start_respool(children, redis_url, database_url, upstream_url, log_dir)
        respool.server_pids = server_pids
        litellm = _start_litellm(litellm_path, upstream_url, log_dir)
        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                result = runner.run(_measure(plan, upstream_url, respool, litellm))
        finally:
            if isinstance(litellm, litellm_.LiteLLM):
                litellm.stop()
    result["machine"] = {**_machine(litellm), "redis": redis}
    result["plan"] = dataclasses.asdict(plan)
    from api.bench import report  # matplotlib is imported only to draw

    report.write(result, out_dir)
    return result


@contextmanager
def _stopping(children: Children) -> Iterator[None]:
    try:
        yield
    finally:
        children.stop_all()


@contextmanager
def _servers(given: tuple[str, str] | None, redis_server: str) -> Iterator[tuple[str, str, list[int], str]]:
    """Redis and Postgres: the ones given, else embedded ones in a temporary dir (as `respool up`,
    its Redis `redis_server`'s choice); with the pids of those it started (their CPU is respool's)
    and which Redis that is."""
    if given is not None:
        yield (*given, [], "given (RESPOOL_REDIS_URL)")
        return
    from api.up.embedded import EmbeddedPostgres, EmbeddedRedis

    data_dir = Path(tempfile.mkdtemp(prefix="respool-bench-"))
    redis = EmbeddedRedis.start(data_dir, redis_server)
    try:
        postgres = EmbeddedPostgres.start(data_dir)
        try:
            pids = [redis.process.pid, postgres.process.pid]
            yield redis.url, postgres.url, pids, f"{redis.server.version_text} ({redis.server.path})"
        finally:
            postgres.stop()
    finally:
        redis.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def _start_respool(
    children: Children, redis_url: str, database_url: str, upstream_url: str, config_dir: Path
) -> Respool:
    from worker.postgres.migrate import migrate

    migrate(database_url)
    env = {
        **os.environ,
        "RESPOOL_REDIS_URL": redis_url,
        "RESPOOL_DATABASE_URL": database_url,
        "RESPOOL_UPSTREAM_URL": upstream_url,
        "RESPOOL_UPSTREAM_API": "chat",
        "RESPOOL_QUEUE": f"bench-{uuid.uuid4().hex[:8]}",  # given servers may hold other queues
        "RESPOOL_ACCESS_LOG": "false",  # as LiteLLM runs here (api/bench/litellm.py): no line a request
    }
    for name in ("RESPOOL_UPSTREAM_API_KEY", "RESPOOL_MAX_QUEUE_DEPTH", "RESPOOL_WEBHOOK_URL"):
        env.pop(name, None)
    receiver = Receiver(_free_port())
    receiver.configure(env, config_dir)  # sets RESPOOL_CONFIG, RESPOOL_API_KEYS and the allowlist
    return Respool(children, env, _free_port(), receiver)


def _start_litellm(path: str | None, upstream_url: str, log_dir: Path) -> litellm_.LiteLLM | str:
    """LiteLLM in front of the upstream, or why not (`path` None: left out; "": looked up on PATH)."""
    if path is None:
        return "left out (--no-litellm)"
    executable = litellm_.find_litellm(path or None)
    if executable is None:
        return "not installed (pip install 'litellm[proxy]', or --litellm PATH)"
    try:
        return litellm_.LiteLLM.start(executable, upstream_url, _free_port(), log_dir)
    except litellm_.LiteLLMStartError as exc:
        return f"did not start: {exc}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _machine(litellm: litellm_.LiteLLM | str) -> dict[str, Any]:
    from importlib.metadata import version

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "respool": version("respool"),
        "litellm": litellm.version if isinstance(litellm, litellm_.LiteLLM) else litellm,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


# --- The scenarios ------------------------------------------------------------------------------


async def _measure(
    plan: Plan, upstream_url: str, respool: Respool, litellm: litellm_.LiteLLM | str
) -> dict[str, Any]:
    direct = System(Target("direct", upstream_url, Api.CHAT), {})
    systems = [direct]
    if isinstance(litellm, litellm_.LiteLLM):
        proxy = psutil.Process(litellm.pid)
        systems.append(
            System(
                Target("litellm", litellm.url, Api.RESPONSES),
                {"litellm": [proxy, *proxy.children(recursive=True)]},
                tree=cpu.Tree([proxy]),
            )
        )
    result: dict[str, Any] = {"systems": {}, "skipped": {}}
    if isinstance(litellm, str):
        result["skipped"]["litellm"] = litellm
    with _progress() as progress:
        for count in plan.worker_counts:
            name = f"respool ({count} worker{'s' if count > 1 else ''})"
            started = respool.start(count)
            mine = System(
                Target(name, respool.url, Api.RESPONSES),
                started,
                receiver=respool.receiver,
                tree=respool.tree(),
            )
            # The direct upstream and LiteLLM do not change with respool's workers: measured once.
            others = [system for system in systems if not system.result]
            await scenarios.run_all(plan, progress, [*others, mine], direct)
            systems.append(mine)
    for system in systems:
        result["systems"][system.target.name] = system.result
    return result


@contextmanager
def _progress() -> Iterator[Progress]:
    columns = (TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True, refresh_per_second=4) as progress:
        yield progress


def servers_from(settings: Settings) -> tuple[str, str] | None:
    """Redis and Postgres named by the environment, if both are; else the bench embeds its own."""
    return (settings.redis_url, settings.database_url) if settings.has_servers else None
