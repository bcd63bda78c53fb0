"""`respool up`, as a user runs it: everything on one machine, Ctrl-C stops it all, data persists."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_sdk
from tests.support.stack import free_port, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.once]  # its own embedded servers

# The console script `uv run respool` runs: the README's first command, as a user types it.
RESPOOL = str(Path(sys.executable).with_name("respool"))


def _processes_using(path: Path) -> list[int]:
    """Pids whose command line or working directory mentions `path`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if str(path) in cmdline or cwd.startswith(str(path)):
            found.append(int(entry.name))
    return found


def _api_replicas(path: Path) -> list[int]:
    """The API processes uvicorn's manager spawned for `respool up --api-replicas`."""
    return [
        pid for pid in _processes_using(path) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def _up(data_dir: Path, port: int) -> subprocess.Popen[bytes]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("RESPOOL_")}
    env["RESPOOL_DATA_DIR"] = str(data_dir)
    return subprocess.Popen(
        [RESPOOL, "up", "--port", str(port), "--workers", "2", "--api-replicas", "2"],
        env=env,
        cwd=data_dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _listening(url: str, process: subprocess.Popen[bytes]) -> bool:
    assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
    try:
        return httpx.get(url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _interrupt(process: subprocess.Popen[bytes]) -> str:
    process.send_signal(signal.SIGINT)  # what Ctrl-C sends
    output, _ = process.communicate(timeout=60)
    return output.decode(errors="replace")


def test_up_serves_stops_cleanly_and_keeps_data(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """`respool up` (two API processes, two workers) serves the SDK with no upstream, Ctrl-C leaves no
    process, and a restart keeps the data."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = _up(tmp_path, port)
    wait_for(lambda: _listening(url, process), timeout=90, what="respool up to listen")
    client = make_sdk(url, "unused")
    request.addfinalizer(client.close)
    assert len(_api_replicas(tmp_path)) == 2
    created = client.responses.create(model="synthetic", input="keep me", background=True)
    done = wait_for(lambda: (r := client.responses.retrieve(created.id)).status == "completed" and r)
    output = _interrupt(process)
    assert "client.responses.create" in output  # the copy-paste SDK example
    assert process.returncode == 0, output
    wait_for(lambda: not _processes_using(tmp_path), timeout=10, what="no process left")

    process = _up(tmp_path, port)
    wait_for(lambda: _listening(url, process), timeout=90, what="respool up to listen again")
    assert client.responses.retrieve(created.id).output_text == done.output_text
    _interrupt(process)
    wait_for(lambda: not _processes_using(tmp_path), timeout=10, what="no process left")
