"""The bench's webhook receiver (issue 19): in the background scenario "webhooks", respool tells each
client that its response ended instead of the client polling for it.

A receiver as a user would run one: uvicorn on loopback (here in the load generator's own event
loop, for the length of the scenario), every delivery verified with `standardwebhooks` before it is
believed and acknowledged with a 200. respool sends this owner's events only (`respool.toml`'s
`owners`), so the other scenarios send none.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from standardwebhooks import Webhook, WebhookVerificationError

KEY, OWNER = "bench-webhooks", "bench-webhooks"  # the scenario's API key, and the owner it stands for
SECRET_ENV = "RESPOOL_BENCH_WEBHOOK_SECRET"
PATH = "/hooks"

_EMPTY_200 = {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]}
_EMPTY_400 = {"type": "http.response.start", "status": 400, "headers": [(b"content-length", b"0")]}
_NO_BODY = {"type": "http.response.body", "body": b""}


@dataclass
class Receiver:
    """What respool is configured to call, and the clients' waits on it."""

    port: int
    secret: str = field(default_factory=lambda: "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode())
    told: int = 0  # deliveries verified and acknowledged
    refused: int = 0  # deliveries whose signature did not verify (answered 400)
    _ended: dict[str, str] = field(default_factory=dict)  # told before its client waited
    _waiting: dict[str, asyncio.Future[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._verifier = Webhook(self.secret)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{PATH}"

    def configure(self, env: dict[str, str], directory: Path) -> None:
        """respool's side: the API key of the scenario's owner, and an endpoint for that owner alone."""
        config = directory / "respool-bench.toml"
        config.write_text(
            f'[webhooks.bench]\nurl = "{self.url}"\nsecret_env = "{SECRET_ENV}"\nowners = ["{OWNER}"]\n'
        )
        env.update(
            {
                "RESPOOL_API_KEYS": f"bench:bench,{KEY}:{OWNER}",
                "RESPOOL_CONFIG": str(config),
                SECRET_ENV: self.secret,
                "RESPOOL_OUTBOUND_ALLOWLIST": f"127.0.0.1:{self.port}",  # loopback, opened (DESIGN.md §13)
            }
        )

    async def wait(self, response_id: str) -> str:
        """The type of the event that tells the response's end (`response.completed`, ...)."""
        told = self._ended.pop(response_id, None)
        if told is not None:
            return told
        waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiting[response_id] = waiter
        try:
            return await waiter
        finally:
            self._waiting.pop(response_id, None)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The ASGI app: verify, acknowledge, wake the client waiting for that response."""
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        try:
            event = self._verifier.verify(body, headers)
        except WebhookVerificationError:
            self.refused += 1
            await send(_EMPTY_400)
            await send(_NO_BODY)
            return
        self.told += 1
        await send(_EMPTY_200)
        await send(_NO_BODY)
        response_id, kind = event["data"]["id"], event["type"]
        waiter = self._waiting.pop(response_id, None)
        if waiter is None:
            self._ended[response_id] = kind  # a retry's duplicate lands here too, unread
        elif not waiter.done():
            waiter.set_result(kind)

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """Listen for the length of the block."""
        config = uvicorn.Config(
            self, host="127.0.0.1", port=self.port, lifespan="off", access_log=False, log_level="warning"
        )
        server = uvicorn.Server(config)
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            if task.done():
                task.result()  # it could not listen: say why
                raise RuntimeError("the webhook receiver stopped before it listened")
            await asyncio.sleep(0.01)
        try:
            yield
        finally:
            server.should_exit = True
            await task
