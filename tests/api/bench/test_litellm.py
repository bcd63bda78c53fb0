"""LiteLLM's proxy for the bench: its config, finding it, starting and stopping it, and (when it is
installed) the OpenAI SDK streaming through its `/v1/responses` bridge onto the scripted upstream."""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from api.bench import litellm as bench_litellm
from api.bench.litellm import (
    LiteLLM,
    LiteLLMStartError,
    config_text,
    find_litellm,
    interpreter_of,
    proxy_environment,
)
from tests.support.processes import is_alive
from tests.support.stack import free_port
from tests.support.upstream_process import ScriptedUpstream

UPSTREAM_URL = "http://127.0.0.1:9999/v1"
# Neither Redis nor Postgres is involved: CI runs these once (marker `once`).
pytestmark = pytest.mark.once
ECHO = "Hello from the scripted upstream. You said: hi"
INSTALL_HINT = (
    "LiteLLM is not installed: `uv venv /opt/litellm-venv --python 3.12 && "
    "uv pip install --python /opt/litellm-venv/bin/python 'litellm[proxy]'`, then put "
    "/opt/litellm-venv/bin on PATH or set RESPOOL_BENCH_LITELLM=/opt/litellm-venv/bin/litellm"
)


def _script(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text(body)
    path.chmod(0o755)
    return path


def _route() -> dict[str, object]:
    (entry,) = json.loads(config_text(UPSTREAM_URL))["model_list"]
    assert isinstance(entry, dict)
    return entry


def test_config_sends_every_model_name_to_the_upstream() -> None:
    """One wildcard route passes any model name, unchanged, to the upstream's OpenAI API."""
    entry = _route()
    assert entry["model_name"] == "*"
    assert entry["litellm_params"] == {
        "model": "openai/*",
        "api_base": UPSTREAM_URL,
        "api_key": "unused",
        "use_chat_completions_api": True,
    }


def test_config_lets_the_proxy_start_without_a_master_key() -> None:
    """Without the override LiteLLM refuses to start keyless; with it, no master key is set."""
    settings = json.loads(config_text(UPSTREAM_URL))["general_settings"]
    assert settings == {"dangerously_permit_weak_or_unset_master_key": True}


def test_environment_keeps_our_secrets_and_databases_out() -> None:
    """LiteLLM gets PATH and HOME but no DATABASE_URL, master key or PYTHONPATH of ours."""
    ours = {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "DATABASE_URL": "postgresql://x/y",
        "LITELLM_MASTER_KEY": "sk-secret",
        "PYTHONPATH": "/work/main",
        "HTTPS_PROXY": "http://proxy:3128",
    }
    env = proxy_environment(ours)
    assert env["PATH"] == "/usr/bin" and env["HOME"] == "/root"
    assert not {"DATABASE_URL", "LITELLM_MASTER_KEY", "PYTHONPATH", "HTTPS_PROXY"} & set(env)
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    assert env["LITELLM_LOG"] == "ERROR"
    assert int(env["REPEATED_STREAMING_CHUNK_LIMIT"]) >= 10_000  # the bench's tokens all look alike


def test_find_litellm_takes_it_from_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing given, the `litellm` on PATH is found."""
    executable = _script(tmp_path, "litellm", "#!/bin/sh\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_litellm() == executable
    assert find_litellm("") == executable


def test_find_litellm_prefers_the_executable_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit path wins over PATH."""
    _script(tmp_path, "litellm", "#!/bin/sh\n")
    (tmp_path / "venv").mkdir()
    given = _script(tmp_path / "venv", "litellm", "#!/bin/sh\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_litellm(str(given)) == given


@pytest.mark.parametrize("explicit", [None, "/nowhere/litellm"])
def test_find_litellm_answers_none_when_absent(
    explicit: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No executable on PATH, or a given path that does not exist, finds nothing."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_litellm(explicit) is None


def test_interpreter_comes_from_the_shebang(tmp_path: Path) -> None:
    """The version is read by the Python named in the executable's `#!` line."""
    executable = _script(tmp_path, "litellm", f"#!{sys.executable}\nprint()\n")
    assert interpreter_of(executable) == Path(sys.executable)


def test_interpreter_through_env_is_looked_up_on_path(tmp_path: Path) -> None:
    """`#!/usr/bin/env python3` means the python3 on PATH."""
    executable = _script(tmp_path, "litellm", "#!/usr/bin/env python3\nprint()\n")
    assert interpreter_of(executable) == Path(str(shutil.which("python3")))


def test_a_shell_script_has_no_interpreter(tmp_path: Path) -> None:
    """A non-Python executable outside a venv gives no interpreter, so the version is "unknown"."""
    executable = _script(tmp_path, "litellm", "#!/bin/sh\nexit 0\n")
    assert interpreter_of(executable) is None
    assert bench_litellm.installed_version(executable) == "unknown"


def test_start_reports_an_exit_with_the_log_tail(tmp_path: Path) -> None:
    """A proxy that exits at start fails `start` with its status and the end of its log."""
    executable = _script(tmp_path, "litellm", "#!/bin/sh\necho 'config error: no model_list'\nexit 3\n")
    with pytest.raises(LiteLLMStartError, match="exited with status 3") as failure:
        LiteLLM.start(executable, UPSTREAM_URL, free_port(), tmp_path)
    assert "config error: no model_list" in str(failure.value)
    assert json.loads((tmp_path / "litellm-config.yaml").read_text())["model_list"]


def test_start_gives_up_at_the_deadline_and_kills_what_ignores_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy that never answers fails `start` at the deadline, and is killed even if it ignores SIGTERM."""
    monkeypatch.setattr(bench_litellm, "STOP_SECONDS", 0.2)
    executable = _script(tmp_path, "litellm", "#!/bin/sh\ntrap '' TERM\necho $$ > pid\nexec sleep 60\n")
    with pytest.raises(LiteLLMStartError, match="did not answer"):
        LiteLLM.start(executable, UPSTREAM_URL, free_port(), tmp_path, start_seconds=0.5)
    assert not is_alive(int((tmp_path / "pid").read_text()))


def test_start_needs_a_port_chosen_in_advance(tmp_path: Path) -> None:
    """Port 0 is refused: the bench could not learn which port the proxy took."""
    with pytest.raises(ValueError, match="free port"):
        LiteLLM.start(Path("/bin/true"), UPSTREAM_URL, 0, tmp_path)


@pytest.fixture(scope="module")
def litellm_executable() -> Path:
    executable = find_litellm(os.environ.get("RESPOOL_BENCH_LITELLM"))
    if executable is None:
        pytest.skip(INSTALL_HINT)
    return executable


@pytest.fixture(scope="module")
def proxy(
    litellm_executable: Path, upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiteLLM]:
    workdir = tmp_path_factory.mktemp("litellm")
    with LiteLLM.start(litellm_executable, upstream.url, free_port(), workdir) as running:
        yield running
    assert not is_alive(running.pid)


@pytest.fixture
def client(proxy: LiteLLM) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=proxy.url, api_key="unused", max_retries=0, timeout=60) as sdk:
        yield sdk


@pytest.mark.integration
def test_responses_stream_through_litellm(client: openai.OpenAI) -> None:
    """A streamed response through LiteLLM yields the upstream's words as deltas, then completes."""
    deltas, completed = [], []
    with client.responses.create(model="bench-anything", input="hi", stream=True) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type == "response.completed":
                completed.append(event.response)
    assert len(deltas) > 1 and "".join(deltas) == ECHO
    assert [response.status for response in completed] == ["completed"]
    assert completed[0].output_text == ECHO


@pytest.mark.integration
def test_responses_without_stream_through_litellm(client: openai.OpenAI) -> None:
    """A non-streamed response through LiteLLM is completed with the upstream's answer."""
    response = client.responses.create(model="bench-anything", input="hi")
    assert response.status == "completed"
    assert response.output_text == ECHO


@pytest.mark.integration
def test_chat_completions_through_litellm(client: openai.OpenAI) -> None:
    """Chat Completions pass through LiteLLM too."""
    completion = client.chat.completions.create(
        model="bench-anything", messages=[{"role": "user", "content": "hi"}]
    )
    assert completion.choices[0].message.content == ECHO


@pytest.mark.integration
def test_litellm_bridges_onto_chat_completions_with_the_model_name_unchanged(
    client: openai.OpenAI, upstream: ScriptedUpstream
) -> None:
    """Both kinds of `/v1/responses` reach the upstream as Chat Completions for the same model name."""
    model = f"bench-{uuid.uuid4().hex[:8]}x20"
    client.responses.create(model=model, input="hi")
    with client.responses.create(model=model, input="hi", stream=True) as stream:
        for _event in stream:
            pass
    received = upstream.requests(model)
    assert [(request["path"], request.get("stream")) for request in received] == [
        ("/v1/chat/completions", None),
        ("/v1/chat/completions", True),
    ]


@pytest.mark.integration
def test_litellm_reports_its_version(proxy: LiteLLM) -> None:
    """The version of the install that runs is known, for the bench's report."""
    assert proxy.version[0].isdigit() and proxy.version.count(".") >= 1
