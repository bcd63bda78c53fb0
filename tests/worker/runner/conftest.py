"""The fault tests' fixtures: each module its own API (`faults`), each test its own workers (`lab`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from tests.conftest import make_sdk, own_stack
from tests.support.faults import KILL
from tests.support.lab import Lab
from tests.support.stack import Servers, Stack
from tests.support.upstream_process import ScriptedUpstream


@pytest.fixture(scope="module")
def faults(backing: Servers, upstream: ScriptedUpstream, session_dir: Path, stack: Stack) -> Iterator[Stack]:
    """An API of this module's own; each test starts the workers it kills."""
    running = own_stack(
        backing,
        session_dir,
        "faults",
        RESPOOL_UPSTREAM_URL=upstream.url,
        RESPOOL_UPSTREAM_API="chat",
        RESPOOL_DRAIN_SECONDS="60",
    )
    running.start_api()
    yield running
    running.stop_all()


@pytest.fixture
def lab(faults: Stack, upstream: ScriptedUpstream, backing: Servers, model: str) -> Iterator[Lab]:
    with make_sdk(faults.url, "unused") as sdk, Redis.from_url(backing.redis_url) as redis:
        running = Lab(faults, sdk, upstream, redis, model)
        yield running
        for name in running.workers:
            if name in faults.processes:
                faults.stop(name, KILL)
