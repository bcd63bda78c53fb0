"""A webhook receiver for the tests: a real HTTP server on loopback (in a thread of the test
process) that records every delivery and answers as a test tells it.

    with Receiver.start() as receiver:
        receiver.answers = [500, 200]      # the next answers in order; then 200
        receiver.answers = [(503, {"retry-after": "30"})]   # an answer with headers
        receiver.delay = 3.0               # seconds before each answer (max_active: most at once)
        ...
        receiver.wait_for(3)               # until 3 deliveries arrived
        receiver.stop(); receiver.restart()  # down for a while (the port refuses), then up

Verifying the signatures is the tests' part (with the SDK's `webhooks.unwrap` and `standardwebhooks`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Self


@dataclass(frozen=True)
class Delivery:
    headers: dict[str, str]
    body: str
    at: float
    answered: int


class Receiver:
    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []
        self.answers: list[int | tuple[int, dict[str, str]]] = []
        self.delay = 0.0  # seconds before answering each delivery
        self.started = 0  # deliveries whose request arrived (answered or not yet)
        self.active = self.max_active = 0  # requests being answered now; the most at once
        self.changed = threading.Condition()
        self.port = 0
        self._server: ThreadingHTTPServer | None = None

    @classmethod
    def start(cls) -> Receiver:
        receiver = cls()
        receiver.restart()
        return receiver

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    @property
    def host_port(self) -> str:
        return f"127.0.0.1:{self.port}"

    def restart(self) -> None:
        """Listen (again, on the same port once it has one)."""
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0)).decode()
                with receiver.changed:
                    given = receiver.answers.pop(0) if receiver.answers else 200
                    answer, extra = given if isinstance(given, tuple) else (given, {})
                    receiver.started += 1
                    receiver.active += 1
                    receiver.max_active = max(receiver.max_active, receiver.active)
                    receiver.changed.notify_all()
                time.sleep(receiver.delay)
                with receiver.changed:
                    receiver.active -= 1
                self.send_response(answer)
                for name, value in extra.items():
                    self.send_header(name, value)
                self.send_header("content-length", "0")
                self.end_headers()
                headers = {name.lower(): value for name, value in self.headers.items()}
                with receiver.changed:
                    receiver.deliveries.append(Delivery(headers, body, time.time(), answer))
                    receiver.changed.notify_all()

            def log_message(self, *args: object) -> None:
                return

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """Stop listening: connections are refused until `restart`."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def acknowledged(self) -> list[Delivery]:
        with self.changed:
            return [delivery for delivery in self.deliveries if 200 <= delivery.answered < 300]

    def wait_for(self, count: int, timeout: float = 60.0, *, acknowledged: bool = True) -> list[Delivery]:
        """Wait until `count` deliveries (acknowledged ones, or any) have arrived; them all."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                got = [d for d in self.deliveries if not acknowledged or 200 <= d.answered < 300]
                if len(got) >= count:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(got)} of {count} webhook deliveries arrived in {timeout:g} s")
                self.changed.wait(left)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()
