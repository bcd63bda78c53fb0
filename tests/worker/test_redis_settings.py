"""How respool is told where its Redis is and what it refuses (worker/settings.py,
worker/connections.py, worker/compatibility.py): pure rules, no server."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from worker.compatibility import problems
from worker.sentinel import SentinelAddress, sentinel_address, sentinel_url
from worker.settings import Settings, unknown_variables


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("redis+sentinel://a:1/m", SentinelAddress((("a", 1),), "m")),
        ("redis+sentinel://a:1,b,c:3/m/2", SentinelAddress((("a", 1), ("b", 26379), ("c", 3)), "m", db=2)),
        (
            "redis+sentinel://u:p%40ss@a:1/m?sentinel_password=s%2F1",
            SentinelAddress((("a", 1),), "m", username="u", password="p@ss", sentinel_password="s/1"),
        ),
        ("redis+sentinel://:pw@a:1/m", SentinelAddress((("a", 1),), "m", password="pw")),
    ],
)
def test_a_sentinel_url_names_the_sentinels_master_db_and_passwords(
    url: str, address: SentinelAddress
) -> None:
    """Each part of a redis+sentinel:// URL lands where the clients take it from."""
    assert sentinel_address(url) == address


@pytest.mark.parametrize(
    "url", ["redis+sentinel://a:1", "redis+sentinel://a:1/m/x", "redis+sentinel://a:b/m"]
)
def test_a_malformed_sentinel_url_is_refused_as_a_setting(url: str) -> None:
    """No master, a database that is no number, or a port that is none: an error at start."""
    with pytest.raises(ValidationError):
        Settings(redis_url=url)


def test_a_plain_url_is_redis_pys_own() -> None:
    """redis://, rediss:// and unix:// URLs are not Sentinel's."""
    assert sentinel_address("redis://127.0.0.1:6379/0") is None


def test_the_sentinel_settings_become_the_redis_url() -> None:
    """RESPOOL_REDIS_SENTINELS and its master make `redis_url`, so `respool up` embeds no Redis."""
    settings = Settings(
        redis_sentinels="10.0.0.1:26379, 10.0.0.2:26379",
        redis_sentinel_master="respool",
        redis_sentinel_password="s/1",
        database_url="postgresql://x",
    )
    assert settings.redis_url == sentinel_url("10.0.0.1:26379,10.0.0.2:26379", "respool", "s/1")
    assert sentinel_address(settings.redis_url) == SentinelAddress(
        (("10.0.0.1", 26379), ("10.0.0.2", 26379)), "respool", sentinel_password="s/1"
    )
    assert settings.has_servers


@pytest.mark.parametrize(
    "given",
    [
        {"redis_sentinels": "a:1"},
        {"redis_sentinel_master": "m"},
        {"redis_sentinels": "a:1", "redis_sentinel_master": "m", "redis_url": "redis://other:6379"},
    ],
)
def test_sentinel_settings_that_disagree_are_refused(given: dict[str, str]) -> None:
    """Sentinels without a master, a master without sentinels, or sentinels beside another URL."""
    with pytest.raises(ValidationError):
        Settings(**given)  # type: ignore[arg-type]


def test_an_unknown_variable_is_named_with_the_nearest_setting() -> None:
    """Misspellings get the setting they were likely meant as; the project's own variables, none."""
    environ = {
        "RESPOOL_REDIS_ULR": "x",
        "RESPOOL_REDIS_URL": "x",
        "RESPOOL_TEST_CODEX": "x",
        "RESPOOL_QQQZZZ": "x",
        "HOME": "/root",
    }
    assert unknown_variables(environ) == [
        "RESPOOL_QQQZZZ is not a respool setting: it is ignored",
        "RESPOOL_REDIS_ULR is not a respool setting (did you mean RESPOOL_REDIS_URL?): it is ignored",
    ]


@pytest.mark.parametrize(
    ("server", "missing", "expected"),
    [
        ({"redis_mode": "standalone", "redis_version": "7.0.15"}, [], []),
        ({"redis_mode": "cluster", "redis_version": "7.0.15"}, [], ["Redis Cluster is not supported yet"]),
        ({"redis_mode": "standalone", "redis_version": "6.0.9"}, [], ["Redis 6.0.9 is too old"]),
        ({"redis_mode": "standalone", "redis_version": "6.2.0"}, ["XADD", "LMOVE"], ["XADD, LMOVE"]),
    ],
)
def test_what_is_refused_is_named(server: dict[str, str], missing: list[str], expected: list[str]) -> None:
    """A cluster, a version before 6.2 and missing commands each give a problem that names them."""
    found = problems(server, missing)
    assert len(found) == len(expected)
    for problem, words in zip(found, expected, strict=True):
        assert words in problem
