"""The upstream call to an https:// upstream whose certificate a private CA signed, over the real
scripted upstream served with TLS on loopback: without that CA the call fails at once, finally,
naming the variables that would make the worker trust it; with SSL_CERT_FILE it succeeds."""

from __future__ import annotations

import logging
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.tls import TlsFiles, make_tls
from tests.support.upstream_process import ScriptedUpstream
from worker.errors import TransientUpstreamError, UpstreamError
from worker.routing import Route, UpstreamApi
from worker.runner.upstream import CHAT_STREAM, RetryPolicy, create_client, stream_json

pytestmark = pytest.mark.integration

# Retries as a worker makes them, fast: a fault taken for transient would be tried four times.
RETRIES = RetryPolicy(retries=3, backoff_seconds=0.01, backoff_max_seconds=0.01)


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_upstream(tls: TlsFiles) -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream.start(tls) as served:
        yield served


async def _call(upstream: ScriptedUpstream) -> list[dict[str, Any]]:
    model = f"tls-{uuid.uuid4().hex[:8]}"
    upstream.script(model, {"text": "over TLS"})
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    route = Route(model, UpstreamApi.CHAT, upstream.url)
    client = create_client(300.0, 4)  # its TLS context is made here, from the environment
    try:
        return [
            chunk
            async for chunk in stream_json(client, route, "/chat/completions", body, RETRIES, CHAT_STREAM)
        ]
    finally:
        await client.aclose()


def _text(chunks: list[dict[str, Any]]) -> str:
    deltas = [(choice.get("delta") or {}).get("content") for chunk in chunks for choice in chunk["choices"]]
    return "".join(delta for delta in deltas if delta)


async def test_an_unverifiable_certificate_is_final_and_names_the_ca_variables(
    tls_upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A certificate of a CA the worker does not trust fails the call on its first attempt, never
    retried, with a message naming SSL_CERT_FILE and SSL_CERT_DIR."""
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    with caplog.at_level(logging.INFO), pytest.raises(UpstreamError) as raised:
        await _call(tls_upstream)
    assert not isinstance(raised.value, TransientUpstreamError)
    message = raised.value.message
    assert "SSL_CERT_FILE" in message and "SSL_CERT_DIR" in message
    assert "certificate" in message and "gave up after" not in message
    assert not [record for record in caplog.records if "retrying" in record.getMessage()]


async def test_ssl_cert_file_makes_the_worker_trust_the_upstream(
    tls_upstream: ScriptedUpstream, tls: TlsFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With SSL_CERT_FILE naming the CA's bundle the same upstream answers, every word."""
    monkeypatch.setenv("SSL_CERT_FILE", str(tls.ca))
    assert _text(await _call(tls_upstream)) == "over TLS"


@pytest.fixture
def ca_dir(tls: TlsFiles, tmp_path: Path) -> Path:
    """A directory holding the CA under its subject hash (the name `openssl rehash` gives it, by
    which OpenSSL looks a CA up in a directory)."""
    subject_hash = subprocess.run(
        ["openssl", "x509", "-hash", "-noout", "-in", str(tls.ca)], capture_output=True, text=True, check=True
    ).stdout.strip()
    (tmp_path / f"{subject_hash}.0").write_bytes(tls.ca.read_bytes())
    return tmp_path


async def test_ssl_cert_dir_makes_the_worker_trust_the_upstream(
    tls_upstream: ScriptedUpstream, ca_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With SSL_CERT_DIR naming a directory that holds the CA, and no SSL_CERT_FILE, it answers too."""
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.setenv("SSL_CERT_DIR", str(ca_dir))
    assert _text(await _call(tls_upstream)) == "over TLS"
