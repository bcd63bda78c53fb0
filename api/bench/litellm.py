"""LiteLLM's proxy in front of the bench upstream: found, configured, started and stopped.

The bench compares respool with LiteLLM's `/v1/responses`, bridged onto the same Chat Completions
upstream. LiteLLM runs only as a subprocess from an install of its own (its pins clash with ours);
respool never imports it. Install it once, for example:

    uv venv /opt/litellm-venv --python 3.12
    uv pip install --python /opt/litellm-venv/bin/python 'litellm[proxy]'

and put `/opt/litellm-venv/bin/litellm` on PATH or name it explicitly (`find_litellm`).

What LiteLLM 1.106.2 does, found by reading its source and running it here:

- Without a master key it refuses to start (`UnsafeMasterKeyError`).
  `general_settings.dangerously_permit_weak_or_unset_master_key` lets it run with no auth, as
  respool runs without `RESPOOL_API_KEYS`; any API key a client sends is then accepted.
- With an `openai/*` model, `/v1/responses` goes to the upstream's own `/v1/responses`, and for a
  model missing from its cost map `stream: true` is faked: one non-streaming upstream call, its text
  cut into 5-character deltas. `use_chat_completions_api: true` forces the Responses -> Chat
  Completions bridge instead, which streams the upstream's chunks as they come.
- The bridge's stream is not what the openai SDK's types declare: no `sequence_number` (except
  `response.output_item.done`, always 1), no `logprobs` on text events, an extra top-level `model`,
  no `usage.input_tokens_details`; it ends with `data: [DONE]`. The SDK parses leniently, so a
  client still gets its deltas and the completed response.
- `background: true` is ignored: the answer comes back completed, synchronously. Nothing is stored
  without a database: `GET /v1/responses/{id}` is forwarded to the upstream.
- Unless `LITELLM_LOCAL_MODEL_COST_MAP=True`, every start (even `--help` and `--version`) fetches
  its model cost map from GitHub, retrying with backoff when offline. Telemetry is gone from this
  version (`LITELLM_TELEMETRY` does nothing).
- Importing the proxy takes 8-17 s on 2 cores, so start-up does, and so does `litellm --version`:
  the version is read with `importlib.metadata` in the interpreter that runs the executable. Its
  first request takes 1-3 s more (lazy imports): warm it up before measuring.
- A failed upstream call is retried twice by default (respool: 3 times, before any output).
- `LITELLM_LOG=ERROR` also silences uvicorn's access log (a line a request otherwise). On
  SIGTERM it exits in about 2 s when idle, but waits for open streams: hence SIGKILL after a while.
- On port 4000, when busy, it silently moves to a random port; give it a free one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx2

from api.up.processes import die_with_parent

START_SECONDS = 90.0
STOP_SECONDS = 5.0
READY_PATH = "/health/liveliness"
LOG_NAME = "litellm.log"
CONFIG_NAME = "litellm-config.yaml"
_POLL_SECONDS = 0.25
_LOG_TAIL_LINES = 30
# Passed on from our environment; everything else is left out, so that a DATABASE_URL (prisma
# migrations), LITELLM_MASTER_KEY (auth on), proxy variables or our venv's PYTHONPATH can't leak in.
_INHERITED = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ")
_SETTINGS = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch from GitHub at start
    "LITELLM_LOG": "ERROR",  # and no access log
    "LITELLM_DONT_SHOW_FEEDBACK_BOX": "true",
    "DISABLE_ADMIN_UI": "True",
    "NO_DOCS": "True",
    "NO_REDOC": "True",
    # Its guard against a model that repeats one chunk (100 times by default) fails every bench
    # stream past 100 tokens: the bench upstream's tokens are all the same text, by design.
    "REPEATED_STREAMING_CHUNK_LIMIT": "1000000",
}
_VERSION_SCRIPT = "import importlib.metadata as m; print(m.version('litellm'))"


class LiteLLMStartError(RuntimeError):
    """LiteLLM's proxy exited or did not answer in time; the message ends with its log's tail."""

    def __init__(self, what: str, log_path: Path) -> None:
        self.log_path = log_path
        super().__init__(f"LiteLLM {what}; last lines of {log_path}:\n{log_tail(log_path)}")


def find_litellm(explicit: str | None = None) -> Path | None:
    """The LiteLLM executable: `explicit` (a path or a name on PATH) when given, else `litellm` on
    PATH; None when that is not an executable."""
    found = shutil.which(explicit or "litellm")
    return Path(found) if found else None


def config_text(upstream_base_url: str) -> str:
    """The proxy's config (JSON, which its YAML loader reads): every model name goes, unchanged,
    to the Chat Completions server at `upstream_base_url` (ending in `/v1`)."""
    config = {
        "model_list": [
            {
                "model_name": "*",
                "litellm_params": {
                    "model": "openai/*",
                    "api_base": upstream_base_url,
                    "api_key": "unused",
                    # Bridge /v1/responses onto Chat Completions rather than pass it through.
                    "use_chat_completions_api": True,
                },
            }
        ],
        "general_settings": {"dangerously_permit_weak_or_unset_master_key": True},
    }
    return json.dumps(config, indent=2) + "\n"


def proxy_environment(ours: Mapping[str, str]) -> dict[str, str]:
    """The environment LiteLLM runs in: a few of `ours` (PATH, HOME, locale) and its settings."""
    kept = {name: ours[name] for name in _INHERITED if name in ours}
    return kept | _SETTINGS


def interpreter_of(executable: Path) -> Path | None:
    """The Python that runs `executable`, from its `#!` line or else the venv it sits in."""
    try:
        with executable.open("rb") as script:
            first_line = script.readline(512).decode(errors="replace")
    except OSError:
        return None
    words = shlex.split(first_line[2:]) if first_line.startswith("#!") else []
    if words and Path(words[0]).name == "env" and len(words) > 1:
        words = [shutil.which(words[1]) or words[1]]
    candidates = [Path(words[0])] if words else []
    candidates.append(executable.resolve().parent / "python")
    for candidate in candidates:
        if candidate.name.startswith("python") and os.access(candidate, os.X_OK):
            return candidate
    return None


def installed_version(executable: Path) -> str:
    """LiteLLM's version as its own interpreter reports it, or "unknown"."""
    python = interpreter_of(executable)
    if python is None:
        return "unknown"
    env = proxy_environment(os.environ)
    try:
        done = subprocess.run(
            [str(python), "-c", _VERSION_SCRIPT], env=env, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def log_tail(log_path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    """The last `lines` lines of the proxy's log, for an error message."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class LiteLLM:
    """A running LiteLLM proxy; `.url` is its base URL ending in `/v1`. Stops on leaving `with`."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, version: str, log_path: Path) -> None:
        self.process = process
        self.url = f"http://127.0.0.1:{port}/v1"
        self.version = version
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    def start(
        cls,
        executable: Path,
        upstream_base_url: str,
        port: int,
        workdir: Path,
        *,
        start_seconds: float = START_SECONDS,
    ) -> LiteLLM:
        """Spawn the proxy on 127.0.0.1:`port` (a free one) in front of `upstream_base_url`, logging
        to `workdir`/litellm.log, and return once it answers; LiteLLMStartError otherwise."""
        if port <= 0:
            raise ValueError(f"LiteLLM needs a free port chosen in advance, not {port}")
        version = installed_version(executable)
        config_path = workdir / CONFIG_NAME
        config_path.write_text(config_text(upstream_base_url))
        log_path = workdir / LOG_NAME
        argv = [str(executable), "--config", str(config_path), "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--num_workers", "1"]
        with log_path.open("ab") as log:
            try:
                process = subprocess.Popen(
                    argv,
                    cwd=workdir,
                    env=proxy_environment(os.environ),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # stop() signals its whole group
                    preexec_fn=die_with_parent(signal.SIGTERM),
                )
            except OSError as error:
                raise LiteLLMStartError(f"could not be run ({error})", log_path) from error
        proxy = cls(process, port, version, log_path)
        try:
            proxy._wait_until_ready(start_seconds)
        except BaseException:
            proxy.stop()
            raise
        return proxy

    def _wait_until_ready(self, seconds: float) -> None:
        ready_url = self.url.removesuffix("/v1") + READY_PATH
        deadline = time.monotonic() + seconds
        with httpx2.Client(timeout=2.0, trust_env=False) as client:
            while not _answers(client, ready_url):
                if self.process.poll() is not None:
                    raise LiteLLMStartError(f"exited with status {self.process.returncode}", self.log_path)
                if time.monotonic() > deadline:
                    raise LiteLLMStartError(
                        f"did not answer {ready_url} within {seconds:.0f} s", self.log_path
                    )
                time.sleep(_POLL_SECONDS)

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after STOP_SECONDS; always reaps. Idempotent."""
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                _signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _answers(client: httpx2.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx2.HTTPError:
        return False


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group is gone already
        os.killpg(pgid, signum)
