"""Routing models to upstreams: the config file, the single-upstream env vars, the synthetic model."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.errors import ConfigError, ModelNotFoundError
from worker.routing import UpstreamApi, load_routes
from worker.settings import Settings


def test_config_file_routes_each_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A respool.toml table routes its model with its URL, API kind, upstream name and key variable."""
    config = tmp_path / "respool.toml"
    config.write_text(
        '[models."llama"]\nbase_url = "http://gpu:8000/v1/"\napi = "chat"\n'
        'upstream_model = "meta/llama"\napi_key_env = "GPU_KEY"\n'
        '[models."gpt"]\nbase_url = "https://api.example/v1"\napi = "responses"\n'
    )
    monkeypatch.setenv("GPU_KEY", "secret")
    routes = load_routes(Settings(config=config))
    llama = routes.resolve("llama")
    assert (llama.base_url, llama.api, llama.upstream_model, llama.api_key()) == (
        "http://gpu:8000/v1",
        UpstreamApi.CHAT,
        "meta/llama",
        "secret",
    )
    assert routes.resolve("gpt").upstream_model == "gpt"
    assert [route.model for route in routes.listed()] == ["gpt", "llama", "synthetic"]
    with pytest.raises(ModelNotFoundError):
        routes.resolve("other")


def test_single_upstream_passes_every_name_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """With RESPOOL_UPSTREAM_URL, any model name goes to that upstream under its own name."""
    monkeypatch.setenv("RESPOOL_UPSTREAM_API_KEY", "k")
    routes = load_routes(
        Settings(upstream_url="http://up/v1", upstream_api="responses", upstream_api_key="k")
    )
    route = routes.resolve("anything-at-all")
    assert (route.base_url, route.api, route.upstream_model, route.api_key()) == (
        "http://up/v1",
        UpstreamApi.RESPONSES,
        "anything-at-all",
        "k",
    )
    assert routes.resolve("synthetic").api is UpstreamApi.SYNTHETIC


@pytest.mark.parametrize(
    "text",
    [
        '[models."x"]\napi = "chat"\n',
        '[models."x"]\nbase_url = "http://u"\napi = "grpc"\n',
        "models = 3\n",
        "[[[",
    ],
)
def test_bad_config_fails_at_start(tmp_path: Path, text: str) -> None:
    """A config without a base_url, with an unknown api, or that is not TOML, fails loudly at start."""
    config = tmp_path / "respool.toml"
    config.write_text(text)
    with pytest.raises(ConfigError):
        load_routes(Settings(config=config))
