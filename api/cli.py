"""The `respool` command: `up` (everything on one machine), `migrate`, `api`, `worker`, `bench`, and
`hash-key` (an API key's digest, for `RESPOOL_API_KEYS`).

Every option is also an env var (`RESPOOL_…`); a flag given on the command line wins. Each process
is started by its own command, so `up` runs exactly what a deployment runs, one process each.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from worker import logs
from worker.heap import frozen_imports
from worker.settings import Settings, unknown_variables

EXAMPLE = """\
  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="{key}")
  response = client.responses.create(model="synthetic", input="Hello!", background=True)
  print(client.responses.retrieve(response.id).status)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="respool", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start Redis, Postgres, the API and workers on this machine")
    up.add_argument("--host", help="API address (RESPOOL_HOST, default 127.0.0.1)")
    up.add_argument("--port", type=int, help="API port (RESPOOL_PORT, default 8000)")
    up.add_argument("--workers", type=int, help="worker processes (RESPOOL_WORKERS, default 1)")
    up.add_argument(
        "--api-replicas",
        type=int,
        dest="api_replicas",
        help="API processes on the port (RESPOOL_API_REPLICAS, default 1)",
    )
    commands.add_parser("migrate", help="bring the Postgres schema to the newest revision")
    api = commands.add_parser("api", help="run one API process")
    api.add_argument("--host", help="address (RESPOOL_HOST)")
    api.add_argument("--port", type=int, help="port (RESPOOL_PORT)")
    api.add_argument(
        "--replicas",
        type=int,
        dest="api_replicas",
        help="processes serving the port (RESPOOL_API_REPLICAS, default 1)",
    )
    worker = commands.add_parser("worker", help="run one worker process")
    worker.add_argument(
        "--concurrency", type=int, help="responses held at once (RESPOOL_CONCURRENCY, default 256)"
    )
    bench = commands.add_parser(
        "bench", help="measure what respool adds to an upstream, beside it and LiteLLM (README: Performance)"
    )
    bench.add_argument(
        "--out", default="bench-results", help="directory for result.json, latency.png, cpu.png, logs"
    )
    bench.add_argument("--quick", action="store_true", help="a short run that checks everything works")
    bench.add_argument("--litellm", help="the litellm executable (default: `litellm` on PATH, if any)")
    bench.add_argument("--no-litellm", action="store_true", help="leave LiteLLM out even if installed")
    bench.add_argument(
        "--workers", default="1,2", help="worker process counts to measure respool with (default 1,2)"
    )
    deliveries = commands.add_parser(
        "deliveries", help="print a response's webhook deliveries and their attempts, as JSON"
    )
    deliveries.add_argument("response_id")
    commands.add_parser(
        "hash-key", help="print the sha256:<hex> digest of the API key read from stdin (RESPOOL_API_KEYS)"
    )
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    if args.command == "bench":
        return Settings()
    flags = {
        key: value
        for key, value in vars(args).items()
        if key not in ("command", "response_id") and value is not None
    }
    overrides: dict[str, Any] = flags
    return Settings(**overrides)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "hash-key":
        sys.exit(hash_key())
    settings = _settings(args)
    logs.configure(settings.log_format, settings.log_level)
    for warning in unknown_variables(os.environ):
        logging.getLogger("respool").warning(warning)
    if args.command in ("up", "api"):
        with frozen_imports():
            from api.auth import open_api_refusal

        refusal = open_api_refusal(settings)
        if refusal:
            sys.exit(refusal)
    if args.command == "up":
        sys.exit(up(settings))
    if args.command == "bench":
        sys.exit(bench(args, settings))
    _require_servers(settings)
    if args.command == "migrate":
        sys.exit(run_migrate(settings))
    elif args.command == "deliveries":
        sys.exit(show_deliveries(settings, args.response_id))
    elif args.command == "api":
        _require_redis(settings)
        with frozen_imports():
            import uvicorn

            from api.app import create_app

        if settings.api_replicas > 1:
            # uvicorn's manager shares the socket among processes that each build the app from the
            # environment, each with its own service and tailer.
            uvicorn.run(
                "api.app:create_app",
                factory=True,
                workers=settings.api_replicas,
                host=settings.host,
                port=settings.port,
                **_uvicorn_options(settings),
            )
        else:
            from api.serving import serve

            serve(
                uvicorn.Config(
                    create_app(settings), host=settings.host, port=settings.port, **_uvicorn_options(settings)
                )
            )
    elif args.command == "worker":
        _require_redis(settings)
        with frozen_imports():
            from worker.runner.worker import run_worker

        run_worker(settings, settings.concurrency)


def show_deliveries(settings: Settings, response_id: str) -> int:
    """`respool deliveries RESPONSE_ID`: its webhook deliveries, each with its attempts (an
    operator's view: any owner's)."""
    import asyncio
    import json

    from worker.postgres import deliveries, store

    async def read() -> list[dict[str, Any]]:
        engine = store.create_engine(
            settings.database_url,
            connections=2,
            deadline_seconds=settings.database_timeout_seconds,
            is_preparing=settings.database_pooler != "transaction",
        )
        try:
            async with engine.connect() as conn:
                return await deliveries.of_response(conn, response_id)
        finally:
            await engine.dispose()

    print(json.dumps(asyncio.run(read()), indent=2, default=str))
    return 0


def run_migrate(settings: Settings) -> int:
    """`respool migrate`: the schema to its newest revision, once Postgres answers (within
    RESPOOL_DATABASE_WAIT_SECONDS); 1, saying why, if it never does."""
    from worker.outages import is_postgres_outage
    from worker.postgres.migrate import migrate

    try:
        migrate(settings.database_url, settings.database_wait_seconds)
    except Exception as exc:
        if not is_postgres_outage(exc):
            raise
        print(
            f"respool migrate: Postgres was not reachable within {settings.database_wait_seconds:g} s "
            f"(RESPOOL_DATABASE_WAIT_SECONDS): {exc}",
            file=sys.stderr,
        )
        return 1
    return 0


def bench(args: argparse.Namespace, settings: Settings) -> int:
    """`respool bench`: start an upstream, respool (and LiteLLM) on loopback and measure them."""
    try:
        from api.bench.run import run, servers_from
        from api.bench.scenarios import Plan
    except ImportError as exc:
        print(f"respool bench needs its extra: pip install 'respool[bench]' ({exc})", file=sys.stderr)
        return 2
    import dataclasses
    from pathlib import Path

    plan = Plan.quick() if args.quick else Plan()
    workers = tuple(int(count) for count in args.workers.split(","))
    plan = dataclasses.replace(plan, worker_counts=workers)
    litellm = None if args.no_litellm else (args.litellm or "")
    run(plan, Path(args.out), litellm, servers_from(settings), settings.redis_server)
    out = Path(args.out)
    print(f"\nWritten: {out / 'result.json'}, {out / 'latency.png'}, {out / 'cpu.png'}")
    return 0


def hash_key() -> int:
    """`respool hash-key`: the digest of the key on stdin (asked for unechoed on a terminal)."""
    import getpass

    from api.auth import key_digest

    key = getpass.getpass("API key: ") if sys.stdin.isatty() else sys.stdin.readline()
    key = key.strip()
    if not key:
        print("respool hash-key: no key given on stdin", file=sys.stderr)
        return 2
    print(key_digest(key))
    return 0


def _uvicorn_options(settings: Settings) -> dict[str, Any]:
    """uvicorn logs as every respool process does (worker.logs), in each of its processes, and
    believes the forwarded headers of `RESPOOL_FORWARDED_ALLOW_IPS` only."""
    return {
        "log_config": logs.dict_config(settings.log_format, settings.log_level),
        "log_level": settings.log_level,
        "access_log": settings.access_log,
        "forwarded_allow_ips": settings.forwarded_allow_ips,
    }


def _require_servers(settings: Settings) -> None:
    if not settings.has_servers:
        sys.exit(
            "respool: set RESPOOL_REDIS_URL (or RESPOOL_REDIS_SENTINELS) and RESPOOL_DATABASE_URL "
            "(or use `respool up`)."
        )


def _require_redis(settings: Settings) -> None:
    """Exit, saying why, if the Redis configured is one respool cannot run on (worker/compatibility.py)."""
    from worker.compatibility import UnsupportedRedisError, check_redis
    from worker.connections import sync_client

    client = sync_client(settings.redis_url, settings.redis_timeout_seconds)
    try:
        check_redis(client)
    except UnsupportedRedisError as exc:
        sys.exit(f"respool: cannot run on the Redis at RESPOOL_REDIS_URL: {exc}")
    finally:
        client.connection_pool.disconnect()  # the client does not own a pool it was given


def up(settings: Settings) -> int:
    """Start what is missing (embedded Redis and Postgres), migrate, then the API and the workers,
    each started again whenever it exits (api.up.supervisor); the embedded servers are watched."""
    from api.up.embedded import EmbeddedPostgres, EmbeddedRedis
    from api.up.supervisor import Supervisor
    from worker.postgres.migrate import migrate

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    started: list[EmbeddedRedis | EmbeddedPostgres] = []
    try:
        supervisor = Supervisor()
        if settings.redis_url:
            _require_redis(settings)
        else:
            started.append(EmbeddedRedis.start(settings.data_dir, settings.redis_server))
            settings.redis_url = started[-1].url
            supervisor.watch("the embedded Redis", started[-1].process)
        if not settings.database_url:
            started.append(EmbeddedPostgres.start(settings.data_dir))
            settings.database_url = started[-1].url
            supervisor.watch("the embedded Postgres", started[-1].process)
        migrate(settings.database_url, settings.database_wait_seconds)
        return _run_processes(settings, supervisor)
    finally:
        for server in reversed(started):
            server.stop()


def _run_processes(settings: Settings, supervisor: Any) -> int:
    env = {
        **os.environ,
        "RESPOOL_REDIS_URL": settings.redis_url,
        "RESPOOL_DATABASE_URL": settings.database_url,
    }
    command = [sys.executable, "-m", "api"]
    api = [*command, "api", "--host", settings.host, "--port", str(settings.port)]
    supervisor.spawn("api", [*api, "--replicas", str(settings.api_replicas)], env)
    for index in range(settings.workers):
        port = settings.worker_metrics_port + index if settings.worker_metrics_port else 0
        supervisor.spawn(
            f"worker-{index + 1}", [*command, "worker"], {**env, "RESPOOL_WORKER_METRICS_PORT": str(port)}
        )
    _banner(settings)
    code: int = supervisor.wait()
    return code


def _banner(settings: Settings) -> None:
    url = f"http://{settings.host}:{settings.port}"
    key = "<one of RESPOOL_API_KEYS>" if settings.api_keys else "unused"
    print(
        f"\nrespool is up: the API listens on {url}/v1 ({settings.api_replicas} process(es)), with "
        f"{settings.workers} worker process(es).\n"
        f"Data lives in {settings.data_dir.resolve()}. Press Ctrl-C to stop everything.\n\n"
        f"Try it with the openai SDK (the built-in 'synthetic' model needs no upstream):\n\n"
        + EXAMPLE.format(url=url, key=key),
        flush=True,
    )
