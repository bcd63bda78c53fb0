"""Where a secret could be left behind by a run, read back as bytes, and a search of it all.

Owns the collectors, one per kind of place: the processes' log files, every row of every table of a
Postgres database, every Redis key and value (RQ's zlib- and base64-packed fields unpacked as RQ
unpacks them, and jobs read back through RQ itself), and Prometheus scrapes. Each returns
`{where: content}`; `search` names every place that holds any of the secrets.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import httpx
from redis import Redis
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

type Places = dict[str, bytes]


def search(places: Mapping[str, bytes], secrets: Mapping[str, str]) -> list[str]:
    """`"<secret name> in <place>"` for every place holding a secret, as given."""
    return [
        f"{name} in {where}"
        for where, content in places.items()
        for name, secret in secrets.items()
        if secret.encode() in content
    ]


def log_files(directory: Path) -> Places:
    """Every file a stack's processes logged to."""
    return {f"log {path.name}": path.read_bytes() for path in sorted(directory.iterdir()) if path.is_file()}


def database_rows(database_url: str) -> Places:
    """Every row of every table outside Postgres's own schemas, each row as Postgres prints it."""
    engine = create_engine(database_url, poolclass=NullPool)
    places: Places = {}
    try:
        with engine.connect() as conn:
            tables = conn.execute(
                text(
                    "SELECT schemaname, tablename FROM pg_tables "
                    "WHERE schemaname NOT IN ('pg_catalog', 'information_schema')"
                )
            ).all()
            for schema, table in tables:
                rows = conn.execute(text(f'SELECT t::text FROM "{schema}"."{table}" AS t')).scalars()
                places[f"table {schema}.{table}"] = "\n".join(rows).encode()
    finally:
        engine.dispose()
    return places


def redis_contents(redis: Redis, job_ids: Iterable[str] = ()) -> Places:
    """Every key and value in the database, unpacked; and the named RQ jobs as RQ reads them back."""
    places: Places = {}
    for key in redis.scan_iter(count=1000):
        parts = [key, *_values(redis, key)]
        places[f"redis {key.decode(errors='replace')}"] = b"\n".join(
            unpacked for part in parts for unpacked in _unpacked(part)
        )
    for job_id in job_ids:
        places[f"rq job {job_id}"] = _job(redis, job_id)
    return places


def _values(redis: Redis, key: bytes) -> list[bytes]:
    kind = redis.type(key)
    values: list[bytes] = []
    if kind == b"string":
        values = [redis.get(key) or b""]
    elif kind == b"hash":
        values = [part for pair in redis.hgetall(key).items() for part in pair]
    elif kind == b"list":
        values = list(redis.lrange(key, 0, -1))
    elif kind == b"set":
        values = list(redis.smembers(key))
    elif kind == b"zset":
        values = [member for member, _ in redis.zrange(key, 0, -1, withscores=True)]
    elif kind == b"stream":
        values = [part for _, fields in redis.xrange(key) for pair in fields.items() for part in pair]
    return values


def _unpacked(value: bytes) -> list[bytes]:
    """The value, and what it holds if RQ packed it: zlib (job data, exc_info), base64 of serialized
    or of zlib'd bytes (results)."""
    found = [value]
    with contextlib.suppress(binascii.Error, ValueError):
        found.append(base64.b64decode(value, validate=True))
    for packed in list(found):
        with contextlib.suppress(zlib.error):
            found.append(zlib.decompress(packed))
    return found


def _job(redis: Redis, job_id: str) -> bytes:
    try:
        job = Job.fetch(job_id, connection=redis, serializer=JSONSerializer)
    except NoSuchJobError:
        return b""
    held = (job.func_name, job.args, job.kwargs, job.meta, job.description)
    results = [(result.return_value, result.exc_string) for result in job.results()]
    return repr((held, results)).encode()


def scrapes(urls: Mapping[str, str]) -> Places:
    """Each `/metrics` answer, by name."""
    return {f"metrics {name}": httpx.get(url, timeout=10).content for name, url in urls.items()}
