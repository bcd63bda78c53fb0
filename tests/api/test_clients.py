"""What real clients found (issue 14), through the real API: OpenAI's routes respool does not serve
are unknown routes, a WebSocket upgrade is refused in a way clients fall back from, and a function
call with no output is refused as OpenAI refuses it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.conftest import KEY_A
from tests.support.stack import Stack
from tests.support.upstream_process import ScriptedUpstream

pytestmark = [pytest.mark.integration, pytest.mark.once]  # nothing here depends on which servers serve it


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/responses/compact"),
        ("DELETE", "/v1/responses/compact"),
        ("GET", "/v1/responses/input_tokens"),
        ("DELETE", "/v1/responses/input_tokens"),
    ],
)
def test_other_methods_of_compact_and_input_tokens_are_refused_as_such(
    queue_only: Stack, method: str, path: str
) -> None:
    """`compact` and `input_tokens` are served by POST only: another method is an OpenAI-shaped 405,
    never a 400 on `response_id`."""
    answer = httpx.request(method, queue_only.url + path, json={"model": "m", "input": "x"})
    assert answer.status_code == 405, answer.text
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert answer.json()["error"]["param"] != "response_id"


def test_a_response_id_route_still_refuses_a_malformed_id(queue_only: Stack) -> None:
    """Other segments are still read as response ids: a malformed one is a 400 naming `response_id`."""
    answer = httpx.get(queue_only.url + "/v1/responses/compactor")
    assert (answer.status_code, answer.json()["error"]["param"]) == (400, "response_id")


def test_a_websocket_upgrade_is_refused_with_426_and_says_why(queue_only: Stack) -> None:
    """426 Upgrade Required, which Codex CLI falls back to HTTP from at once, with an OpenAI-shaped error."""
    url = queue_only.url.replace("http://", "ws://") + "/v1/responses"
    with pytest.raises(InvalidStatus) as refused:
        connect(url, open_timeout=10)
    answer = refused.value.response
    assert answer.status_code == 426
    error = json.loads(answer.body)["error"]
    assert error["code"] == "websocket_not_supported"
    assert "POST /v1/responses" in error["message"]


def test_the_sdks_websocket_connect_sees_the_426(open_client: openai.OpenAI) -> None:
    """`client.responses.connect()` (the SDK's WebSocket transport) raises with the 426 and its body."""
    with pytest.raises(InvalidStatus) as refused, open_client.responses.connect():
        pass
    assert refused.value.response.status_code == 426


def _call_script(upstream: ScriptedUpstream, model: str) -> None:
    """The model answers with one call of `lookup`."""
    call = {"index": 0, "id": "call_abc", "function": {"name": "lookup", "arguments": "{}"}}
    upstream.script(
        model, {"chunks": [{"delta": {"tool_calls": [call]}}, {"delta": {}, "finish_reason": "tool_calls"}]}
    )


TOOLS = [{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}]


def test_a_chain_whose_call_has_no_output_is_400_naming_the_call(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """A previous response that ended with a call, continued by a user message alone: OpenAI's 400; nothing
    is sent upstream. Continued with the call's output, it runs."""
    _call_script(upstream, model)
    first = client.responses.create(model=model, input="look it up", tools=TOOLS)  # type: ignore[arg-type]
    assert first.output[0].type == "function_call"
    upstream.reset()
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model, previous_response_id=first.id, input="and?", tools=TOOLS)  # type: ignore[arg-type]
    error = refused.value.body
    assert error == {
        "message": "No tool output found for function call call_abc.",
        "type": "invalid_request_error",
        "param": "input",
        "code": None,
    }
    assert upstream.requests(model) == []
    output = {"type": "function_call_output", "call_id": "call_abc", "output": "42"}
    upstream.script(model, {"text": "It is 42."})
    answered = client.responses.create(
        model=model, previous_response_id=first.id, input=[output], tools=TOOLS
    )  # type: ignore[arg-type]
    assert answered.output_text == "It is 42."


def test_a_call_without_output_in_the_input_is_400(client: openai.OpenAI, model: str) -> None:
    """A call followed by a user message in one input is refused the same way."""
    call = {"type": "function_call", "call_id": "call_x", "name": "lookup", "arguments": "{}"}
    with pytest.raises(openai.BadRequestError, match="No tool output found for function call call_x"):
        client.responses.create(
            model=model, input=[{"role": "user", "content": "q"}, call, {"role": "user", "content": "?"}]
        )  # type: ignore[list-item]


def _codex() -> str:
    """The Codex CLI executable (CI installs it from npm; `RESPOOL_TEST_CODEX` names it)."""
    codex = os.environ.get("RESPOOL_TEST_CODEX") or shutil.which("codex")
    if not codex:
        pytest.skip(
            "needs Codex CLI: npm install --prefix .ci/codex @openai/codex and set RESPOOL_TEST_CODEX"
        )
    return codex


def test_codex_cli_works_against_a_default_respool(stack: Stack, tmp_path: Path) -> None:
    """The real Codex CLI, unchanged and on its defaults: its built-in provider tries a WebSocket
    first, meets the 426 once and goes on over HTTP; its first request (function tools, a `namespace`
    group, `web_search`, which this deployment has no backend for) is answered, and Codex prints it."""
    log_before = stack.log("api")
    answer = subprocess.run(
        [
            _codex(),
            "exec",
            "--skip-git-repo-check",
            "-c",
            f'openai_base_url="{stack.url}/v1"',
            "-m",
            "synthetic",
            "say hi",
        ],
        env={**os.environ, "CODEX_HOME": str(tmp_path), "OPENAI_API_KEY": KEY_A, "CODEX_API_KEY": KEY_A},
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    seen = stack.log("api").removeprefix(log_before)
    assert seen.count('"WebSocket /v1/responses" 426') == 1, seen
    assert '"POST /v1/responses HTTP/1.1" 200' in seen.partition('"WebSocket /v1/responses" 426')[2], seen
    assert "ASGI callable returned without completing handshake" not in seen
    assert answer.returncode == 0, answer.stdout + answer.stderr
    # The synthetic model quotes the last user message back: Codex printed respool's answer.
    assert "This is respool's synthetic model. You said:" in answer.stdout, answer.stdout + answer.stderr
