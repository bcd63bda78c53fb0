"""Keys: plaintext and SHA-256-hashed entries of `RESPOOL_API_KEYS`, held only as digests and
compared in constant time with every entry; `respool hash-key`; an API started with hashed keys."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from pydantic import SecretStr

from api.auth import Keys, key_digest
from tests.conftest import make_sdk, own_stack
from tests.support.stack import ROOT, Servers, Stack
from worker.errors import AuthenticationError

PLAIN, HASHED = "sk-plain-key", "sk-hashed-key"
HASHED_DIGEST = hashlib.sha256(HASHED.encode()).hexdigest()


def _keys(spec: str | None) -> Keys:
    from worker.settings import Settings

    return Keys(Settings(api_keys=None if spec is None else SecretStr(spec)))


@pytest.mark.parametrize(
    ("spec", "key", "owner"),
    [
        (f"{PLAIN}:tenant-a", PLAIN, "tenant-a"),
        (f"sha256:{HASHED_DIGEST}:tenant-b", HASHED, "tenant-b"),
        (f"sha256:{HASHED_DIGEST.upper()}:tenant-b", HASHED, "tenant-b"),
        (f"{PLAIN}:tenant-a, sha256:{HASHED_DIGEST}:tenant-b", PLAIN, "tenant-a"),
        (f"{PLAIN}:tenant-a, sha256:{HASHED_DIGEST}:tenant-b", HASHED, "tenant-b"),
        (f"sha256:{HASHED_DIGEST}:team:b,{PLAIN}:tenant-a", HASHED, "team:b"),
    ],
)
def test_a_key_given_plain_or_hashed_names_its_owner(spec: str, key: str, owner: str) -> None:
    """A bearer key matches its entry whether the entry gives the key or its digest, in any mix."""
    assert _keys(spec).owner_of(f"Bearer {key}") == owner


@pytest.mark.parametrize(
    "authorization",
    [None, "", "Bearer", "Bearer ", "Basic " + PLAIN, f"Bearer {PLAIN}x", f"Bearer {HASHED_DIGEST}"],
)
def test_a_wrong_or_missing_key_is_refused(authorization: str | None) -> None:
    """No key, another scheme, a near miss, or the digest itself sent as the key: AuthenticationError."""
    keys = _keys(f"{PLAIN}:tenant-a,sha256:{HASHED_DIGEST}:tenant-b")
    with pytest.raises(AuthenticationError):
        keys.owner_of(authorization)


def test_only_digests_are_kept() -> None:
    """Nothing a Keys object holds contains a plaintext key."""
    keys = _keys(f"{PLAIN}:tenant-a,sha256:{HASHED_DIGEST}:tenant-b")
    held = repr(vars(keys)).encode() + b"".join(digest for digest, _ in keys._owners)
    assert PLAIN.encode() not in held
    assert [digest for digest, _ in keys._owners] == [
        hashlib.sha256(PLAIN.encode()).digest(),
        bytes.fromhex(HASHED_DIGEST),
    ]


@pytest.mark.parametrize("key", [PLAIN, "sk-wrong"])
def test_every_entry_is_compared_whichever_matches(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    """A key matching the first entry is compared with all of them, as is a wrong one: no early exit."""
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    keys = _keys(f"{PLAIN}:tenant-a," + ",".join(f"sk-other-{n}:tenant-{n}" for n in range(5)))
    try:
        keys.owner_of(f"Bearer {key}")
    except AuthenticationError:
        assert key != PLAIN
    assert len(compared) == 6
    assert {len(a) for a, _ in compared} == {len(b) for _, b in compared} == {32}  # digests, not keys


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (
            f"sha256:{HASHED_DIGEST[:-1]}:tenant",
            "entry 1: a hashed key is 'sha256:<64 hex digits>:tenant', but its digest has 63 characters",
        ),
        (
            f"{PLAIN}:a,sha256:{HASHED_DIGEST}00:tenant",
            "entry 2: a hashed key is 'sha256:<64 hex digits>:tenant', but its digest has 66 characters",
        ),
        (f"sha256:{'g' * 64}:tenant", "its digest has non-hex characters"),
        (f"sha256:{HASHED_DIGEST[:32]} {HASHED_DIGEST[33:]}:tenant", "its digest has non-hex characters"),
        (f"sha256:{HASHED_DIGEST}", "entry 1: a hashed key needs its tenant"),
        (f"sha256:{HASHED_DIGEST}:", "entry 1: a hashed key needs its tenant"),
        (f"{PLAIN}", "entry 1: entries must look like 'key:tenant'"),
        (":tenant-a", "entry 1: entries must look like 'key:tenant'"),
        (f"{PLAIN}:a,sha256:{HASHED_DIGEST}:b,{HASHED}:c", "entries 2 and 3 are the same key"),
    ],
)
def test_a_malformed_entry_stops_the_start_without_echoing_it(spec: str, says: str) -> None:
    """A bad digest, a missing tenant or a repeated key is a ValueError naming the entry, not the key."""
    with pytest.raises(ValueError, match="RESPOOL_API_KEYS") as caught:
        _keys(spec)
    message = str(caught.value)
    assert says in message
    for secret in (PLAIN, HASHED, HASHED_DIGEST[:16]):
        assert secret not in message


@pytest.mark.parametrize("spec", [None, "", " , "])
def test_no_entries_means_open(spec: str | None) -> None:
    """Without entries, anyone is the default owner."""
    keys = _keys(spec)
    assert keys.is_open
    assert keys.owner_of(None) == "default"


def _hash_key_command(stdin: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "api", "hash-key"]
    return subprocess.run(command, input=stdin, capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_hash_key_prints_the_entry_form_of_a_key() -> None:
    """`respool hash-key` prints `sha256:<hex>` of the key on stdin (its line ending aside)."""
    done = _hash_key_command(HASHED + "\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"sha256:{HASHED_DIGEST}" == key_digest(HASHED)
    assert _hash_key_command("").returncode == 2


@pytest.fixture(scope="module")
def hashed_api(backing: Servers, session_dir: Path, stack: Stack) -> Iterator[tuple[Stack, str, str]]:
    """An API (no worker) whose RESPOOL_API_KEYS gives one key hashed (by `respool hash-key`) and one plain."""
    hashed, plain = f"sk-h-{secrets.token_hex(8)}", f"sk-p-{secrets.token_hex(8)}"
    entry = _hash_key_command(hashed).stdout.strip()
    running = own_stack(backing, session_dir, "auth", RESPOOL_API_KEYS=f"{entry}:tenant-h,{plain}:tenant-p")
    running.start_api("api-auth")
    yield running, hashed, plain
    running.stop_all()


@pytest.mark.integration
def test_an_api_with_a_hashed_key_authenticates_the_sdk(hashed_api: tuple[Stack, str, str]) -> None:
    """The SDK with a key configured only as its digest is served, as its own tenant; others are not."""
    running, hashed, plain = hashed_api
    with make_sdk(running.url, hashed) as mine, make_sdk(running.url, plain) as other:
        created = mine.responses.create(model="synthetic", input="x", background=True)
        assert mine.responses.retrieve(created.id).status == "queued"
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(created.id)
    for wrong in (key_digest(hashed), key_digest(hashed).removeprefix("sha256:"), hashed + "x"):
        with make_sdk(running.url, wrong) as sdk, pytest.raises(openai.AuthenticationError):
            sdk.responses.retrieve(created.id)
    assert hashed not in running.log("api-auth")
