"""The SSRF rule (DESIGN.md §13): public addresses only, unless the allowlist opens one; checked on
the address a connection actually goes to, through a real httpx transport and a real local server."""

from __future__ import annotations

import asyncio
import http.server
import ipaddress
import threading
from collections.abc import Iterator

import httpx
import pytest

from worker.errors import OutboundRefusedError
from worker.outbound import OutboundPolicy, blocked_kind, guard_transport


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "a loopback address"),
        ("::1", "a loopback address"),
        ("10.1.2.3", "a private address"),
        ("192.168.0.10", "a private address"),
        ("172.16.5.4", "a private address"),
        ("169.254.169.254", "a link-local or cloud metadata address"),
        ("fe80::1", "a link-local or cloud metadata address"),
        ("fd00:ec2::254", "a private address"),
        ("100.100.100.200", "a non-public address"),
        ("0.0.0.0", "an unspecified address"),
        ("224.0.0.1", "a multicast address"),
        ("::ffff:127.0.0.1", "a loopback address"),
        ("93.184.216.34", None),
        ("2606:4700::1111", None),
    ],
)
def test_only_public_addresses_pass(address: str, kind: str | None) -> None:
    assert blocked_kind(ipaddress.ip_address(address)) == kind


def test_the_allowlist_opens_hosts_ports_and_networks() -> None:
    policy = OutboundPolicy.parse(" mcp.internal , localhost:8931,10.0.0.0/8, [::1]:9000, 192.168.1.5")
    assert policy.opens("MCP.internal", 1)
    assert policy.opens("localhost", 8931) and not policy.opens("localhost", 8932)
    assert policy.opens("x", 1, ipaddress.ip_address("10.9.9.9"))
    assert not policy.opens("x", 1, ipaddress.ip_address("11.0.0.1"))
    assert policy.opens("::1", 9000)
    assert policy.opens("y", 1, ipaddress.ip_address("192.168.1.5"))


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9/mcp",
        "http://localhost/mcp",
        "http://[::1]/",
        "http://169.254.169.254/latest",
        "ftp://x/",
    ],
)
def test_urls_that_name_blocked_addresses_are_refused_before_connecting(url: str) -> None:
    with pytest.raises(OutboundRefusedError):
        OutboundPolicy().check_url(url)


def test_names_pass_the_url_check_and_are_checked_when_resolved() -> None:
    OutboundPolicy().check_url("https://mcp.example.com/mcp")
    with pytest.raises(OutboundRefusedError, match="a loopback address"):
        asyncio.run(OutboundPolicy().resolve("localhost", 80))


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def listening() -> Iterator[int]:
    """A real HTTP server on loopback."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


async def _get(url: str, policy: OutboundPolicy) -> httpx.Response:
    transport = guard_transport(httpx.AsyncHTTPTransport(), policy)
    async with httpx.AsyncClient(transport=transport) as client:
        return await client.get(url)


def test_a_name_resolving_to_loopback_is_refused_at_connect_time(listening: int) -> None:
    """No URL check ran here: the connection itself is refused, after `localhost` resolved."""
    with pytest.raises(OutboundRefusedError, match="'localhost' is a loopback address"):
        asyncio.run(_get(f"http://localhost:{listening}/", OutboundPolicy()))


def test_the_allowlist_lets_the_same_connection_through(listening: int) -> None:
    policy = OutboundPolicy.parse(f"localhost:{listening}")
    assert asyncio.run(_get(f"http://localhost:{listening}/", policy)).text == "ok"
    by_network = OutboundPolicy.parse("127.0.0.0/8")
    assert asyncio.run(_get(f"http://127.0.0.1:{listening}/", by_network)).text == "ok"
