"""No silent insecurity: `respool api` (and `respool up`) without RESPOOL_API_KEYS refuses to listen
anywhere but loopback unless RESPOOL_ALLOW_NO_AUTH=true, and compose's entrypoint hands the keys an
operator gave in the shell or .env to respool without losing respool.env's. Real processes: the
API on the session's servers, started as `respool api` and through deploy/compose-entrypoint.sh."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import KEY_A, own_stack
from tests.support.stack import Servers, Stack, free_port, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.once]  # respool's own rule, whatever the servers

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "deploy" / "compose-entrypoint.sh"
REFUSAL_TIMEOUT = 60  # a process start on a busy machine


@pytest.fixture(scope="module")
def base(backing: Servers, session_dir: Path, stack: Stack) -> Stack:
    """An environment on the session's migrated servers, with no key and no permission in it."""
    running = own_stack(backing, session_dir, "no-auth")
    # What `respool` the entrypoint runs: the one of the venv running the tests.
    running.env["PATH"] = f"{Path(sys.executable).parent}:{running.env.get('PATH', '')}"
    return running


@pytest.fixture
def served(base: Stack) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The processes a test starts, stopped after it."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _start(base: Stack, started: list[subprocess.Popen[bytes]], command: list[str], **env: str) -> str:
    """Start `command` (ending in its --host) on a free port; its URL on loopback once it serves."""
    port = free_port()
    log = base.logs / f"api-{port}.log"
    with log.open("wb") as output:  # the child keeps its own copy
        process = subprocess.Popen(
            [*command, "--port", str(port)],
            env={**base.env, **env},
            cwd=ROOT,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    started.append(process)
    url = f"http://127.0.0.1:{port}"

    def serves() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"exited {process.returncode}: {log.read_text()}")
        try:
            return httpx.get(url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(serves, timeout=60, what=f"{command} to serve")
    return url


def _refusal(base: Stack, command: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        env={**base.env, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=REFUSAL_TIMEOUT,
        check=False,
    )


RESPOOL = [sys.executable, "-m", "api"]


@pytest.mark.parametrize(
    "command",
    [
        [*RESPOOL, "api", "--host", "0.0.0.0", "--port", "0"],
        [*RESPOOL, "up", "--host", "0.0.0.0", "--port", "0"],
        ["sh", str(ENTRYPOINT), "api", "--host", "0.0.0.0", "--port", "0"],
    ],
    ids=["api", "up", "compose-entrypoint"],
)
def test_no_keys_off_loopback_refuses_to_start(base: Stack, command: list[str]) -> None:
    """Without keys or RESPOOL_ALLOW_NO_AUTH, an API bound to every interface exits at once, saying
    which setting to give; `up` starts nothing (no embedded server, no process)."""
    result = _refusal(base, command, RESPOOL_DATA_DIR=str(base.logs / "up-data"))
    assert result.returncode != 0
    assert "refusing to serve 0.0.0.0" in result.stderr
    assert "RESPOOL_API_KEYS" in result.stderr and "RESPOOL_ALLOW_NO_AUTH=true" in result.stderr
    assert not (base.logs / "up-data").exists()


def test_allow_no_auth_serves_everyone_off_loopback(
    base: Stack, served: list[subprocess.Popen[bytes]]
) -> None:
    """RESPOOL_ALLOW_NO_AUTH=true is the operator's explicit word: the API serves without a key."""
    url = _start(base, served, [*RESPOOL, "api", "--host", "0.0.0.0"], RESPOOL_ALLOW_NO_AUTH="true")
    assert httpx.get(url + "/v1/models").status_code == 200


def test_no_keys_on_loopback_serves_as_before(base: Stack, served: list[subprocess.Popen[bytes]]) -> None:
    """On loopback (`respool up` on a laptop) no keys still means an open API, with its warning."""
    url = _start(base, served, [*RESPOOL, "api", "--host", "127.0.0.1"])
    assert httpx.get(url + "/v1/models").status_code == 200


@pytest.mark.parametrize(
    "env",
    [
        {"FROM_SHELL_RESPOOL_API_KEYS": f"{KEY_A}:tenant-a", "FROM_SHELL_RESPOOL_ALLOW_NO_AUTH": ""},
        {"RESPOOL_API_KEYS": f"{KEY_A}:tenant-a", "FROM_SHELL_RESPOOL_API_KEYS": ""},
        {"RESPOOL_API_KEYS": "other-key:tenant-b", "FROM_SHELL_RESPOOL_API_KEYS": f"{KEY_A}:tenant-a"},
    ],
    ids=["from-the-shell", "from-respool-env", "the-shell-wins"],
)
def test_compose_entrypoint_hands_over_the_keys(
    base: Stack, served: list[subprocess.Popen[bytes]], env: dict[str, str]
) -> None:
    """Keys from the shell or .env (compose's FROM_SHELL_*) reach the API, and win over respool.env's
    as compose's `environment:` does; without them respool.env's keys stand: the API asks for a key."""
    url = _start(base, served, ["sh", str(ENTRYPOINT), "api", "--host", "0.0.0.0"], **env)
    assert httpx.get(url + "/v1/models").status_code == 401
    authorized = {"authorization": f"Bearer {KEY_A}"}
    assert httpx.get(url + "/v1/models", headers=authorized).status_code == 200
