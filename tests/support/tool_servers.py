"""The test servers of the tool loop as real processes of their own: the MCP server
(`tests.support.mcp_server`) and the search backend (`tests.support.search_server`)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any, Self, cast

import httpx

from tests.support.upstream_process import REPO_ROOT, START_DEADLINE_SECONDS, read_listening_url, stop_child


class ServerProcess:
    """A test server module run as a child process; `url` is what its `LISTENING` line says."""

    module = ""

    def __init__(self, process: subprocess.Popen[str], url: str) -> None:
        self.process = process
        self.url = url
        self.client = httpx.Client(base_url=self.url.removesuffix("/mcp"), timeout=10)

    @classmethod
    def start(cls, *args: str) -> Self:
        command = [sys.executable, "-m", cls.module, "--port", "0", *args]
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
        return cls(process, read_listening_url(process, START_DEADLINE_SECONDS))

    @property
    def host_port(self) -> str:
        """`127.0.0.1:<port>`, as an allowlist entry names it."""
        return self.url.split("/")[2]

    def reset(self) -> None:
        """Forget what it received so far."""
        self.client.post("/_reset").raise_for_status()

    def stop(self) -> None:
        self.client.close()
        stop_child(self.process)


class McpServerProcess(ServerProcess):
    """`url` is the MCP endpoint, …/mcp. Started with `"--token", T` it demands that bearer token."""

    module = "tests.support.mcp_server"

    def calls(self) -> dict[str, list[dict[str, Any]]]:
        return cast(dict[str, list[dict[str, Any]]], self.client.get("/_calls").json())

    def authorizations(self) -> list[str]:
        return cast(list[str], self.client.get("/_authorizations").json())


class SearchServerProcess(ServerProcess):
    """SearXNG's and Tavily's APIs (`--key K` sets the Tavily key it demands)."""

    module = "tests.support.search_server"

    def queries(self) -> list[str]:
        return cast(list[str], self.client.get("/_queries").json())
