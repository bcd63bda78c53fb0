"""An https:// upstream whose certificate a private CA signed, through real processes and the SDK:
a worker that does not trust the CA fails the response at once, saying which variables would make
it trust one; a worker given the CA by SSL_CERT_FILE completes it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai.types.responses import Response

from tests.conftest import KEY_A, make_sdk, own_stack
from tests.support.stack import Servers, Stack, wait_for
from tests.support.tls import TlsFiles, make_tls
from tests.support.upstream_process import ScriptedUpstream

pytestmark = [pytest.mark.integration, pytest.mark.faults]

TERMINAL = {"completed", "failed", "incomplete", "cancelled"}


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_stack(backing: Servers, session_dir: Path, stack: Stack, tls: TlsFiles) -> Iterator[Stack]:
    """An API on an https:// upstream, retrying fast enough that four attempts would be over at
    once, and slow enough (1 s apart) that a retry shows in the time it takes; no worker yet."""
    with ScriptedUpstream.start(tls) as upstream:
        upstream.script("tls-model", {"text": "trusted at last"})
        running = own_stack(
            backing,
            session_dir,
            "upstream-tls",
            RESPOOL_API_KEYS=f"{KEY_A}:tenant-a",
            RESPOOL_UPSTREAM_URL=upstream.url,
            RESPOOL_UPSTREAM_BACKOFF_SECONDS="1",
        )
        for name in ("SSL_CERT_FILE", "SSL_CERT_DIR"):
            running.env.pop(name, None)
        try:
            running.start_api("api-upstream-tls")
            yield running
        finally:
            running.stop_all()


def _finished(running: Stack) -> Response:
    with make_sdk(running.url, KEY_A) as client:
        created = client.responses.create(model="tls-model", input="hi", background=True)
        return wait_for(
            lambda: (found := client.responses.retrieve(created.id)).status in TERMINAL and found,
            timeout=30,
            what="the response to end",
        )


def test_an_untrusted_certificate_fails_the_response_at_once_naming_the_ca_variables(
    tls_stack: Stack, tls: TlsFiles
) -> None:
    """Without the CA the response fails on its first attempt, its error naming SSL_CERT_FILE and
    SSL_CERT_DIR; with SSL_CERT_FILE naming the CA, the next response completes."""
    tls_stack.start_worker("worker-untrusting")
    failed = _finished(tls_stack)
    assert failed.status == "failed" and failed.error is not None
    assert "SSL_CERT_FILE" in failed.error.message and "SSL_CERT_DIR" in failed.error.message
    assert "gave up after" not in failed.error.message
    assert "retrying" not in tls_stack.log("worker-untrusting")
    tls_stack.stop("worker-untrusting")

    tls_stack.start_worker("worker-trusting", env={"SSL_CERT_FILE": str(tls.ca)})
    completed = _finished(tls_stack)
    assert completed.status == "completed", completed.error
    assert completed.output_text == "trusted at last"
