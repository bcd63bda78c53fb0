"""The test MCP server (`tests.support.mcp_server`) as a real process of its own."""

from __future__ import annotations

import subprocess
import sys
from typing import Any, cast

import httpx

from tests.support.upstream_process import REPO_ROOT, START_DEADLINE_SECONDS, read_listening_url, stop_child


class McpServerProcess:
    def __init__(self, process: subprocess.Popen[str], url: str) -> None:
        self.process = process
        self.url = url  # the MCP endpoint, …/mcp
        self.client = httpx.Client(base_url=url.removesuffix("/mcp"), timeout=10)

    @classmethod
    def start(cls, token: str | None = None) -> McpServerProcess:
        command = [sys.executable, "-m", "tests.support.mcp_server", "--port", "0"]
        if token:
            command += ["--token", token]
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
        return cls(process, read_listening_url(process, START_DEADLINE_SECONDS))

    @property
    def host_port(self) -> str:
        """`127.0.0.1:<port>`, as an allowlist entry names it."""
        return self.url.split("/")[2]

    def calls(self) -> dict[str, list[dict[str, Any]]]:
        return cast(dict[str, list[dict[str, Any]]], self.client.get("/_calls").json())

    def authorizations(self) -> list[str]:
        return cast(list[str], self.client.get("/_authorizations").json())

    def reset(self) -> None:
        """Forget the calls received so far."""
        self.client.post("/_reset").raise_for_status()

    def stop(self) -> None:
        self.client.close()
        stop_child(self.process)
