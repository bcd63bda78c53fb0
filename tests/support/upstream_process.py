"""Starting and driving the scripted upstream as a real process, from tests.

Owns `ScriptedUpstream`: it spawns `python -m tests.support.scripted_upstream --port 0` as a
subprocess, reads its `LISTENING <url>` line, and wraps the control routes (`/_script`,
`/_requests`, `/_stats`, `/_reset`) in methods; `UpstreamStartError` when it never listens.
"""

from __future__ import annotations

import select
import ssl
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Self, cast

import httpx

from tests.support.tls import TlsFiles
from tests.support.upstream_frames import Json

REPO_ROOT = Path(__file__).resolve().parents[2]
START_DEADLINE_SECONDS = 20.0


class UpstreamStartError(RuntimeError):
    """The scripted upstream process did not report that it listens."""


def read_listening_url(process: subprocess.Popen[str], timeout: float) -> str:
    """The base URL from the child's `LISTENING <url>` line, or UpstreamStartError."""
    assert process.stdout is not None
    is_ready = bool(select.select([process.stdout], [], [], timeout)[0])
    line = process.stdout.readline() if is_ready else ""
    if not line.startswith("LISTENING "):
        process.kill()
        process.wait()
        raise UpstreamStartError(f"no LISTENING line within {timeout}s (exit {process.returncode}): {line!r}")
    return line.split()[1]


def stop_child(process: subprocess.Popen[str]) -> None:
    """Stop a server process of the tests: TERM, then KILL if it lingers; its pipe closed."""
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stdout is not None:
        process.stdout.close()


class ScriptedUpstream:
    """Starts the server as a subprocess; .url is "http://127.0.0.1:<port>/v1"."""

    def __init__(self, process: subprocess.Popen[str], base_url: str, ca: Path | None = None) -> None:
        self.process = process
        self.base_url = base_url
        self.url = f"{base_url}/v1"
        # A connection a call each: a kept-alive one can be closed by the server's idle timeout just
        # as the next call goes out on it ("Server disconnected without sending a response").
        self.client = httpx.Client(
            base_url=base_url,
            timeout=10.0,
            limits=httpx.Limits(max_keepalive_connections=0),
            verify=ssl.create_default_context(cafile=ca) if ca else True,
        )

    @classmethod
    def start(cls, tls: TlsFiles | None = None) -> ScriptedUpstream:
        """The upstream as a process of its own; over TLS with `tls`'s certificate when given."""
        command = [sys.executable, "-m", "tests.support.scripted_upstream", "--port", "0"]
        if tls is not None:
            command += ["--certfile", str(tls.certificate), "--keyfile", str(tls.key)]
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
        return cls(process, read_listening_url(process, START_DEADLINE_SECONDS), tls.ca if tls else None)

    def stop(self) -> None:
        self.client.close()
        stop_child(self.process)

    def script(self, model: str, script: Json) -> None:
        self.client.post("/_script", json={"model": model, "script": script}).raise_for_status()

    def requests(self, model: str | None = None) -> list[Json]:
        params = {} if model is None else {"model": model}
        response = self.client.get("/_requests", params=params)
        response.raise_for_status()
        return cast(list[Json], response.json())

    def stats(self, until_active: int | None = None, timeout: float = 5.0) -> Json:
        """Stream counters; with `until_active`, read once that many streams are open (or at timeout)."""
        params = {} if until_active is None else {"until_active": until_active, "timeout": timeout}
        response = self.client.get("/_stats", params=params, timeout=timeout + 5)
        response.raise_for_status()
        return cast(Json, response.json())

    def reset(self) -> None:
        self.client.post("/_reset").raise_for_status()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()
