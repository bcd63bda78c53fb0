"""A hung Postgres (the whole instance SIGSTOPped for 20 s: alive to the kernel, silent to clients)
never hangs respool (docs/postgres.md): `/readyz` answers 503 within 2 s, every route that needs
Postgres answers 503 with `retry-after` within RESPOOL_DATABASE_TIMEOUT_SECONDS, and once Postgres
answers again (SIGCONT) every response that was running ends exactly once.

A server-side `statement_timeout` cannot help here (a stopped server runs no timer), nor can TCP's
(the kernel still answers): only the client's own deadline does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.test_outages import ROUTES, Scene, assert_503, assert_one_end, stage
from tests.conftest import KEY_A, _env, make_sdk
from tests.support.outages import Restartable
from tests.support.stack import Stack, running_stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.faults]

DEADLINE = 3.0  # RESPOOL_DATABASE_TIMEOUT_SECONDS, short to keep the module short
CONNECT_TIMEOUT = 2  # RESPOOL_DATABASE_CONNECT_TIMEOUT_SECONDS (libpq's least)
READY_SECONDS = 2.0  # the most a probe's answer may take (its own timeout is short)
SLACK = 1.0  # a request's own work and this loaded machine's scheduling, on top of its deadline
FROZEN_SECONDS = 20.0
CLIENT_TIMEOUT = 30.0  # a hang shows up as openai.APITimeoutError


@pytest.fixture(scope="module")
def hung(servers: Restartable, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """An API and a worker on `servers`; the synthetic model writes a word every 0.05 s."""
    env = _env(
        servers,  # type: ignore[arg-type]  # has the two URLs Servers has
        RESPOOL_API_KEYS=f"{KEY_A}:tenant-a",
        RESPOOL_SYNTHETIC_DELAY_SECONDS="0.05",
        RESPOOL_RETRY_AFTER_SECONDS="3",
        RESPOOL_DATABASE_TIMEOUT_SECONDS=str(DEADLINE),
        RESPOOL_DATABASE_CONNECT_TIMEOUT_SECONDS=str(CONNECT_TIMEOUT),
    )
    with running_stack(env, tmp_path_factory.mktemp("hung-logs")) as stack:
        yield stack


@pytest.fixture(scope="module")
def sdk(hung: Stack) -> Iterator[openai.OpenAI]:
    with make_sdk(hung.url, KEY_A).with_options(timeout=CLIENT_TIMEOUT) as client:
        yield client


@dataclass
class Freeze:
    """What the routes answered while Postgres was stopped, and how long each took."""

    scene: Scene
    answers: dict[str, tuple[float, BaseException | None]] = field(default_factory=dict)
    ready: list[tuple[float, int]] = field(default_factory=list)


def instance(servers: Restartable) -> list[int]:
    """The postmaster's pid, then its children's (each backend is a session of its own, so the
    postmaster's process group holds the postmaster alone)."""
    assert servers.postgres is not None
    postmaster = servers.postgres.process.pid
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == postmaster:
                children.append(int(entry.name))
    return [postmaster, *children]


def freeze(servers: Restartable) -> None:
    """SIGSTOP the whole instance, the postmaster first (it forks no backend after)."""
    assert servers.postgres is not None
    os.kill(servers.postgres.process.pid, signal.SIGSTOP)
    for pid in instance(servers)[1:]:
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            os.kill(pid, signal.SIGSTOP)


def thaw(servers: Restartable) -> None:
    for pid in instance(servers):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def timed(call: object) -> tuple[float, BaseException | None]:
    started = time.monotonic()
    try:
        call()  # type: ignore[operator]
    except Exception as exc:
        return time.monotonic() - started, exc
    return time.monotonic() - started, None


def readyz(stack: Stack) -> tuple[float, int]:
    """How long /readyz took, and its status (0: no answer within the client's timeout)."""
    started = time.monotonic()
    try:
        status = httpx.get(stack.url + "/readyz", timeout=CLIENT_TIMEOUT).status_code
    except httpx.TimeoutException:
        status = 0
    return time.monotonic() - started, status


def warm(stack: Stack, sdk: openai.OpenAI, scene: Scene) -> None:
    """Reads at once, so that the API's pools hold connections for the freeze to find: a statement
    on one hangs, unlike a connect, which gives up after its own timeout."""
    reads = [
        lambda: sdk.responses.retrieve(scene.done.id),
        lambda: sdk.responses.input_items.list(scene.done.id),
    ]
    with ThreadPoolExecutor(12) as pool:
        for _ in range(3):
            list(pool.map(lambda read: read(), reads * 6))
            list(pool.map(lambda _: readyz(stack), range(6)))


@pytest.fixture(scope="module")
def frozen(servers: Restartable, hung: Stack, sdk: openai.OpenAI) -> Iterator[Freeze]:
    """Responses staged (finished, running, some to end while Postgres is stopped, some after),
    Postgres stopped for FROZEN_SECONDS, every route and /readyz asked at once meanwhile; then it
    goes on."""
    scene = stage(sdk, lengths=(20, 120, 500))
    warm(hung, sdk, scene)
    frozen = Freeze(scene)
    freeze(servers)
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(len(ROUTES) + 1) as pool:
            asked = {
                route: pool.submit(timed, lambda call=call: call(sdk, scene))
                for route, call in ROUTES.items()
            }
            probes = pool.submit(lambda: [readyz(hung) for _ in range(3)])
            frozen.answers = {route: future.result() for route, future in asked.items()}
            frozen.ready = probes.result()
        frozen.ready.append(readyz(hung))  # on connections the routes' timeouts left behind
        time.sleep(max(0.0, FROZEN_SECONDS - (time.monotonic() - started)))
    finally:
        thaw(servers)
    return frozen


def test_readyz_answers_503_within_2_s(hung: Stack, frozen: Freeze) -> None:
    """Each /readyz while Postgres is stopped is a 503 within 2 s; /healthz stays 200."""
    assert [status for _, status in frozen.ready] == [503] * len(frozen.ready)
    assert max(elapsed for elapsed, _ in frozen.ready) < READY_SECONDS, frozen.ready


@pytest.mark.parametrize("route", ROUTES)
def test_each_route_answers_503_within_its_deadline(frozen: Freeze, route: str) -> None:
    """Each route, asked while Postgres is stopped, answers 503 with `retry-after` within the
    database's deadline, not after the freeze."""
    elapsed, raised = frozen.answers[route]

    def again() -> None:
        if raised is not None:
            raise raised

    assert_503(again)
    assert elapsed < DEADLINE + CONNECT_TIMEOUT + SLACK, f"{route} took {elapsed:.1f} s"


def test_every_response_ends_once_after_sigcont(hung: Stack, sdk: openai.OpenAI, frozen: Freeze) -> None:
    """Once Postgres answers again, /readyz is 200, every response that was running ends once,
    `completed`, what was stored is intact, and new work flows."""
    wait_for(lambda: readyz(hung)[1] == 200, timeout=30, what="/readyz to say ready")
    scene = frozen.scene
    for response_id in [scene.live, *scene.in_flight]:
        assert assert_one_end(sdk, response_id).status == "completed"
    again = sdk.responses.retrieve(scene.done.id)
    assert (again.status, again.output_text) == ("completed", scene.done.output_text)
    sdk.responses.delete(scene.spare)
    fresh = sdk.responses.create(model="synthetic", input="after the freeze")
    assert fresh.status == "completed"
    assert hung.processes["worker"].poll() is None, hung.log("worker")[-3000:]
