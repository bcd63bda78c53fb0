"""Which upstream serves which model: `respool.toml` (path in `RESPOOL_CONFIG`), the single-upstream
env vars, and the built-in `synthetic` model.

    # respool.toml
    [models."llama-3.1-8b"]
    base_url = "http://gpu-1:8000/v1"
    api = "chat"                      # "chat" (translated) or "responses" (native)
    upstream_model = "meta-llama/Llama-3.1-8B-Instruct"   # defaults to the table's name
    api_key_env = "VLLM_API_KEY"      # optional: the env var holding the upstream's key

    # MCP servers a request may name by label alone: {"type": "mcp", "server_label": "docs"}
    [mcp_servers.docs]
    url = "https://docs-mcp.internal/mcp"
    headers_env = { Authorization = "DOCS_MCP_AUTHORIZATION" }   # header => env var with its value

    # Webhook endpoints (DESIGN.md §12): where background responses' end events go, signed.
    [webhooks.billing]
    url = "https://hooks.example.com/respool"
    secret_env = "BILLING_WEBHOOK_SECRET"   # env var: whsec_... (several, comma-separated, to rotate)
    owners = ["tenant-a"]                   # optional: every owner
    events = ["response.completed"]         # optional: all four

    (`RESPOOL_WEBHOOK_URL` with `RESPOOL_WEBHOOK_SECRET` adds an endpoint `default` for every owner.)

Keys and secrets are read from the environment when a request is sent, never stored in a row or a job.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from worker.errors import ConfigError, ModelNotFoundError
from worker.protocol.webhooks import EVENT_TYPES, Endpoint
from worker.settings import Settings

SYNTHETIC = "synthetic"
UPSTREAM_KEY_ENV = "RESPOOL_UPSTREAM_API_KEY"
WEBHOOK_SECRET_ENV = "RESPOOL_WEBHOOK_SECRET"


@dataclass(frozen=True)
class RegisteredServer:
    """An MCP server the operator registered under a label (DESIGN.md §10)."""

    label: str
    url: str
    headers_env: tuple[tuple[str, str], ...] = ()  # (header, env var holding its value)

    def headers(self) -> dict[str, str]:
        """Its headers, read from the environment now (never stored)."""
        return {name: os.environ.get(env, "") for name, env in self.headers_env}


class UpstreamApi(StrEnum):
    CHAT = "chat"
    RESPONSES = "responses"
    SYNTHETIC = "synthetic"


@dataclass(frozen=True)
class Route:
    """How to reach the model a client named."""

    model: str
    api: UpstreamApi
    base_url: str = ""
    upstream_model: str = ""
    api_key_env: str | None = None

    @property
    def is_native(self) -> bool:
        """Whether the upstream speaks Responses (else Chat Completions is what it is sent)."""
        return self.api is UpstreamApi.RESPONSES

    def api_key(self) -> str | None:
        """The upstream key, read from its env var now (so rotating it needs no restart of the config)."""
        return os.environ.get(self.api_key_env) if self.api_key_env else None


@dataclass(frozen=True)
class Routes:
    """The routing table; `fallback` (the single-upstream case) takes every name not in `models`."""

    models: dict[str, Route]
    fallback: Route | None = None
    mcp_servers: dict[str, RegisteredServer] = field(default_factory=dict)
    webhooks: tuple[Endpoint, ...] = ()

    def resolve(self, model: str) -> Route:
        """The route for `model`, or `ModelNotFoundError`."""
        route = self.models.get(model)
        if route is not None:
            return route
        if self.fallback is not None:
            return Route(model, self.fallback.api, self.fallback.base_url, model, self.fallback.api_key_env)
        raise ModelNotFoundError(model)

    def native_for(self, model: str | None) -> bool | None:
        """Whether `model` goes to a Responses upstream; None if it is not routed (any more)."""
        try:
            return self.resolve(model or "").is_native
        except ModelNotFoundError:
            return None

    def api_key_of(self, model: str) -> str:
        """The key sent upstream for `model` ("" if none, or if the model is not routed)."""
        try:
            return self.resolve(model).api_key() or ""
        except ModelNotFoundError:
            return ""

    def listed(self) -> list[Route]:
        """The routes to show in `GET /v1/models` (a pass-through upstream has no names of its own)."""
        return sorted(self.models.values(), key=lambda route: route.model)


def load_routes(settings: Settings) -> Routes:
    """Build the routing table from the config file and env; raise `ConfigError` if they are wrong."""
    models = {SYNTHETIC: Route(SYNTHETIC, UpstreamApi.SYNTHETIC)}
    servers: dict[str, RegisteredServer] = {}
    endpoints: list[Endpoint] = []
    if settings.config is not None:
        document = _read_config(settings.config)
        models.update(_models(document, settings.config))
        servers = _servers(document, settings.config)
        endpoints = _endpoints(document, settings.config)
    if settings.webhook_url:
        endpoints.append(Endpoint("default", settings.webhook_url, WEBHOOK_SECRET_ENV))
    fallback = None
    if settings.upstream_url:
        api = _api(settings.upstream_api, "RESPOOL_UPSTREAM_API")
        key_env = UPSTREAM_KEY_ENV if settings.upstream_api_key is not None else None
        fallback = Route("*", api, settings.upstream_url.rstrip("/"), "", key_env)
    return Routes(models, fallback, servers, tuple(endpoints))


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc


def _servers(document: dict[str, Any], path: Path) -> dict[str, RegisteredServer]:
    tables = document.get("mcp_servers", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"{path}: [mcp_servers] must be a table of servers")
    servers = {}
    for label, table in tables.items():
        if not isinstance(table, dict) or not table.get("url"):
            raise ConfigError(f'{path}: [mcp_servers."{label}"] needs a url')
        headers = table.get("headers_env", {})
        if not isinstance(headers, dict):
            raise ConfigError(f'{path}: [mcp_servers."{label}"].headers_env must be a table')
        pairs = tuple((str(name), str(env)) for name, env in headers.items())
        servers[label] = RegisteredServer(label, str(table["url"]), pairs)
    return servers


def _endpoints(document: dict[str, Any], path: Path) -> list[Endpoint]:
    tables = document.get("webhooks", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"{path}: [webhooks] must be a table of endpoints")
    endpoints = []
    for name, table in tables.items():
        where = f'{path}: [webhooks."{name}"]'
        if not isinstance(table, dict) or not table.get("url") or not table.get("secret_env"):
            raise ConfigError(f"{where} needs a url and a secret_env")
        owners = table.get("owners")
        if owners is not None and not (isinstance(owners, list) and all(isinstance(o, str) for o in owners)):
            raise ConfigError(f"{where}.owners must be a list of owners")
        events = table.get("events", list(EVENT_TYPES))
        if not isinstance(events, list) or not set(events) <= set(EVENT_TYPES) or not events:
            raise ConfigError(f"{where}.events must be a list of {', '.join(EVENT_TYPES)}")
        endpoints.append(
            Endpoint(
                name=str(name),
                url=str(table["url"]),
                secret_env=str(table["secret_env"]),
                owners=None if owners is None else frozenset(owners),
                events=frozenset(events),
            )
        )
    return endpoints


def _models(document: dict[str, Any], path: Path) -> dict[str, Route]:
    tables = document.get("models", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"{path}: [models] must be a table of models")
    return {name: _route(name, table, path) for name, table in tables.items()}


def _route(name: str, table: dict[str, Any], path: Path) -> Route:
    if not isinstance(table, dict) or not table.get("base_url"):
        raise ConfigError(f'{path}: [models."{name}"] needs a base_url')
    api = _api(str(table.get("api", "chat")), f'[models."{name}"].api')
    return Route(
        model=name,
        api=api,
        base_url=str(table["base_url"]).rstrip("/"),
        upstream_model=str(table.get("upstream_model", name)),
        api_key_env=table.get("api_key_env"),
    )


def _api(value: str, where: str) -> UpstreamApi:
    if value not in (UpstreamApi.CHAT, UpstreamApi.RESPONSES):
        raise ConfigError(f"{where} must be 'chat' or 'responses', not {value!r}")
    return UpstreamApi(value)
