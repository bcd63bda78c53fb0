"""Bearer-key auth: each key names its owner (tenant); without keys the API is open (and says so)."""

from __future__ import annotations

import hmac
import logging

from fastapi import Request

from worker.errors import AuthenticationError
from worker.settings import Settings

log = logging.getLogger("respool.api")

OPEN_OWNER = "default"


class Keys:
    """The configured keys, `RESPOOL_API_KEYS="key1:tenant-a,key2:tenant-b"`."""

    def __init__(self, settings: Settings) -> None:
        spec = settings.api_keys.get_secret_value() if settings.api_keys else ""
        self._owners: list[tuple[bytes, str]] = []
        for entry in filter(None, (part.strip() for part in spec.split(","))):
            key, _, owner = entry.partition(":")
            if not key or not owner:
                raise ValueError("RESPOOL_API_KEYS entries must look like 'key:tenant'")
            self._owners.append((key.encode(), owner))

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
        presented = token.strip().encode()
        owner = None
        for key, candidate in self._owners:  # every key compared in constant time, no early exit
            if hmac.compare_digest(key, presented):
                owner = candidate
        if owner is None:
            raise AuthenticationError("Incorrect API key provided.")
        return owner


def owner(request: Request) -> str:
    """FastAPI dependency: the caller's owner."""
    keys: Keys = request.app.state.keys
    return keys.owner_of(request.headers.get("authorization"))
