"""The API's access log behind a reverse proxy (issue 15): a trusted proxy's X-Forwarded-For names
the client (RESPOOL_FORWARDED_ALLOW_IPS); health checks leave no line at the default level."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import own_stack
from tests.support.stack import Servers, Stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.once]  # uvicorn's behaviour, whatever the servers

CLIENT = "203.0.113.7"  # a documentation address: the client a proxy in front says it forwards for


@dataclass
class Apis:
    stack: Stack
    urls: dict[str, str]

    def ask(self, name: str) -> str:
        """A health check, then a request, both through a "proxy" that forwards for CLIENT; the
        request's access-log line."""
        headers = {"x-forwarded-for": CLIENT}
        assert httpx.get(self.urls[name] + "/healthz", headers=headers).status_code == 200
        assert httpx.get(self.urls[name] + "/v1/models", headers=headers).status_code == 200
        return wait_for(
            lambda: next(
                (line for line in self.stack.log(name).splitlines() if "GET /v1/models" in line), None
            ),
            timeout=10,
            what=f"{name}'s access-log line",
        )


@pytest.fixture(scope="module")
def apis(backing: Servers, session_dir: Path, stack: Stack) -> Iterator[Apis]:
    """Two APIs: one trusting this test (on loopback) as its proxy, one trusting another address."""
    running = own_stack(backing, session_dir, "proxy")
    urls = {}
    for name, trusted in (("trusting", "127.0.0.1"), ("distrusting", "10.9.9.9")):
        running.env["RESPOOL_FORWARDED_ALLOW_IPS"] = trusted
        urls[name] = running.start_api(name)
    yield Apis(running, urls)
    running.stop_all()


def test_a_trusted_proxy_names_the_client(apis: Apis) -> None:
    """With the proxy's address in RESPOOL_FORWARDED_ALLOW_IPS the access log names the client it forwards for."""
    assert f'{CLIENT}:0 - "GET /v1/models' in apis.ask("trusting")


def test_an_untrusted_peer_cannot_name_a_client(apis: Apis) -> None:
    """Any other peer's X-Forwarded-For is ignored: the log names the peer itself."""
    line = apis.ask("distrusting")
    assert CLIENT not in line
    assert "127.0.0.1:" in line


@pytest.mark.parametrize("name", ["trusting", "distrusting"])
def test_health_checks_leave_no_line(apis: Apis, name: str) -> None:
    """At the default level the access log has a line a request, and none for /healthz."""
    apis.ask(name)
    assert "/healthz" not in apis.stack.log(name)
