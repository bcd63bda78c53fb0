"""The deployment files (deploy/, docker-compose.yml, .dockerignore): the offline validators accept
them, and they keep what a user relies on — workers that scale and drain, probes and health checks
on paths the API serves, every process given its servers and a command `respool` knows.

Nothing here needs Docker, a cluster or the network: hadolint, check-jsonschema (with its vendored
compose-spec) and kubernetes-validate (with its bundled schemas) run from the project's venv.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from api.app import create_app
from api.cli import _parser
from worker.routing import load_routes
from worker.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
COMPOSE = ROOT / "docker-compose.yml"
KUBERNETES = ROOT / "deploy" / "kubernetes"
KUSTOMIZATION = KUBERNETES / "kustomization.yaml"
MANIFESTS = sorted(path for path in KUBERNETES.glob("*.yaml") if path != KUSTOMIZATION)
# The validators are console scripts of the venv running the tests.
BIN = Path(sys.executable).parent
# An older release that managed clusters still serve, and the newest the validator ships.
KUBERNETES_VERSIONS = ["1.32.0", "1.37.0"]
RESPOOL_SERVICES = ["migrate", "api", "worker"]


def _run(*command: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(part) for part in command], capture_output=True, text=True, timeout=60, check=False
    )


def _compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return document


def _kubernetes() -> dict[tuple[str, str], dict[str, Any]]:
    """Every resource of the manifests, by (kind, name)."""
    resources = {}
    for path in MANIFESTS:
        for resource in yaml.safe_load_all(path.read_text()):
            resources[resource["kind"], resource["metadata"]["name"]] = resource
    return resources


def _pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    for (kind, name), resource in _kubernetes().items():
        if kind in ("Deployment", "Job"):
            yield name, resource["spec"]["template"]["spec"]


def _seconds(duration: str) -> float:
    """A compose duration ("45s", "1m30s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s)", duration)
    assert parts, f"not a duration: {duration!r}"
    return sum(float(value) * units[unit] for value, unit in parts)


def _drain_seconds(environment: dict[str, Any]) -> float:
    return float(environment.get("RESPOOL_DRAIN_SECONDS") or Settings.model_fields["drain_seconds"].default)


@functools.cache
def _served_paths() -> frozenset[str]:
    # create_app connects to nothing until its lifespan starts.
    return frozenset(getattr(route, "path", "") for route in create_app(Settings()).routes)


def test_dockerfile_passes_hadolint() -> None:
    """hadolint finds nothing in deploy/Dockerfile, not even a style note."""
    result = _run(BIN / "hadolint", "--no-color", "--failure-threshold", "style", DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_file_matches_the_compose_spec() -> None:
    """docker-compose.yml validates against the compose-spec schema."""
    result = _run(BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec", COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_manifests_validate_strictly(version: str) -> None:
    """Every Kubernetes manifest validates, with no unknown field, against the release's schemas."""
    result = _run(BIN / "kubernetes-validate", "--strict", "--kubernetes-version", version, *MANIFESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed" in result.stdout


def test_kustomization_lists_every_manifest() -> None:
    """`kubectl apply -k deploy/kubernetes` applies every manifest of the directory."""
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
    assert sorted(kustomization["resources"]) == [path.name for path in MANIFESTS]


def test_image_holds_every_package_and_runs_respool_unprivileged() -> None:
    """The image copies every package the wheel holds, the build context lets them in, and the
    image runs `respool` as a fixed non-root user."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    dockerfile = DOCKERFILE.read_text()
    allowed = DOCKERIGNORE.read_text().splitlines()
    for package in packages:
        assert re.search(rf"^COPY {package} \./{package}$", dockerfile, re.MULTILINE), package
        assert f"!{package}/" in allowed, package
    assert re.findall(r"^USER (\d+):(\d+)$", dockerfile, re.MULTILINE) == [("10001", "10001")]
    assert '\nENTRYPOINT ["respool"]\n' in dockerfile


def test_compose_workers_scale_and_drain() -> None:
    """`--scale worker=N` works (no container name, no ports) and Docker waits out the drain."""
    compose = _compose()
    worker = compose["services"]["worker"]
    assert "container_name" not in worker
    assert "ports" not in worker
    assert _seconds(worker["stop_grace_period"]) > _drain_seconds(worker["environment"])


def test_compose_api_replicas_sit_behind_one_port() -> None:
    """Two API replicas publish no port of their own; the proxy publishes 8000 and waits for them."""
    services = _compose()["services"]
    assert services["api"]["deploy"]["replicas"] == 2
    assert "ports" not in services["api"]
    assert services["proxy"]["ports"] == ["8000:8000"]
    assert services["proxy"]["depends_on"]["api"]["condition"] == "service_healthy"
    nginx = (ROOT / "deploy" / "nginx.conf").read_text()
    for directive in (
        "server api:8000 resolve max_fails=0;",
        "proxy_buffering off;",
        "proxy_http_version 1.1;",
    ):
        assert directive in nginx


def test_compose_api_health_check_asks_a_served_path() -> None:
    """The API's health check asks /healthz, a path the app serves."""
    test = " ".join(_compose()["services"]["api"]["healthcheck"]["test"])
    paths = re.findall(r"http://127\.0\.0\.1:8000(/\w+)", test)
    assert paths == ["/healthz"]
    assert set(paths) <= _served_paths()


def test_compose_gives_every_respool_process_its_servers() -> None:
    """migrate, api and worker all get RESPOOL_REDIS_URL and RESPOOL_DATABASE_URL, and api and worker
    start only after the migration succeeded; Postgres has room for their connections."""
    services = _compose()["services"]
    for name in RESPOOL_SERVICES:
        environment = services[name]["environment"]
        assert environment["RESPOOL_REDIS_URL"].startswith("redis://redis:6379/"), name
        assert environment["RESPOOL_DATABASE_URL"].startswith("postgresql://"), name
        assert environment["RESPOOL_DATABASE_URL"].endswith("@postgres:5432/respool"), name
    for name in ("api", "worker"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    command = services["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--save") + 1] == ""  # the AOF alone: no snapshots
    # Room for each API replica's and worker's RESPOOL_DATABASE_CONNECTIONS (20) at --scale worker=N.
    assert "max_connections=400" in services["postgres"]["command"]


def test_every_command_is_a_respool_command() -> None:
    """Each process's command, in compose and in Kubernetes, parses as a `respool` command."""
    services = _compose()["services"]
    commands = [services[name]["command"] for name in RESPOOL_SERVICES]
    for _, spec in _pod_specs():
        commands += [container["args"] for container in spec["containers"]]
    assert {command[0] for command in commands} == {"migrate", "api", "worker"}
    for command in commands:
        _parser().parse_args(command)


def _env_sources() -> list[dict[str, Any]]:
    """The ConfigMaps and Secrets some pod takes its environment from (envFrom)."""
    resources = _kubernetes()
    names = {
        (kind, source[key]["name"])
        for _, spec in _pod_specs()
        for container in spec["containers"]
        for source in container.get("envFrom", [])
        for key, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret"))
        if key in source
    }
    return [resources[name] for name in sorted(names)]


def test_every_respool_variable_is_a_setting() -> None:
    """Every RESPOOL_* variable the files set names a setting (a misspelt one would be ignored)."""
    known = {f"RESPOOL_{name.upper()}" for name in Settings.model_fields}
    services = _compose()["services"]
    names = {
        name
        for service in ("x-respool", "api", "worker")
        for name in (_compose()["x-respool"] if service == "x-respool" else services[service])["environment"]
        if name.startswith("RESPOOL_")
    }
    for resource in _env_sources():
        names |= {
            name
            for name in set(resource.get("data") or {}) | set(resource.get("stringData") or {})
            if name.startswith("RESPOOL_")
        }
    assert names
    assert names <= known, names - known


def test_kubernetes_release_selector_picks_the_migration_and_its_settings() -> None:
    """README's first step of a release (component in (config, migrate)) applies the ConfigMap, the
    Secrets and the migration Job, and nothing that serves or runs responses."""
    picked = {
        (kind, name)
        for (kind, name), resource in _kubernetes().items()
        if resource["metadata"]["labels"].get("app.kubernetes.io/component") in ("config", "migrate")
    }
    assert picked == {
        ("ConfigMap", "respool"),
        ("ConfigMap", "respool-models"),
        ("Secret", "respool"),
        ("Secret", "respool-upstream"),
        ("Job", "respool-migrate"),
    }
    readme = (ROOT / "README.md").read_text()
    assert "kubectl apply -k deploy/kubernetes -l 'app.kubernetes.io/component in (config,migrate)'" in readme


def test_kubernetes_worker_outlives_its_drain() -> None:
    """The worker pod's grace period outlasts RESPOOL_DRAIN_SECONDS of the ConfigMap."""
    resources = _kubernetes()
    drain = _drain_seconds(resources["ConfigMap", "respool"]["data"])
    spec = resources["Deployment", "respool-worker"]["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] > drain


def test_kubernetes_api_probes_ask_served_paths() -> None:
    """The API's startup, readiness and liveness probes ask /healthz, which the app serves; none
    gates traffic on /readyz, which would refuse every connection while Redis or Postgres is down."""
    resources = _kubernetes()
    (container,) = resources["Deployment", "respool-api"]["spec"]["template"]["spec"]["containers"]
    probes = ("startupProbe", "readinessProbe", "livenessProbe")
    assert {container[probe]["httpGet"]["path"] for probe in probes} == {"/healthz"}
    assert {"/healthz", "/readyz"} <= _served_paths()


def test_kubernetes_service_reaches_the_api_pods() -> None:
    """The respool-api Service selects the API pods and sends traffic to their http port."""
    resources = _kubernetes()
    template = resources["Deployment", "respool-api"]["spec"]["template"]
    service = resources["Service", "respool-api"]["spec"]
    assert service["selector"].items() <= template["metadata"]["labels"].items()
    (container,) = template["spec"]["containers"]
    assert [port["targetPort"] for port in service["ports"]] == [port["name"] for port in container["ports"]]


def test_kubernetes_pods_run_unprivileged_without_service_links() -> None:
    """Every pod runs as the image's non-root user and gets no service-link variables (a Service named
    `respool` would set RESPOOL_PORT=tcp://..., which respool would read as its port)."""
    specs = dict(_pod_specs())
    assert set(specs) == {"respool-api", "respool-worker", "respool-migrate"}
    for name, spec in specs.items():
        assert spec["enableServiceLinks"] is False, name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] == 10001, name


# --- what a live compose stack showed (issue 15) ----------------------------------------------------

LONG_RUNNING = ["redis", "postgres", "api", "worker", "proxy", "vllm", "ollama"]


def _readme_settings() -> set[str]:
    """The RESPOOL_* names in the first cell of the rows of docs/configuration.md's table."""
    rows = re.findall(
        r"^\| (`RESPOOL_[^|]*)\|", (ROOT / "docs" / "configuration.md").read_text(), re.MULTILINE
    )
    return {name for cell in rows for name in re.findall(r"`(RESPOOL_[A-Z_]+)`", cell)}


def test_postgres_is_healthy_only_once_it_listens_on_tcp() -> None:
    """The health check asks over TCP: the image's first-start server listens on the socket only, and
    `migrate` (which also waits by itself) would meet a refused connection."""
    test = _compose()["services"]["postgres"]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "pg_isready"]
    assert test[test.index("-h") + 1] == "127.0.0.1"
    assert Settings.model_fields["database_wait_seconds"].default >= 60


def test_every_container_keeps_bounded_logs() -> None:
    """Every service logs to rotated json-file logs of bounded size."""
    for name, service in _compose()["services"].items():
        logging = service["logging"]
        assert logging["driver"] == "json-file", name
        assert (
            _seconds_or_size(logging["options"]["max-size"]) and int(logging["options"]["max-file"]) >= 1
        ), name


def _seconds_or_size(size: str) -> bool:
    return bool(re.fullmatch(r"\d+[kmg]", size))


def test_every_readme_setting_reaches_the_containers() -> None:
    """Every setting of docs/configuration.md's table is a setting, and reaches every respool container without
    editing a file: through respool.env in compose (an env_file, optional), through the `respool`
    ConfigMap or Secret in Kubernetes; the README says so."""
    documented = _readme_settings()
    known = {f"RESPOOL_{name.upper()}" for name in Settings.model_fields}
    assert len(documented) > 30
    assert documented <= known, documented - known
    services = _compose()["services"]
    for name in RESPOOL_SERVICES:
        files = services[name]["env_file"]
        assert {"path": "respool.env", "required": False} in files, name
    assert {"path": "upstream.env", "required": False} in services["worker"]["env_file"]
    for name, spec in _pod_specs():
        (container,) = spec["containers"]
        assert {"configMapRef": {"name": "respool"}} in container["envFrom"], name
    readme = (ROOT / "README.md").read_text()
    assert "respool.env" in readme and "upstream.env" in readme


def test_respool_toml_is_mounted_where_respool_config_says() -> None:
    """compose mounts a respool.toml (RESPOOL_TOML, else deploy/respool.toml) at RESPOOL_CONFIG; the
    Kubernetes pods that route mount the respool-models ConfigMap there; both defaults load."""
    compose = _compose()
    target = compose["x-respool"]["environment"]["RESPOOL_CONFIG"]
    for name in RESPOOL_SERVICES:
        assert {"source": "respool-toml", "target": target} in compose["services"][name]["configs"], name
    assert compose["configs"]["respool-toml"]["file"] == "${RESPOOL_TOML:-./deploy/respool.toml}"
    assert load_routes(Settings(config=ROOT / "deploy" / "respool.toml")).listed()[0].model == "synthetic"
    resources = _kubernetes()
    config_path = Path(resources["ConfigMap", "respool"]["data"]["RESPOOL_CONFIG"])
    toml = resources["ConfigMap", "respool-models"]["data"][config_path.name]
    for name in ("respool-api", "respool-worker"):
        spec = resources["Deployment", name]["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(config_path.parent)]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert volume["configMap"]["name"] == "respool-models", name
    assert tomllib.loads(toml).get("models", {}) == {}


def test_the_api_believes_its_proxy() -> None:
    """Behind nginx (compose) or an Ingress (Kubernetes) the API believes X-Forwarded-For."""
    assert _compose()["services"]["api"]["environment"]["RESPOOL_FORWARDED_ALLOW_IPS"] == "*"
    assert _kubernetes()["ConfigMap", "respool"]["data"]["RESPOOL_FORWARDED_ALLOW_IPS"] == "*"
    nginx = (ROOT / "deploy" / "nginx.conf").read_text()
    assert "proxy_set_header X-Forwarded-For $remote_addr;" in nginx


def test_nginx_gives_up_on_a_silent_replica_quickly() -> None:
    """A replica being replaced costs a request 2 s at most before nginx tries another (not 60 s)."""
    nginx = (ROOT / "deploy" / "nginx.conf").read_text()
    assert "proxy_connect_timeout 2s;" in nginx
    assert "proxy_next_upstream error timeout;" in nginx


def test_the_image_builds_without_fetching_a_frontend() -> None:
    """No `# syntax=` line (it fetches a BuildKit frontend from a registry); the README says BuildKit is needed."""
    assert not re.search(r"^#\s*syntax=", DOCKERFILE.read_text(), re.MULTILINE | re.IGNORECASE)
    assert "BuildKit" in (ROOT / "README.md").read_text()


def test_upstream_profiles_pin_their_images_and_serve_the_model_positionally() -> None:
    """vLLM's image runs `vllm serve`, which takes the model positionally (its --model is deprecated);
    every image tag is pinned, never `latest`."""
    services = _compose()["services"]
    assert "--model" not in services["vllm"]["command"]
    assert services["vllm"]["command"] == ["${VLLM_MODEL:-Qwen/Qwen2.5-1.5B-Instruct}"]
    for name, service in services.items():
        if "build" in service:  # respool's own image, built here
            continue
        image = service.get("image", "")
        tag = image.rpartition(":")[2].rstrip("}")
        assert ":" in image and "latest" not in tag, (name, image)


def test_long_running_services_restart_and_the_readme_says_what_restarts_them() -> None:
    """Every long-running service restarts after a crash or an out-of-memory kill (`unless-stopped`);
    the README says what a deliberate `docker kill` does (nothing restarts it) and how to update the
    API without a gap."""
    services = _compose()["services"]
    assert {name: services[name]["restart"] for name in LONG_RUNNING} == dict.fromkeys(
        LONG_RUNNING, "unless-stopped"
    )
    readme = (ROOT / "README.md").read_text()
    for words in ("docker kill", "Compose v2", "--no-recreate --scale api=4"):
        assert words in readme, words


# --- no silent insecurity: settings from the shell, the forwarded address, the rolling update --------

# What the compose file before respool.env passed from the shell or .env, and the permission to serve
# without keys: each must reach respool from there still.
SHELL_SETTINGS = {
    "RESPOOL_API_KEYS",
    "RESPOOL_ALLOW_NO_AUTH",
    "RESPOOL_UPSTREAM_URL",
    "RESPOOL_UPSTREAM_API",
    "RESPOOL_UPSTREAM_API_KEY",
}


def _from_shell(environment: dict[str, Any]) -> dict[str, str]:
    """The settings a service takes from the shell or .env, by name: its FROM_SHELL_* entries."""
    return {
        name.removeprefix("FROM_SHELL_"): value
        for name, value in environment.items()
        if name.startswith("FROM_SHELL_")
    }


def test_settings_from_the_shell_reach_respool_through_the_entrypoint() -> None:
    """Every respool container runs deploy/compose-entrypoint.sh, mounted from the repository; each
    FROM_SHELL_<name> it reads is `${<name>:-}`, a setting; the keys reach the API, the upstream's
    key the workers only, and nothing the previous file passed is lost."""
    compose = _compose()
    services = compose["services"]
    assert compose["configs"]["compose-entrypoint"]["file"] == "./deploy/compose-entrypoint.sh"
    known = {f"RESPOOL_{name.upper()}" for name in Settings.model_fields}
    passed: dict[str, set[str]] = {}
    for name in RESPOOL_SERVICES:
        service = services[name]
        target = "/etc/respool/compose-entrypoint.sh"
        assert {"source": "compose-entrypoint", "target": target} in service["configs"], name
        assert service["entrypoint"] == ["/bin/sh", target], name
        for setting, value in _from_shell(service["environment"]).items():
            assert setting in known, setting
            assert value == f"${{{setting}:-}}", setting
            passed.setdefault(setting, set()).add(name)
    assert set(passed) == SHELL_SETTINGS
    assert passed["RESPOOL_API_KEYS"] == passed["RESPOOL_ALLOW_NO_AUTH"] == {"api"}
    assert passed["RESPOOL_UPSTREAM_API_KEY"] == {"worker"}
    script = (ROOT / "deploy" / "compose-entrypoint.sh").read_text()
    assert 'exec respool "$@"' in script and "FROM_SHELL_" in script


def test_the_compose_api_serves_without_keys_only_when_told() -> None:
    """The compose API listens on every interface, so without keys respool refuses to start it
    (tests/deploy/test_no_auth.py) unless RESPOOL_ALLOW_NO_AUTH=true, which the file never sets
    itself; the README says how to say it."""
    services = _compose()["services"]
    command = services["api"]["command"]
    assert command[command.index("--host") + 1] == "0.0.0.0"
    for name in RESPOOL_SERVICES:
        assert "RESPOOL_ALLOW_NO_AUTH" not in services[name]["environment"], name
    for resource in _env_sources():
        assert "RESPOOL_ALLOW_NO_AUTH" not in (resource.get("data") or {}), resource["metadata"]["name"]
    assert "RESPOOL_ALLOW_NO_AUTH=true docker compose up -d" in (ROOT / "README.md").read_text()


def test_nginx_forwards_the_address_it_saw() -> None:
    """nginx sets X-Forwarded-For to its peer's address, never appending to the client's own header,
    which the API (trusting "*") would otherwise take the client's word for."""
    nginx = (ROOT / "deploy" / "nginx.conf").read_text()
    assert re.findall(r"proxy_set_header X-Forwarded-For (\S+);", nginx) == ["$remote_addr"]
    assert "$proxy_add_x_forwarded_for" not in nginx


def test_rolling_update_settings_are_what_the_docs_say() -> None:
    """nginx never benches a replica (max_fails=0: one tried before it listened would be skipped for
    fail_timeout, and the update's old ones could stop meanwhile), moves on after 2 s to another only
    when the request never reached one, re-reads the replicas every 10 s; the proxy starts once the API
    is healthy; docs/deployment.md and the README give the same figures and the wait."""
    nginx = (ROOT / "deploy" / "nginx.conf").read_text()
    assert re.findall(r"^\s*server api:8000 (.*);$", nginx, re.MULTILINE) == ["resolve max_fails=0"]
    assert re.findall(r"proxy_next_upstream (.*);", nginx) == ["error timeout"]
    assert "proxy_connect_timeout 2s;" in nginx
    assert "resolver 127.0.0.11 valid=10s ipv6=off;" in nginx
    assert _compose()["services"]["proxy"]["depends_on"]["api"]["condition"] == "service_healthy"
    docs = (ROOT / "docs" / "deployment.md").read_text()
    for words in ("max_fails=0", "proxy_next_upstream error timeout", "valid=10s", "sleep 10"):
        assert words in docs, words
    assert "sleep 10" in (ROOT / "README.md").read_text()
