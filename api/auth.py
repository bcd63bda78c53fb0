"""Bearer-key auth: each key names its owner (tenant); without keys the API is open (and says so).

`RESPOOL_API_KEYS` lists `key:tenant` or `sha256:<64 hex digits>:tenant` entries, comma-separated.
Only SHA-256 digests of keys are kept in memory: a plaintext entry is hashed as it is read, and a
presented bearer key is hashed once, then compared with every entry's digest in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re

from fastapi import Request

from worker.errors import AuthenticationError
from worker.settings import Settings

log = logging.getLogger("respool.api")

OPEN_OWNER = "default"
DIGEST_PREFIX = "sha256:"
_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")


def key_digest(key: str) -> str:
    """How a key is written hashed in `RESPOOL_API_KEYS`: `sha256:<hex>` (`respool hash-key`)."""
    return DIGEST_PREFIX + _digest(key).hex()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _parse_entry(entry: str, position: int) -> tuple[bytes, str]:
    """One entry as (the key's digest, its owner); ValueError naming what is wrong, never the key."""
    where = f"RESPOOL_API_KEYS entry {position}"
    if entry.startswith(DIGEST_PREFIX):
        hex_digest, _, owner = entry.removeprefix(DIGEST_PREFIX).partition(":")
        if not _HEX_DIGEST.fullmatch(hex_digest):
            problem = (
                f"has {len(hex_digest)} characters" if len(hex_digest) != 64 else "has non-hex characters"
            )
            raise ValueError(
                f"{where}: a hashed key is 'sha256:<64 hex digits>:tenant', but its digest {problem} "
                "(compute it with `respool hash-key`)"
            )
        if not owner:
            raise ValueError(f"{where}: a hashed key needs its tenant: 'sha256:<64 hex digits>:tenant'")
        return bytes.fromhex(hex_digest), owner
    key, _, owner = entry.partition(":")
    if not key or not owner:
        raise ValueError(f"{where}: entries must look like 'key:tenant' or 'sha256:<64 hex digits>:tenant'")
    return _digest(key), owner


class Keys:
    """The configured keys, `RESPOOL_API_KEYS="key1:tenant-a,sha256:<hex>:tenant-b"`, as digests."""

    def __init__(self, settings: Settings) -> None:
        spec = settings.api_keys.get_secret_value() if settings.api_keys else ""
        entries = [part.strip() for part in spec.split(",")]
        self._owners: list[tuple[bytes, str]] = []
        seen: dict[bytes, int] = {}
        for position, entry in enumerate(entries, start=1):
            if not entry:
                continue
            digest, owner = _parse_entry(entry, position)
            if digest in seen:  # one key for two entries: which tenant it means would be a guess
                raise ValueError(
                    f"RESPOOL_API_KEYS entries {seen[digest]} and {position} are the same key; give each key once"
                )
            seen[digest] = position
            self._owners.append((digest, owner))

    @property
    def is_open(self) -> bool:
        return not self._owners

    def owner_of(self, authorization: str | None) -> str:
        """The owner of the request's bearer key, or `AuthenticationError`."""
        if self.is_open:
            return OPEN_OWNER
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise AuthenticationError("Missing bearer token: send 'Authorization: Bearer <key>'.")
        presented = _digest(token.strip())
        owner = None
        # Every entry is compared, in constant time, with no early exit: how long this takes says
        # nothing about which key matched, or how much of one.
        for digest, candidate in self._owners:
            if hmac.compare_digest(digest, presented):
                owner = candidate
        if owner is None:
            raise AuthenticationError("Incorrect API key provided.")
        return owner


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach an API bound to `host` (a name other than `localhost`
    could resolve to anything, so it counts as reachable from elsewhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def open_api_refusal(settings: Settings) -> str | None:
    """Why the API must not start, or None: with no keys it serves anyone who reaches it, which
    off loopback needs `RESPOOL_ALLOW_NO_AUTH=true`, so that losing the keys on an upgrade (a file
    not read, a variable not passed) never opens a published port by itself."""
    if Keys(settings).is_open and not settings.allow_no_auth and not is_loopback(settings.host):
        return (
            f"respool: refusing to serve {settings.host}:{settings.port} without authentication: "
            "RESPOOL_API_KEYS is not set. Set it (keys can be given as digests: `respool hash-key`), "
            "or set RESPOOL_ALLOW_NO_AUTH=true to let anyone who can reach this address use the API."
        )
    return None


async def owner(request: Request) -> str:
    """FastAPI dependency: the caller's owner. A coroutine, though it never waits: FastAPI runs a
    plain function dependency on a thread of its pool, a hop there and back on every request."""
    keys: Keys = request.app.state.keys
    return keys.owner_of(request.headers.get("authorization"))
