"""Settings, read once per process from `RESPOOL_*` env vars and passed explicitly (DESIGN.md §8)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Every knob of every respool process; each one is also an env var `RESPOOL_<NAME>`."""

    model_config = SettingsConfigDict(env_prefix="RESPOOL_", extra="ignore")

    # Where things are. Empty URLs mean "start the embedded servers" (`respool up`).
    redis_url: str = ""
    # Redis behind Sentinel (docs/redis.md): the sentinels' comma-separated host:port list and the
    # name they monitor the primary by, with the sentinels' own password if they ask for one. Set,
    # they stand for RESPOOL_REDIS_URL (which a `redis+sentinel://` URL can say as well).
    redis_sentinels: str = ""
    redis_sentinel_master: str = ""
    redis_sentinel_password: SecretStr | None = None
    database_url: str = ""
    data_dir: Path = Path(".respool")
    # The embedded Redis's binary (`respool up`): auto, bundled, or a path (api/up/embedded.py).
    redis_server: str = "auto"
    config: Path | None = None

    # The single-upstream case: every model name goes to this server.
    upstream_url: str = ""
    upstream_api: str = "chat"
    upstream_api_key: SecretStr | None = None

    # API.
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: SecretStr | None = Field(
        default=None, description='"key1:tenant-a,key2:tenant-b"; unset means no auth'
    )
    # Without keys the API serves anyone who reaches it: on loopback that is the laptop's own user,
    # anywhere else it must be the operator's explicit choice (api/auth.py, `open_api_refusal`).
    allow_no_auth: bool = False
    # Outages: how long the API gives an unreachable Redis or Postgres before it answers
    # 503, and the `retry-after` it sends with it (the SDK honours up to 120 s, PROTOCOL.md §5.5).
    redis_timeout_seconds: float = Field(default=5.0, gt=0)
    database_connect_timeout_seconds: int = Field(default=5, ge=1)
    # The most Postgres connections one process (an API replica, a worker) holds; each is kept once
    # opened (store.create_engine). Postgres' max_connections must cover their sum. Half are for
    # single statements on psycopg directly, half for transactions (worker/postgres/direct.py).
    database_connections: int = Field(default=20, ge=2)
    # The pooler between respool and Postgres (docs/postgres.md): "transaction" (PgBouncer's
    # `pool_mode = transaction`, Supavisor's transaction mode, RDS Proxy, Neon's pooled endpoint)
    # prepares no statement, as the next transaction may run on another server connection; "none"
    # and "session" prepare the hot statements once a connection (half Postgres's CPU for them).
    database_pooler: Literal["none", "session", "transaction"] = "none"
    # The longest a statement (a commit, a connection's checkout) waits for Postgres, client-side: a
    # stopped server, or one whose host went silent, answers nothing and its `statement_timeout`
    # never fires. The API answers 503 past it; a worker tries again (`database_wait_seconds`).
    database_timeout_seconds: float = Field(default=10.0, gt=0)
    retry_after_seconds: int = Field(default=2, ge=1, le=120)
    # How long Redis may be unreachable (a restart, a managed failover) before the responses that
    # need it give up: a worker keeps generating and holds what it cannot append, an open stream
    # stays open with heartbeats, and both go on from where they were once Redis answers again.
    redis_outage_seconds: float = Field(default=60.0, ge=0)

    # Limits on what one request may carry: a body over max_body_bytes is refused with
    # 413 before more of it is read; more input items than max_input_items with 400.
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    max_input_items: int = Field(default=2048, ge=1)
    # How many responses may precede a new one through previous_response_id (a 400 past it): each
    # row holds its whole conversation, so an unbounded chain would grow rows without end.
    max_chain_depth: int = Field(default=1000, ge=1)
    # Slow clients: a request body must have arrived this long after its headers (408
    # otherwise), and an SSE write the client leaves untaken this long drops its stream.
    body_timeout_seconds: float = Field(default=30.0, gt=0)
    sse_write_timeout_seconds: float = Field(default=60.0, gt=0)
    # Per-owner quotas, kept in Redis so they bind every API replica together: requests a
    # minute, and event streams open at once (429 with `retry-after` past either; 0: no limit). Off
    # by default: no single number suits every deployment, and without RESPOOL_API_KEYS every
    # client is one owner, so a per-key limit would silently be a global one.
    rate_limit_per_minute: int = Field(default=0, ge=0)
    max_streams_per_key: int = Field(default=0, ge=0)

    # API processes serving one port (uvicorn's process manager); `respool up` and `respool api`.
    api_replicas: int = 1
    # Peers whose X-Forwarded-For / X-Forwarded-Proto the API believes (uvicorn's
    # --forwarded-allow-ips: addresses, CIDRs, or "*"): the reverse proxy in front of it, so logs name
    # the client rather than the proxy.
    forwarded_allow_ips: str = "127.0.0.1"

    # Logs: "text", or "json" (one object a line, with request and response ids); and how much:
    # "info" shows startup, requests, warnings and errors; "debug" also the libraries' routine lines.
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # uvicorn's access log, a line a request (the API's own warnings and errors are logged either way).
    access_log: bool = True

    # Worker.
    workers: int = 1
    # Where a worker serves its Prometheus metrics (0: not served); `respool up` gives worker i port + i.
    worker_metrics_port: int = 0
    concurrency: int = 256
    queue: str = "respool"

    # Timing (DESIGN.md §4: heartbeat < lease TTL < registry_seconds). A worker killed outright is
    # noticed when its responses' deadlines pass (registry_seconds after its last heartbeat) by the
    # next maintenance (every maintenance_seconds): its responses are recovered within about 10 s.
    # (registry_seconds is also the TTL of RQ's records of a webhook delivery under way.)
    heartbeat_seconds: float = 2.0
    lease_seconds: float = 6.0
    registry_seconds: int = 8
    maintenance_seconds: int = 2
    cancel_poll_seconds: float = 0.25
    drain_seconds: float = 30.0
    # Back-pressure: above this many responses waiting in the queue, create answers 429 (0: no limit).
    max_queue_depth: int = 0
    # Runs of one response before it is given up (a worker dying under it each time).
    max_attempts: int = 3
    # How long a worker holding a response waits for an unreachable Postgres before giving up on it,
    # and `respool migrate` for one still starting up.
    database_wait_seconds: float = Field(default=120.0, ge=0)
    # A foreground request whose client goes away is cancelled (DESIGN.md §2).
    cancel_on_disconnect: bool = True

    # The upstream call (worker/runner/upstream.py). Faults before any output are retried with backoff and
    # jitter; a tiny backoff (e.g. 0.01) makes them fast in tests. A stall is silence between bytes.
    upstream_retries: int = Field(default=3, ge=0)
    upstream_backoff_seconds: float = Field(default=0.5, ge=0)
    upstream_backoff_max_seconds: float = Field(default=8.0, ge=0)
    upstream_stall_seconds: float = Field(default=300.0, gt=0)
    upstream_connect_seconds: float = Field(default=10.0, gt=0)
    # Under load, a worker sends its appends to Redis, and an API reads its live streams, at most once
    # every `batch_ms` (DESIGN.md §7): what arrives meanwhile goes in one round trip. A process whose
    # last round trip carried one response's appends, or brought one stream's events, goes at once:
    # this adds no wait to a lone stream. 20: at 30 streams of tokens 20 ms apart, 17% less CPU a
    # token than 10, with the added gap p99 unchanged (README, CPU cost).
    batch_ms: float = Field(default=20.0, ge=0, le=100)
    # A background response nobody follows live (no `stream`: its client polls) may end up to
    # `gather_ends_ms` after it finished, with the others that finish meanwhile: their ends go to
    # Postgres as one statement with one commit, their last appends to Redis in one round trip
    # (worker/runner/ends.py). 0: each end alone, at once.
    gather_ends_ms: float = Field(default=30.0, ge=0, le=1000)

    # Tools (DESIGN.md §10): a server-side tool type this deployment has no backend for (e.g. Codex
    # CLI's `web_search` with no search backend) is left out of what the model is offered and named
    # on the Response's `unavailable_tools` ("drop"), or refused as a 400 ("reject").
    unavailable_tools: Literal["drop", "reject"] = "drop"
    # DESIGN.md §13: outbound connections (MCP servers, search backends, webhooks) go to public
    # addresses only; this comma-separated list of hosts, host:ports, IPs and CIDRs opens others.
    outbound_allowlist: str = ""
    # How long a queued or running response's tool secrets (an mcp tool's headers) are kept for it.
    tool_secrets_seconds: int = Field(default=86400, gt=0)
    # A server-side tool's call (an MCP call, a search) gives up after this long.
    tool_timeout_seconds: float = Field(default=120.0, gt=0)
    # Web search (`web_search` tools): the backend that runs it ("" = none: the tools are
    # unavailable), its base URL (SearXNG's is required; Tavily's defaults to its API), its key
    # (Tavily), and how many results the model is given per search.
    web_search_backend: Literal["", "searxng", "tavily", "mcp"] = ""
    web_search_url: str = ""
    web_search_mcp_tool: str = ""  # the `mcp` backend's `<label>/<tool>` (a server in respool.toml)
    web_search_api_key: SecretStr | None = None
    web_search_max_results: int = Field(default=5, gt=0, le=20)

    # Compaction (worker/protocol/compaction.py): the keys respool's compaction items are sealed
    # with, comma-separated, the first sealing and any opening (to rotate one in). None: a key made
    # once and kept in Postgres (`server_key`), shared by every process.
    compaction_keys: SecretStr | None = None
    # `context_management` without a `compact_threshold` compacts past 80% of the model's context
    # where its tokenizer says it (vLLM's /tokenize), else past this many input tokens.
    compact_threshold_tokens: int = Field(default=24000, gt=0)
    # The longest summary a compaction asks the model for (its `max_tokens`).
    compact_summary_tokens: int = Field(default=2048, gt=0)

    # Webhooks (DESIGN.md §12): an endpoint for every owner (more, per owner, in respool.toml), its
    # whsec_ secret (comma-separated while rotating); how long a delivery is retried, its backoff
    # (exponential, fully jittered, capped), its timeouts; deliveries one worker runs at once, and to
    # one endpoint at once.
    webhook_url: str = ""
    webhook_secret: SecretStr | None = None
    webhook_max_age_seconds: float = Field(default=3 * 24 * 3600.0, gt=0)
    webhook_backoff_seconds: float = Field(default=5.0, gt=0)
    webhook_backoff_max_seconds: float = Field(default=3600.0, gt=0)
    webhook_connect_seconds: float = Field(default=5.0, gt=0)
    webhook_timeout_seconds: float = Field(default=15.0, gt=0)
    webhook_concurrency: int = Field(default=64, gt=0)
    webhook_endpoint_concurrency: int = Field(default=8, gt=0)

    # SSE comment heartbeats during silences, so idle connections survive proxies (PROTOCOL.md §5.3).
    sse_heartbeat_seconds: float = 15.0

    # Retention (DESIGN.md §2.7).
    stream_ttl_seconds: int = 3600
    retention_days: float = 30.0

    # The synthetic model's pace, seconds between words: a small one, so that a first `stream=True`
    # is seen to stream (0 for tests and the benchmark).
    synthetic_delay_seconds: float = Field(default=0.02, ge=0)

    @model_validator(mode="after")
    def _search_backend_is_whole(self) -> Settings:
        if self.web_search_backend == "searxng" and not self.web_search_url:
            raise ValueError("RESPOOL_WEB_SEARCH_BACKEND=searxng needs RESPOOL_WEB_SEARCH_URL (its base URL)")
        if self.web_search_backend == "tavily" and self.web_search_api_key is None:
            raise ValueError("RESPOOL_WEB_SEARCH_BACKEND=tavily needs RESPOOL_WEB_SEARCH_API_KEY")
        label, _, tool = self.web_search_mcp_tool.partition("/")
        if self.web_search_backend == "mcp" and not (label and tool):
            raise ValueError(
                "RESPOOL_WEB_SEARCH_BACKEND=mcp needs RESPOOL_WEB_SEARCH_MCP_TOOL=<label>/<tool> "
                "(a server registered in respool.toml, and its search tool)"
            )
        return self

    @model_validator(mode="after")
    def _sentinels_name_the_redis(self) -> Settings:
        """RESPOOL_REDIS_SENTINELS and its master become `redis_url`'s `redis+sentinel://` form, so
        that every client (and every process `respool up` starts) is built from the one URL."""
        from worker.sentinel import sentinel_address, sentinel_url

        if bool(self.redis_sentinels) != bool(self.redis_sentinel_master):
            raise ValueError("RESPOOL_REDIS_SENTINELS and RESPOOL_REDIS_SENTINEL_MASTER go together")
        if self.redis_sentinels:
            password = self.redis_sentinel_password
            url = sentinel_url(
                self.redis_sentinels,
                self.redis_sentinel_master,
                password.get_secret_value() if password else None,
            )
            if self.redis_url and self.redis_url != url:
                raise ValueError("set RESPOOL_REDIS_URL or RESPOOL_REDIS_SENTINELS, not both")
            self.redis_url = url
        sentinel_address(self.redis_url)  # a malformed redis+sentinel:// URL is refused here
        return self

    @property
    def has_servers(self) -> bool:
        """Whether external Redis and Postgres are configured (otherwise `up` embeds them)."""
        return bool(self.redis_url and self.database_url)


# RESPOOL_* variables the project reads outside `Settings`: its tests', its benchmark's, the compose
# file's. Not settings, but no misspelling either.
PROJECT_VARIABLES = frozenset(
    {
        "RESPOOL_BENCH_LITELLM",
        "RESPOOL_BENCH_WEBHOOK_SECRET",
        "RESPOOL_IMAGE",
        "RESPOOL_OPENRESPONSES_SCHEMA",
        "RESPOOL_TEST_CODEX",
        "RESPOOL_TEST_UPSTREAM_KEY",
        "RESPOOL_TEST_VAULT_AUTHORIZATION",
        "RESPOOL_TOML",
    }
)


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each `RESPOOL_*` variable in `environ` that respool does not read, naming the
    nearest setting: `extra="ignore"` would otherwise drop a misspelled one without a word."""
    known = {f"RESPOOL_{name.upper()}" for name in Settings.model_fields}
    warnings = []
    for name in sorted(environ):
        if not name.startswith("RESPOOL_") or name in known or name in PROJECT_VARIABLES:
            continue
        # compared without the prefix they share, which would make every name look near
        nearest = difflib.get_close_matches(name[8:], [known_name[8:] for known_name in known], n=1)
        hint = f" (did you mean RESPOOL_{nearest[0]}?)" if nearest else ""
        warnings.append(f"{name} is not a respool setting{hint}: it is ignored")
    return warnings
