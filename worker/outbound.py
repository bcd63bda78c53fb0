"""Outbound connections to URLs that clients name or operators configure (DESIGN.md §13): MCP
servers, search backends, webhook endpoints. Upstream model servers are the operator's own and exempt.

The rule: a connection goes only to a public address. The host is resolved when the connection is
made, and every address it resolves to must be global (not loopback, private, link-local, shared,
multicast, reserved or a cloud metadata address; an IPv4-mapped IPv6 address counts as its IPv4
one), so a name that resolves to a private address — at any moment, DNS rebinding included — is
refused, and the connection goes to the address that was checked. `RESPOOL_OUTBOUND_ALLOWLIST`
opens exceptions: host names (`mcp.internal`), `host:port`s (`localhost:8931`), IP addresses and
CIDRs (`10.0.0.0/8`).

`guard_transport` installs the rule in an httpx (or httpx2, which the `mcp` SDK uses) transport, at
the one place every connection is made: its network backend's `connect_tcp`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from worker.errors import OutboundRefusedError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class OutboundPolicy:
    """Which outbound destinations are allowed: public addresses, and the allowlist's exceptions."""

    hosts: frozenset[str] = frozenset()  # names (lower case), any port
    host_ports: frozenset[tuple[str, int]] = frozenset()
    networks: tuple[IPNetwork, ...] = field(default=())

    @classmethod
    def parse(cls, allowlist: str) -> OutboundPolicy:
        """The policy of a `RESPOOL_OUTBOUND_ALLOWLIST` value (comma-separated entries)."""
        hosts, host_ports, networks = set(), set(), []
        for raw in allowlist.split(","):
            entry = raw.strip().lower()
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            host, _, port = entry.rpartition(":")
            if port.isdigit() and (entry.count(":") == 1 or host.endswith("]")):  # `name:port`, `[v6]:port`
                host_ports.add((host.strip("[]"), int(port)))
            else:
                hosts.add(entry)
        return cls(frozenset(hosts), frozenset(host_ports), tuple(networks))

    def opens(self, host: str, port: int, address: IPAddress | None = None) -> bool:
        """Whether the allowlist opens `host:port` (as named), or `address` (as resolved)."""
        name = host.lower().strip("[]")
        if name in self.hosts or (name, port) in self.host_ports:
            return True
        return address is not None and any(address in network for network in self.networks)

    def check_url(self, url: str) -> None:
        """What can be told before connecting: an http(s) URL with a host, and, when the host is an IP
        address or `localhost`, one the rule allows. Raises `OutboundRefusedError`."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise OutboundRefusedError(f"'{url}' is not an http(s) URL with a host.")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = parts.hostname
        if host == "localhost" or host.endswith(".localhost"):
            if not self.opens(host, port, ipaddress.ip_address("127.0.0.1")):
                raise OutboundRefusedError(_refusal(host, port, "a loopback address"))
            return
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return  # a name: checked when it is resolved, at connect time
        self.check_address(host, port, address)

    def check_address(self, host: str, port: int, address: IPAddress) -> None:
        kind = blocked_kind(address)
        if kind is not None and not self.opens(host, port, address):
            raise OutboundRefusedError(_refusal(host, port, kind))

    async def resolve(self, host: str, port: int) -> str:
        """The address to connect to for `host:port`: every address it resolves to must be allowed."""
        try:
            literal: IPAddress | None = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            literal = None
        if literal is not None:
            self.check_address(host, port, literal)
            return str(literal)
        loop = asyncio.get_running_loop()
        try:
            found = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise OutboundRefusedError(f"'{host}' could not be resolved: {exc.strerror}.") from exc
        addresses = [ipaddress.ip_address(info[4][0]) for info in found]
        for address in addresses:
            self.check_address(host, port, address)
        return str(addresses[0])


def blocked_kind(address: IPAddress) -> str | None:
    """What kind of non-public address `address` is, or None for a public one."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    checks = (
        ("a loopback address", address.is_loopback),
        ("a link-local or cloud metadata address", address.is_link_local),
        ("a multicast address", address.is_multicast),
        ("an unspecified address", address.is_unspecified),
        ("a private address", address.is_private),
        ("a non-public address", not address.is_global),
    )
    return next((kind for kind, hit in checks if hit), None)


def _refusal(host: str, port: int, kind: str) -> str:
    return (
        f"'{host}' is {kind}; respool connects only to public addresses unless "
        f"RESPOOL_OUTBOUND_ALLOWLIST opens it (e.g. '{host}:{port}')."
    )


class GuardedBackend:
    """A network backend (httpcore's or httpcore2's) whose TCP connections follow `policy`."""

    def __init__(self, inner: Any, policy: OutboundPolicy) -> None:
        self.inner = inner
        self.policy = policy

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (the backend interface names it so)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> Any:
        address = await self.policy.resolve(host, port)
        return await self.inner.connect_tcp(
            address, port, timeout=timeout, local_address=local_address, socket_options=socket_options
        )

    async def connect_unix_socket(self, *args: Any, **kwargs: Any) -> Any:
        raise OutboundRefusedError("Outbound connections go over TCP only.")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def guard_transport[T](transport: T, policy: OutboundPolicy) -> T:
    """`transport` (an httpx or httpx2 `AsyncHTTPTransport` without a proxy), its connections
    following `policy`. TLS still checks the certificate against the host named in the URL."""
    pool = transport._pool  # type: ignore[attr-defined]  # the connection pool both libraries keep here
    pool._network_backend = GuardedBackend(pool._network_backend, policy)
    return transport
