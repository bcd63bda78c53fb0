"""Schema-driven fuzzing of the running API against its own `/openapi.json` (issue 7).

schemathesis (its CLI, as a user would run it) reads the document respool serves and sends every
operation requests generated from it, over loopback, to a real API with a real worker and the
scripted upstream: valid and invalid ones (wrong types, out-of-range numbers, malformed ids, strings
with control characters, unknown methods), then sequences that follow the document's links from a
created response to retrieve, cancel, delete and list its items. Its checks: no 5xx; every status,
content type, header (`x-request-id`, `retry-after`, a 405's `allow`) and body is one the document
declares, SSE events included; what the document rules out is refused with a 4xx; no route answers
without the key. Bounded: a fixed number of examples per operation and a fixed seed, so a failure
replays.

Two of its checks are left out, for requests the document cannot tell apart: a schema-valid create
may still be refused for what only the server knows (a `previous_response_id` that does not exist
is a 400, PROTOCOL.md §5.6; an item type respool does not run), and a created response may be gone
by design (`store: false`, PROTOCOL.md §2) — `positive_data_acceptance`, `ensure_resource_availability`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis

from tests.conftest import own_stack
from tests.support.stack import Servers, Stack
from tests.support.upstream_process import ScriptedUpstream

pytestmark = [pytest.mark.integration, pytest.mark.once]

KEY = "sk-fuzzer-key"
EXAMPLES = 25  # per operation, in each phase
SEED = 7


@pytest.fixture(scope="module")
def fuzzed(backing: Servers, session_dir: Path, stack: Stack, upstream: ScriptedUpstream) -> Iterator[Stack]:
    """An API and a worker of their own, with a key; unknown models go to the scripted upstream."""
    running = own_stack(
        backing,
        session_dir,
        "fuzz",
        RESPOOL_API_KEYS=f"{KEY}:fuzzer",
        RESPOOL_UPSTREAM_URL=upstream.url,
        RESPOOL_UPSTREAM_API="chat",
    )
    running.start_api("api-fuzz")
    running.start_worker("worker-fuzz")
    yield running
    running.stop_all()


def test_the_api_holds_to_its_openapi_document(fuzzed: Stack, tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{fuzzed.url}/openapi.json",
        "--checks=all",
        "--exclude-checks=positive_data_acceptance,ensure_resource_availability",
        f"--max-examples={EXAMPLES}",
        f"--seed={SEED}",
        f"--header=Authorization: Bearer {KEY}",
        "--request-timeout=60",
        "--generation-database=none",
        f"--report-dir={tmp_path}",
        "--no-color",
    ]
    # Its working directory is the test's: schemathesis keeps a cache where it runs.
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-20_000:] + run.stderr[-5_000:]
    assert "18 selected / 18 total" in run.stdout  # every operation of the document was fuzzed
    # The 9 links the document declares (responses' and conversations'), besides those it infers.
    covered = re.search(r"API Links:\s+(\d+) covered", run.stdout)
    assert covered is not None and int(covered.group(1)) >= 9, run.stdout[-5_000:]
    assert "Errors:" not in run.stdout, run.stdout[-20_000:]
    api_log = fuzzed.log("api-fuzz")
    assert "unhandled error" not in api_log
    assert "Exception in ASGI application" not in api_log


@pytest.mark.parametrize("background", [False, True])
def test_a_streamed_create_s_events_match_the_document(fuzzed: Stack, background: bool) -> None:
    """Every SSE event of a stream, each `data:` against the ResponseStreamEvent schema the document
    gives (the fuzzing above may or may not draw a stream that succeeds; this one does)."""
    document = schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")
    body = {"model": "fuzz-stream", "input": "hello", "stream": True, "background": background}
    case = document["/v1/responses"]["POST"].Case(body=body, media_type="application/json")
    answer = case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 200
    assert answer.headers["content-type"][0].startswith("text/event-stream")  # headers: lists
    assert "event: response.completed" in answer.text
