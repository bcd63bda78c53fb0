"""deploy/nginx.conf's proxy settings in front of real `respool api` replicas on loopback. The
README's update without a gap, for real: replicas replaced one set at a time as README's procedure
replaces compose's (start the new ones beside the old, wait until they are healthy, stop the old),
with clients sending creates and reads through nginx the whole time, and not one 502 from a lack of
replicas. And the address the API's log names is the one nginx saw, whatever a client writes.

Debian's nginx (1.22) has no `resolve` for an upstream's server, so the file's one `server api:8000
resolve` becomes a line per replica address, every address the update uses at once: what nginx holds
while Docker's DNS names both the old replicas and the new, the new ones before they listen.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import own_stack
from tests.support.stack import Servers, Stack, free_port, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.once]

ROOT = Path(__file__).resolve().parents[2]
NGINX_CONF = ROOT / "deploy" / "nginx.conf"
ROUNDS = 10
CLIENTS = 4


def nginx_config(prefix: Path, port: int, replicas: list[int], conf: str | None = None) -> str:
    """deploy/nginx.conf (or `conf`) as a whole nginx.conf listening on `port`, its upstream the
    `replicas` on loopback with the file's own server parameters, everything else as shipped."""
    text = conf if conf is not None else NGINX_CONF.read_text()
    server = re.search(r"^(\s*)server api:8000 resolve(.*);$", text, re.MULTILINE)
    assert server, "deploy/nginx.conf has no `server api:8000 resolve ...;`"
    indent, parameters = server.groups()
    servers = "\n".join(f"{indent}server 127.0.0.1:{replica}{parameters};" for replica in replicas)
    text = text[: server.start()] + servers + text[server.end() :]
    text = re.sub(r"^resolver .*;$", "", text, flags=re.MULTILINE)
    text = text.replace("listen 8000;", f"listen 127.0.0.1:{port};")
    user = "user root;\n" if os.geteuid() == 0 else ""
    temp = "\n".join(
        f"    {kind}_temp_path {prefix / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return (
        f"{user}worker_processes 1;\npid {prefix / 'nginx.pid'};\nerror_log {prefix / 'error.log'} warn;\n"
        f"events {{}}\nhttp {{\n    access_log off;\n{temp}\n{text}\n}}\n"
    )


@dataclass
class Load:
    """Clients sending creates and reads through nginx until stopped; what they were answered."""

    url: str
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stop.is_set():
                for method, path, body in (
                    ("POST", "/v1/responses", {"model": "synthetic", "input": "hi", "background": True}),
                    ("GET", "/v1/models", None),
                ):
                    try:
                        status = str(client.request(method, path, json=body).status_code)
                    except httpx.HTTPError as exc:
                        status = type(exc).__name__
                    self.statuses[f"{method} {status}"] += 1


@dataclass
class Replicas:
    """`respool api` processes on fixed loopback ports, started and stopped by slot."""

    stack: Stack
    ports: list[int]
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, port: int) -> None:
        with (self.stack.logs / f"api-{port}.log").open("ab") as log:
            self.processes[port] = subprocess.Popen(
                [sys.executable, "-m", "api", "api", "--host", "127.0.0.1", "--port", str(port)],
                env={**self.stack.env, "PYTHONUNBUFFERED": "1"},
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_healthy(self, port: int) -> None:
        def healthy() -> bool:
            assert self.processes[port].poll() is None, f"the replica on {port} exited"
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, timeout=60, what=f"the replica on {port} to be healthy")

    def stop(self, port: int) -> None:
        """As `docker stop` does: SIGTERM (uvicorn finishes what it serves), then wait for the exit."""
        process = self.processes.pop(port)
        process.send_signal(signal.SIGTERM)
        process.wait(30)

    def stop_all(self) -> None:
        for port in list(self.processes):
            self.processes[port].kill()
            self.processes.pop(port).wait()


@contextmanager
def nginx(prefix: Path, port: int, replicas: list[int], conf: str | None = None) -> Iterator[str]:
    """Debian's nginx with `nginx_config`, in the foreground; its URL."""
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    prefix.mkdir(parents=True, exist_ok=True)
    config = prefix / "nginx.conf"
    config.write_text(nginx_config(prefix, port, replicas, conf))
    process = subprocess.Popen(
        [binary, "-p", str(prefix), "-c", str(config), "-g", "daemon off;"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(url, process), timeout=20, what="nginx to listen")
        yield url
    finally:
        process.terminate()
        process.wait(10)


def _answers(url: str, process: subprocess.Popen[bytes]) -> bool:
    assert process.poll() is None, "nginx exited"
    try:
        httpx.get(url + "/healthz", timeout=1)
        return True
    except httpx.HTTPError:
        return False


def rolling_updates(replicas: Replicas, url: str, rounds: int) -> collections.Counter[str]:
    """`rounds` updates of two replicas by two new ones, under load through `url`; what the clients
    were answered, by method and status."""
    old, new = replicas.ports[:2], replicas.ports[2:]
    for port in old:
        replicas.start(port)
    for port in old:
        replicas.wait_healthy(port)
    load = Load(url)
    clients = [threading.Thread(target=load.run) for _ in range(CLIENTS)]
    for client in clients:
        client.start()
    try:
        for _ in range(rounds):
            for port in new:  # `up -d --no-recreate --scale api=4`: the new ones beside the old
                replicas.start(port)
            for port in new:  # `docker compose ps api` until the new ones are healthy
                replicas.wait_healthy(port)
            for port in old:  # `docker stop` the old ones
                replicas.stop(port)
            old, new = new, old
        time.sleep(1)  # requests to the last replicas, after the last stop
    finally:
        load.stop.set()
        for client in clients:
            client.join(60)
    return load.statuses


@pytest.fixture
def replicas(backing: Servers, session_dir: Path, stack: Stack) -> Iterator[Replicas]:
    """Four replica slots on the session's migrated servers, no keys (loopback), no worker."""
    running = own_stack(backing, session_dir, "rolling-update")
    slots = Replicas(running, [free_port() for _ in range(4)])
    yield slots
    slots.stop_all()


@pytest.mark.timeout(900)
def test_the_readme_rolling_update_sends_no_502(replicas: Replicas, tmp_path: Path) -> None:
    """Ten rounds of README's update under creates and reads through deploy/nginx.conf's settings:
    nginx never runs out of replicas ("no live upstreams"), every read is answered by a replica, and
    a create meets a 502 only in the race docs/deployment.md describes (sent on a kept-alive
    connection just as its replica closed it to stop), a few times in ten rounds at most."""
    prefix = tmp_path / "nginx"
    with nginx(prefix, free_port(), replicas.ports) as url:
        statuses = rolling_updates(replicas, url, ROUNDS)
    errors = (prefix / "error.log").read_text()
    assert "no live upstreams" not in errors
    reads = {key: count for key, count in statuses.items() if key.startswith("GET ")}
    creates = {key: count for key, count in statuses.items() if key.startswith("POST ")}
    assert set(reads) == {"GET 200"}, statuses
    assert set(creates) <= {"POST 200", "POST 502"}, statuses
    assert creates.get("POST 502", 0) < ROUNDS / 2, statuses
    assert reads["GET 200"] > 100, statuses


def test_a_client_cannot_forge_the_address_the_log_names(replicas: Replicas, tmp_path: Path) -> None:
    """Through deploy/nginx.conf, an API that believes any peer's X-Forwarded-For (compose's "*")
    logs the address nginx saw, not the one a client wrote in its own X-Forwarded-For."""
    replicas.stack.env["RESPOOL_FORWARDED_ALLOW_IPS"] = "*"
    port = replicas.ports[0]
    replicas.start(port)
    replicas.wait_healthy(port)
    forged = "203.0.113.7"
    with nginx(tmp_path / "nginx", free_port(), [port]) as url:
        assert httpx.get(url + "/v1/models", headers={"x-forwarded-for": forged}).status_code == 200
    log = replicas.stack.logs / f"api-{port}.log"
    line = wait_for(
        lambda: next((line for line in log.read_text().splitlines() if "GET /v1/models" in line), None),
        timeout=10,
        what="the access-log line",
    )
    assert forged not in line
    assert '127.0.0.1:0 - "GET /v1/models' in line


if __name__ == "__main__":  # a measurement by hand: python -m tests.deploy.test_rolling_update
    import tempfile

    from tests.conftest import _env
    from tests.support.stack import servers

    conf = sys.argv[1] if len(sys.argv) > 1 else None
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else ROUNDS
    with servers() as backing, tempfile.TemporaryDirectory() as folder:
        from worker.postgres.migrate import migrate

        migrate(backing.database_url)
        logs = Path(folder) / "logs"
        logs.mkdir()
        slots = Replicas(Stack(_env(backing), logs), [free_port() for _ in range(4)])
        try:
            text = Path(conf).read_text() if conf else None
            with nginx(Path(folder) / "nginx", free_port(), slots.ports, text) as url:
                print(dict(rolling_updates(slots, url, rounds)))
            print(
                "".join(
                    line for line in (Path(folder) / "nginx" / "error.log").open() if "refused" not in line
                )
            )
        finally:
            slots.stop_all()
